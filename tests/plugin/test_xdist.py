"""The gate under pytest-xdist: ranks of parallel scenarios meet through private stores (no ports)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("xdist")


def test_two_workers_run_scenarios_side_by_side(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("a")
    scenario_file("b", scheme="zero1")
    pytester.runpytest_subprocess("-n", "2", "--commgate-update-baselines").assert_outcomes(passed=2)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=2)
    result = pytester.runpytest_subprocess("-n", "2", "--commgate-fault", "extra-collective")
    result.assert_outcomes(failed=2)
