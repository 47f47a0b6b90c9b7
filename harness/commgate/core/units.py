"""Numbers as commgate shows and stores them: exact where they are exact, bytes in binary units."""

from __future__ import annotations

from fractions import Fraction


def number(x: int | float | Fraction) -> int | float:
    """An exact integer when it is one, else the nearest float."""
    f = Fraction(x)
    return f.numerator if f.denominator == 1 else float(f)


def shown(x: int | float | Fraction) -> str:
    """A count for people: an exact integer as one, a fraction rounded to two decimals (three significant
    digits below 0.01), never in exponent form above that: 2635789.33, not 2.63589e+06."""
    f = Fraction(x)
    if f.denominator == 1:
        return str(f.numerator)
    return f"{float(f):.2f}" if abs(f) >= Fraction(1, 100) else f"{float(f):.3g}"


def signed(x: int | float | Fraction) -> str:
    """A difference for people: ``shown`` with a ``+`` when it is positive (``+4``, ``-0.50``, ``0``)."""
    return ("+" if x > 0 else "") + shown(x)


def human_bytes(x: float | Fraction) -> str:
    v = float(x)
    sign = "-" if v < 0 else ""
    v = abs(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.2f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")
