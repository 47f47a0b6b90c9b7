"""How numbers are shown to people: exact integers as integers, fractions rounded."""

from __future__ import annotations

from fractions import Fraction

from commgate.core.units import human_bytes, number, shown


def test_counts_are_integers_or_rounded_fractions() -> None:
    assert shown(4) == "4" and shown(Fraction(8, 2)) == "4"
    assert shown(Fraction(-592, 3)) == "-197.33"  # was -197.33333333333334
    assert shown(Fraction(1280, 3)) == "426.67"
    assert shown(Fraction(7907368, 3)) == "2635789.33"  # was 2.63589e+06
    assert shown(Fraction(1, 300)) == "0.00333"
    assert number(Fraction(1280, 3)) == 1280 / 3 and number(Fraction(6, 3)) == 2  # the JSON form stays exact-ish
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(12) == "12 B"
