"""Errors a user can act on: each problem is one line naming the file, the place, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One thing wrong with one input file.

    ``path`` is a JSON path into the document (``$.parallelism.tp``); ``line`` is 1-based when known.
    """

    file: str
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class CommgateError(Exception):
    """Base of the errors commgate reports as one-line messages (never as a traceback)."""


class InputError(CommgateError):
    """An input file is invalid; carries every problem found, not just the first, one line each."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.file, p.line or 0, p.path, p.message))
        super().__init__("\n".join(str(p) for p in self.problems))


class ScenarioError(InputError):
    """A scenario file (or a set of them) is invalid."""


class DocumentError(InputError):
    """A JSON document (report, baseline, bandwidth curve) cannot be read, parsed, migrated or validated."""


class UsageError(CommgateError):
    """The command line asks for something impossible or contradictory."""


class WriteError(CommgateError):
    """A file or directory commgate must write cannot be written (read-only, full, not a directory, a name
    too long): one line naming the path, the reason and the fix."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (at most 200 characters), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"
