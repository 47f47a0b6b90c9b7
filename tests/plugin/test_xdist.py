"""The gate under pytest-xdist: ranks of parallel scenarios meet through private stores (no ports); the
workers hand their results to the controller (``workeroutput``), which writes one report.json and page and
lists the baselines no scenario used."""

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
    gone = pytester.path / "baselines" / "gloo" / "gone.json"
    gone.write_text("{}")
    stale = out / "report-gw0.json"  # what an older commgate left: never merged again
    stale.write_text(json.dumps({"scenarios": [{"name": "stale"}]}))
    result = pytester.runpytest_subprocess(
        "-n", "2", "--commgate-fault", "extra-collective", "--commgate-report-dir", str(out), str(pytester.path)
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*commgate: baselines no scenario used*", f"{gone}"])
    doc = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["a", "b"] and doc["summary"]["failed"] == 2
    for s in doc["scenarios"]:  # a failure's reason and findings reach the report
        assert s["status"] == "failed" and s["reason"].startswith("[model] ")
        assert any(f["kind"] == "model" and f["fail"] for f in s["findings"])
