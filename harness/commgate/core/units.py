"""Numbers as commgate shows and stores them: exact where they are exact, bytes in binary units."""

from __future__ import annotations

from fractions import Fraction


def number(x: int | Fraction) -> int | float:
    """An exact integer when it is one, else the nearest float."""
    f = Fraction(x)
    return f.numerator if f.denominator == 1 else float(f)


def shown(x: int | Fraction) -> str:
    """A count for people: an exact integer as one, a fraction rounded (6 significant digits)."""
    f = Fraction(x)
    return str(f.numerator) if f.denominator == 1 else f"{float(f):.6g}"


def human_bytes(x: float | Fraction) -> str:
    v = float(x)
    sign = "-" if v < 0 else ""
    v = abs(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.2f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")
