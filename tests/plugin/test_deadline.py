"""--commgate-deadline: a hung scenario fails at the deadline naming the call each rank was in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def test_a_hang_fails_at_the_deadline(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("h", tail="workload: commgate.run.workloads.faults:hang\n")
    result = pytester.runpytest("--commgate-deadline", "8", "--junitxml", "out.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(  # the scenario named once ("h: h: ...": found by an adversarial pass)
        ["h: deadline of 8 s passed; the last call each rank issued:", "  rank 0: in all_reduce*"]
    )
    assert "h: h:" not in result.stdout.str()
    assert "<failure" in (pytester.path / "out.xml").read_text()


@pytest.mark.parametrize("value", ["0", "nan", "inf"])
def test_a_non_positive_or_infinite_deadline_is_a_usage_error(
    value: str, pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """``nan`` passed the ``<= 0`` check and switched the deadline off (found by an adversarial pass)."""
    scenario_file("g")
    result = pytester.runpytest("--commgate-deadline", value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--commgate-deadline {value}: expected a positive, finite number of seconds*"])
