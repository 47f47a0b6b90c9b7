"""The command line's standard output, which may go away while a command runs.

``commgate run | head -1`` closes the pipe after the first line; a full disk (``> /dev/full``) or a closed
descriptor (``>&-``) refuses every write. Left to Python, the first ``print`` after that raised out of the
command: a run stopped halfway, with its report unwritten and exit status 0 (or 120, or a traceback). Here
the command goes on to its end, its report and its true exit status, with its output dropped from that
point: a reader that went away (a broken pipe) wanted no more, and that is all; any other failure to write
is said once on stderr at the end, and the exit status says it (``exit_status``).
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, TextIO


class Stdout(io.TextIOBase):
    """``sys.stdout`` for the command line: writes pass through until one fails, then go nowhere."""

    def __init__(self, inner: TextIO | None) -> None:
        super().__init__()
        self._inner = inner
        self.failed = "" if inner is not None else "standard output is closed"
        """Why output was dropped, or '' (also after a broken pipe: the reader left, which is not a failure)."""

    def _drop(self, exc: OSError) -> None:
        if not isinstance(exc, BrokenPipeError) and not self.failed:
            self.failed = f"cannot write to standard output ({exc.strerror or type(exc).__name__})"
        inner, self._inner = self._inner, None
        if inner is not None:  # its buffer would be flushed again, and fail again, at exit
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, inner.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass

    def write(self, s: str) -> int:
        if self._inner is not None:
            try:
                try:
                    self._inner.write(s)
                except UnicodeEncodeError:  # a path of the user's under an ASCII locale: escaped, as on stderr
                    self._inner.write(s.encode(self.encoding, "backslashreplace").decode(self.encoding))
            except OSError as exc:
                self._drop(exc)
        return len(s)

    def flush(self) -> None:
        if self._inner is not None:
            try:
                self._inner.flush()
            except OSError as exc:
                self._drop(exc)

    def isatty(self) -> bool:
        return self._inner is not None and self._inner.isatty()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # io.TextIOBase's own would refuse, and shadow __getattr__
        if self._inner is None:
            raise io.UnsupportedOperation("standard output is gone")
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", None) or "utf-8"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def plug_closed() -> TextIO | None:
    """Descriptors 0, 1 and 2 that were closed when the command started (``>&-``, ``2>&-``), each given
    /dev/null: the next file or socket the command opened took the closed number, so the forkserver and the
    ranks it starts wrote their output into it, and every scenario failed (found by an adversarial pass). With
    stderr closed, ``sys.stderr`` is None and the first message raised: a stream on /dev/null is returned to
    stand in for it (None where stderr was open). ``Stdout`` still says that standard output was closed."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)  # inheritable, as dup2 makes it
                os.close(null)
            else:  # os.open's are not: the forkserver would start with it closed again
                os.set_inheritable(fd, True)
    return open(2, "w", closefd=False) if sys.stderr is None else None


def exit_status(out: Stdout, status: int) -> int:
    """The command's exit status, once its output is known: a failure to write it (not a reader that left)
    is said on stderr, and a command that otherwise succeeded exits 2 (its output is lost); a failed one
    keeps its own status."""
    out.flush()  # a failure here is caught and recorded like any other write's
    if out.failed:
        print(f"commgate: {out.failed}; the output was lost from there on", file=sys.stderr)
        return status or 2
    return status
