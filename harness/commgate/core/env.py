"""The environment variables and command-line values commgate reads, each parsed in one place, so that a
value that is not one (``COMMGATE_STAMPS=false`` read as "not 0", ``--deadline nan``, an unset variable's
empty path read as the working directory) is refused in one line instead of taken for something else.

``check()`` runs where a command or a pytest session starts: a bad variable is a usage error before anything
runs, not a traceback minutes later in a forkserver.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from commgate.core.errors import UsageError

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
"""How a switch is written (any case); empty or unset is the switch's default."""


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    kind: str
    """``switch`` (ON or OFF) or ``seconds`` (a positive, finite number)."""
    means: str
    """What it does, in the words of a one-line error."""


SWITCH, SECONDS = "switch", "seconds"
VARIABLES = (
    Variable("COMMGATE_STAMPS", SWITCH, "0 (or false, no, off) stamps every call by the poller, not in C++"),
    Variable("COMMGATE_SKIP_MEMORY_CHECK", SWITCH, "1 (or true, yes, on) skips the memory check"),
    Variable("COMMGATE_FORKSERVER_START_S", SECONDS, "the bound on the forkserver's first start, in seconds"),
)
"""The variables of this kind (each read through ``switch`` or ``seconds``); the others have their own
checks where they are read (``COMMGATE_LINK``, ``COMMGATE_NETNS``: a link or a namespace)."""


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun (or srun + torchrun, or a launcher like them) sets in every rank: all of them set
make this process one rank of a job (``commgate.run.runners.under_torchrun``)."""
LAUNCHER_VARIABLES = (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE")
"""Those and ``LOCAL_WORLD_SIZE``: what accelerate's ``PartialState`` reads to set up a distributed state."""


@contextlib.contextmanager
def defaults(values: Mapping[str, str]) -> Iterator[None]:
    """While it lasts, each variable of ``values`` the environment does not set is set to its value (one the
    user set is kept); put back after."""
    unset = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in unset})
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


def switch(name: str, default: bool) -> bool:
    """The switch ``name``: ``default`` when unset or empty; ``UsageError`` naming it when it is neither on nor
    off."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in ON or word in OFF:
        return word in ON
    raise UsageError(f"environment variable {name}={value!r}: expected one of {', '.join(ON + OFF)}; {_means(name)}")


def seconds(name: str, default: float) -> float:
    """The positive, finite number of seconds ``name`` holds (``default`` when unset or empty); ``UsageError``
    naming it otherwise."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    try:
        return positive_seconds(value)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"environment variable {name}={value!r}: {exc}; {_means(name)}") from None


def check() -> None:
    """Every variable of ``VARIABLES`` that is set, read as it will be (the first bad one raises)."""
    for v in VARIABLES:
        if v.kind == SWITCH:
            switch(v.name, False)
        else:
            seconds(v.name, 1.0)


def _means(name: str) -> str:
    return next(v.means for v in VARIABLES if v.name == name) + ", or unset it"


def positive_seconds(text: str) -> float:
    """An argument type: a positive, finite number (``nan`` and ``inf`` parse as floats and pass ``> 0``
    checks, or fail none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive, finite number of seconds")
    return value


def path(text: str) -> Path:
    """An argument type: a path that is not empty (``Path("")`` is the working directory, where an unset
    ``$VAR`` would have the files written)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset variable?): give a file or directory")
    return Path(text)


def path_text(text: str) -> str:
    """``path``'s check for an argument kept as text (the scenario paths: ``commgate validate ""`` validated the
    working directory; found by an adversarial pass)."""
    path(text)
    return text


def nonempty(text: str) -> str:
    """An argument type: a value that is not empty (``--name ''`` silently meant the default name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty (an unset variable?): give a value, or leave the option out")
    return text


def python_command(*, anywhere: bool = False) -> str:
    """This interpreter as a command commgate suggests can name it: ``python`` where that is what the shell
    finds (an activated environment), else its path, relative to the working directory when inside it
    (``.venv/bin/python``, the README's way) unless the command is for ``anywhere``: a bare ``python`` would
    be another one, without commgate."""
    import shutil
    import sys

    found = shutil.which("python")
    if found and Path(found).absolute() == Path(sys.executable).absolute():
        return "python"
    here = Path(sys.executable).absolute()
    return str(here.relative_to(Path.cwd())) if here.is_relative_to(Path.cwd()) and not anywhere else str(here)
