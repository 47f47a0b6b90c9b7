"""Where torch builds the C++ extensions commgate's ranks load (DeepSpeed's CPU comm op), and the build
locks found there.

torch builds into ``TORCH_EXTENSIONS_DIR``, else into one directory per Python version and device
(``~/.cache/torch_extensions/py311_cpu``) shared by every environment, while a build's flags name its
environment's paths: two checkouts would rebuild the op alternately (minutes each on two cores). Unless
the user set ``TORCH_EXTENSIONS_DIR``, commgate's forkserver builds into a directory of this environment's
own (``~/.cache/commgate/torch_extensions/<environment>``): once per environment.

A build that is killed leaves its ``lock`` file behind, and every later build waits for it forever:
``build_locks`` finds them, for the messages that name them, and ``builder`` tells a lock whose build is
still running (the process holding the lock, or one working in its directory: ninja, the compiler) from one
left behind (``stale``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

ENV = "TORCH_EXTENSIONS_DIR"


def environment_dir() -> Path:
    """This Python environment's own build directory (named after its prefix and Python version)."""
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}"
    return Path.home() / ".cache" / "commgate" / "torch_extensions" / f"{python}-{tag}"


def use_environment_dir() -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` to this environment's own directory unless the user set it (before the
    forkserver starts: it and the ranks inherit it); the directory in use."""
    os.environ.setdefault(ENV, str(environment_dir()))
    return Path(os.environ[ENV])


def ninja_first() -> None:
    """This environment's ``ninja`` (the ``ninja`` package's, in its ``bin``) first on ``PATH``, where it has
    one: torch builds an extension with whichever ``ninja`` ``PATH`` finds, and two versions (1.13 in the
    environment, 1.11 on the system) each take the other's build as changed, so a shell with the environment
    activated and one without rebuilt DeepSpeed's op alternately, 40 s to minutes each (found by an
    adversarial pass). Called in the ranks' forkserver, whose ranks build DeepSpeed's other ops too."""
    here = Path(sys.prefix) / "bin"
    path = os.environ.get("PATH", "")
    if (here / "ninja").is_file() and path.split(os.pathsep)[:1] != [str(here)]:
        os.environ["PATH"] = os.pathsep.join([str(here), *([path] if path else [])])


@contextlib.contextmanager
def own_ninja() -> Iterator[None]:
    """``ninja_first`` while torch builds or checks an extension in a process of the user's (``PATH`` then
    as it was)."""
    before = os.environ.get("PATH")
    ninja_first()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def build_locks() -> list[Path]:
    """Lock files in the build directories in use (``TORCH_EXTENSIONS_DIR``, else torch's default)."""
    root = Path(os.environ.get(ENV) or Path.home() / ".cache" / "torch_extensions")
    return sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock"))


def builder(lock: Path, among: Iterable[int] | None = None) -> int | None:
    """The pid of a process building behind ``lock``, of the processes ``among`` (default every one), None when
    none is (Linux's ``/proc``; elsewhere None): the one that holds it (torch keeps the lock file open from
    taking it to removing it; between those it checks the build with ninja for milliseconds, or builds for
    minutes), or one working in its directory (torch runs ninja there, and ninja the compiler)."""
    # the kernel names a working directory and an open file by their real paths; a command line as written
    real, held = os.path.realpath(lock.parent), os.path.realpath(lock)
    written = {str(lock.parent).encode(), real.encode()}
    entries = Path("/proc").glob("[0-9]*") if among is None else (Path(f"/proc/{pid}") for pid in among)
    for entry in entries:
        try:
            line = (entry / "cmdline").read_bytes()
            if os.readlink(entry / "cwd") == real or any(w in line for w in written):
                return int(entry.name)
            if any(os.readlink(fd) == held for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def stale(lock: Path, settle_s: float = 0.5) -> bool:
    """Whether ``lock`` is one a killed build left: it exists, and neither now nor ``settle_s`` later (the same
    file: torch closes the lock, then removes it) does any process on this machine hold it or build in its
    directory. Only this machine's processes are seen: a build on another node sharing the directory is not."""
    try:
        first = lock.stat().st_ino
        if builder(lock) is not None:
            return False
        time.sleep(settle_s)
        return lock.stat().st_ino == first and builder(lock) is None
    except OSError:  # removed meanwhile: released
        return False
