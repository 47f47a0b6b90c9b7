"""--commgate-report-dir: the run's report.json, valid against the published schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.report import validate


def test_report_dir_gets_a_valid_report(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    out = pytester.path / "out"
    pytester.runpytest("--commgate-update-baselines", "--commgate-report-dir", str(out)).assert_outcomes(passed=1)
    doc = json.loads((out / "report.json").read_text())
    validate(doc)
    assert [s["name"] for s in doc["scenarios"]] == ["g"] and doc["summary"]["passed"] == 1
