"""--commgate-report-dir: the run's report.json, valid against the published schema, and the HTML page."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from commgate.report.report import validate


def test_report_dir_gets_a_valid_report(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    out = pytester.path / "out"
    result = pytester.runpytest("--commgate-update-baselines", "--commgate-report-dir", str(out))
    result.assert_outcomes(passed=1)
    doc = json.loads((out / "report.json").read_text())
    validate(doc)
    assert [s["name"] for s in doc["scenarios"]] == ["g"] and doc["summary"]["passed"] == 1
    assert (out / "trace.json").exists() and (out / "plots" / "volume.png").exists()
    page = (out / "index.html").read_text()
    assert '<details id="d-g">' in page and 'aria-label="timeline of g"' in page  # its own figures, inline
    result.stdout.fnmatch_lines([f"commgate report: {out / 'index.html'}"])
