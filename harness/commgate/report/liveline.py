"""What a running scenario is doing, for the person waiting on ``commgate run``.

The launcher tells its ``progress`` callback several times a second (the forkserver's start, the ranks'
phase, step k of n; ``commgate.run.launcher``). On a terminal that is one line below the scenario's,
rewritten in place and cleared before its result (not on ``TERM=dumb``); elsewhere (a CI log) a line is
printed only after ``QUIET_S`` without one, so that a short run prints nothing more and a long one is never
silent.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TextIO

QUIET_S = 15.0


class LiveLine:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty() and os.environ.get("TERM") != "dumb"  # a dumb terminal cannot rewrite a line
        self.scenario = ""
        self.shown = ""
        self.last = time.monotonic()

    def start(self, scenario: str) -> None:
        """A scenario begins: its id prefixes the lines printed off a terminal."""
        self.scenario, self.shown, self.last = scenario, "", time.monotonic()

    def __call__(self, text: str) -> None:
        if self.tty:
            line = f"    {text}"[: shutil.get_terminal_size().columns - 1]
            if line != self.shown:
                self.stream.write(f"\r\033[K{line}")
                self.stream.flush()
                self.shown = line
        elif time.monotonic() - self.last >= QUIET_S:
            print(f"    {self.scenario}: {text}", file=self.stream, flush=True)
            self.last = time.monotonic()

    def clear(self) -> None:
        """Before the scenario's result: the line rewritten in place is removed."""
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self.shown = ""
