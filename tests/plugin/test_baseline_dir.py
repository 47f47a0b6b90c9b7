"""--commgate-baseline-dir, and what the gate does with bad or unused baseline files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def test_baselines_go_where_told(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    where = pytester.path / "elsewhere"
    pytester.runpytest("--commgate-update-baselines", "--commgate-baseline-dir", str(where)).assert_outcomes(passed=1)
    assert (where / "gloo" / "g.json").exists() and not (pytester.path / "baselines").exists()


def test_a_truncated_baseline_is_a_one_line_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("g")
    scenario_file("h")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=2)
    path = pytester.path / "baselines" / "gloo" / "g.json"
    path.write_text(path.read_text()[:200])
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [f"g: {path}:*: not valid JSON (*); delete it: the next gated run (pytest, commgate run --gate, commgate "
         "check) writes it anew"]
    )  # fmt: skip
    assert "Traceback" not in result.stdout.str()
    assert "baselines no scenario used" not in result.stdout.str()  # it is g's own (it was listed: an adversarial pass)


def test_under_commgate_run_a_bad_baseline_is_its_scenarios_error_and_the_suite_goes_on(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """Found by an adversarial pass: ``commgate run --gate`` stopped the whole suite at the first baseline it
    could not read (or write), with no report.json; pytest fails that one test. Now the scenario is an error
    with the one line, the others run, and the report holds them all."""
    import json
    import subprocess
    import sys

    scenario_file("g")
    scenario_file("h")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=2)
    path = pytester.path / "baselines" / "gloo" / "g.json"
    path.write_text(path.read_text()[:200])
    run = subprocess.run(
        [sys.executable, "-m", "commgate", "run", ".", "--gate", "--report-dir", "out"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "g.json:" in run.stdout and "not valid JSON" in run.stdout and "Traceback" not in run.stderr
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert {s["name"]: s["status"] for s in report["scenarios"]} == {"g": "error", "h": "passed"}


def test_unused_baselines_are_reported(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=1)
    gone = pytester.path / "baselines" / "gloo" / "gone.json"
    gone.write_text("{}")
    result = pytester.runpytest(str(pytester.path))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*commgate: baselines no scenario used*", f"{gone}"])


def test_a_baseline_dir_that_cannot_be_written_fails_in_one_line_before_the_run(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("g")
    (pytester.path / "dangling").symlink_to(pytester.path / "gone")
    result = pytester.runpytest("--commgate-baseline-dir", str(pytester.path / "dangling"))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"{pytester.path}/dangling: cannot write baselines there: * is a link to *, which "
                                 "does not exist; give another --commgate-baseline-dir"])  # fmt: skip
    out = result.stdout.str()
    assert "Traceback" not in out and "CallInfo" not in out and "2 ranks" not in out


def test_a_baseline_dir_that_is_a_file_is_a_usage_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """Every scenario FAILED on it, as if the gate had found a regression in each (an adversarial pass); a
    report directory that is a file was already a usage error."""
    scenario_file("g")
    (pytester.path / "baselines.json").write_text("{}\n")
    result = pytester.runpytest("--commgate-baseline-dir", str(pytester.path / "baselines.json"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --commgate-baseline-dir {pytester.path}/baselines.json: not a directory; "
                                 "give a directory of baselines"])  # fmt: skip
