"""The gate under pytest-xdist: ranks of parallel scenarios meet through private stores (no ports); the
workers' reports are merged into one report.json and page."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("xdist")


def test_two_workers_run_scenarios_side_by_side(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("a")
    scenario_file("b", scheme="zero1")
    pytester.runpytest_subprocess("-n", "2", "--commgate-update-baselines").assert_outcomes(passed=2)
    out = pytester.path / "out"
    pytester.runpytest_subprocess("-n", "2", "--commgate-report-dir", str(out)).assert_outcomes(passed=2)
    doc = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["a", "b"] and doc["summary"]["passed"] == 2
    assert (out / "index.html").exists()
    result = pytester.runpytest_subprocess("-n", "2", "--commgate-fault", "extra-collective")
    result.assert_outcomes(failed=2)
