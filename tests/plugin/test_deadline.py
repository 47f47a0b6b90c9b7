"""--commgate-deadline: a hung scenario fails at the deadline naming the call each rank was in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def test_a_hang_fails_at_the_deadline(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("h", tail="workload: commgate.run.workloads.faults:hang\n")
    result = pytester.runpytest("--commgate-deadline", "8", "--junitxml", "out.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["h: h: deadline of 8 s passed; the last call each rank issued:", "  rank 0: in all_reduce*"]
    )
    assert "<failure" in (pytester.path / "out.xml").read_text()


def test_a_non_positive_deadline_is_a_usage_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("g")
    result = pytester.runpytest("--commgate-deadline", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--commgate-deadline 0: expected a positive number of seconds*"])
