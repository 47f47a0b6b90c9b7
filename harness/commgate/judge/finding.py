"""What a verdict says: a ``Finding`` (a failure or a warning) and the ``Difference`` records it carries.

A difference is data (what, obtained, expected, unit), not text: the console renders it as
``what: obtained X, expected Y (+Z)``, report.json stores it as numbers (``Finding.to_json``), and the
HTML page draws its table from those numbers (``commgate.report.htmlreport``), so no renderer reads
another's text. What the differences mean, where a pattern proves it (a bucket split, a dtype change:
``commgate.judge.causes``), is the finding's ``causes``: one line each, shown above the numbers.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from fractions import Fraction
from typing import Any, Literal

from commgate.core.units import number, shown, signed
from commgate.judge.causes import Cause

MAX_LINES = 12
"""Lines of a finding's causes, and of its numbers, the console shows (report.json has them all)."""

Kind = Literal["model", "paper", "baseline", "cold-start", "latency", "config", "time", "fault"]

Value = Fraction | int | float
"""An exact count (int, Fraction) or a measured share (float)."""


def shown_value(x: Value) -> str:
    """An exact count by ``shown``; a measured share (a float) to three decimals."""
    return f"{x:.3f}" if isinstance(x, float) else shown(x)


@dataclass(frozen=True, slots=True)
class Difference:
    """One thing obtained that differs from what was expected (the model, the baseline, the other side of
    ``commgate compare``)."""

    what: str
    obtained: Value
    expected: Value
    _: KW_ONLY
    unit: str = ""
    """The values' unit where ``what`` does not say it (``B/step``); empty for counts."""
    detail: str = ""
    """What the parentheses say instead of the signed difference (the model row a count came from, the
    error against its allowance); empty: the difference itself."""

    @property
    def difference(self) -> Fraction:
        """Obtained less expected, exactly."""
        return Fraction(self.obtained) - Fraction(self.expected)

    def text(self, labels: tuple[str, str] = ("obtained", "expected")) -> str:
        now, then = labels
        unit = f" {self.unit}" if self.unit else ""
        return (
            f"{self.what}: {now} {shown_value(self.obtained)}, {then} {shown_value(self.expected)}{unit} "
            f"({self.detail or signed(self.difference)})"
        )

    def to_json(self) -> dict[str, Any]:
        """Its record in report.json: the values as numbers, ``difference`` = obtained - expected."""
        return {
            "what": self.what,
            "obtained": number(self.obtained),
            "expected": number(self.expected),
            "unit": self.unit,
            "difference": number(self.difference),
            "detail": self.detail,
        }


def _bounded(lines: Sequence[str]) -> list[str]:
    """The first ``MAX_LINES`` of ``lines``, and how many more report.json has."""
    more = len(lines) - MAX_LINES
    return [*lines[:MAX_LINES], *([f"... and {more} more (report.json has them all)"] if more > 0 else [])]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One assertion of the gate that did not hold (``fail``), or a warning: what the differences mean
    (``causes``), what differs (its ``differences``), then the lines that are not a difference (``notes``),
    bounded in the console."""

    kind: Kind
    fail: bool
    title: str
    causes: tuple[Cause, ...] = ()
    """The patterns the differences prove, in words (``commgate.judge.causes.recognise``): the top lines."""
    differences: tuple[Difference, ...] = ()
    notes: tuple[str, ...] = ()
    """Lines after the differences: what is not obtained against expected (a paper term, a latency shift)."""
    hint: str = ""
    """How to accept the change, if it is intended, or what to do about it."""

    @property
    def lines(self) -> tuple[str, ...]:
        """Every line of it: its causes, then its differences, then its notes."""
        return (*(c.text for c in self.causes), *(d.text() for d in self.differences), *self.notes)

    def text(self) -> str:
        """The title, its causes, then its numbers: each of the two at most ``MAX_LINES``."""
        numbers = (*(d.text() for d in self.differences), *self.notes)
        shown_lines = [*_bounded([c.text for c in self.causes]), *_bounded(numbers)]
        body = "".join(f"\n    {line}" for line in shown_lines)
        return f"[{self.kind}] {self.title}{body}" + (f"\n    {self.hint}" if self.hint else "")

    def to_json(self) -> dict[str, Any]:
        """Its record in report.json: the lines as the console shows them, the causes, the differences as
        data, and the notes (the lines that are neither)."""
        return {
            "kind": self.kind,
            "fail": self.fail,
            "title": self.title,
            "lines": list(self.lines),
            "hint": self.hint,
            "causes": [c.to_json() for c in self.causes],
            "differences": [d.to_json() for d in self.differences],
            "notes": list(self.notes),
        }
