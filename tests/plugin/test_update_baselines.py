"""--commgate-update-baselines, and the whole cycle: create -> pass -> change -> fail -> update -> pass."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from commgate.judge.baseline import load


def test_create_pass_change_fail_update_pass(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    first = pytester.runpytest()
    first.assert_outcomes(failed=1)  # a missing baseline is written, and the test fails
    first.stdout.fnmatch_lines(["*[[]baseline[]] no baseline yet: wrote *baselines/gloo/g.json*"])
    stored = load(pytester.path / "baselines" / "gloo" / "g.json")
    assert stored.scenario == "g" and stored.provenance["world_size"] == 2 and stored.calls

    pytester.runpytest().assert_outcomes(passed=1)

    scenario_file("g", extra=", ddp_bucket_mb: 0.5")  # the model follows; the baseline does not
    changed = pytester.runpytest()
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines(
        [
            "*[[]baseline[]] communication differs from the baseline*",
            "*calls [[]steps[]] all_reduce fp32 * obtained *, expected *",
            "*accept it with --commgate-update-baselines*",
        ]
    )
    assert "[model]" not in changed.stdout.str()

    updated = pytester.runpytest("--commgate-update-baselines")
    updated.assert_outcomes(passed=1)
    updated.stdout.fnmatch_lines(["*commgate baselines*", "g: *g.json updated: *calls [[]steps[]] *"])
    pytester.runpytest().assert_outcomes(passed=1)


def test_update_with_a_fault_is_a_usage_error(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    result = pytester.runpytest("--commgate-update-baselines", "--commgate-fault", "extra-collective")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*would store a faulty run as the baseline*"])


def test_baselines_are_canonical_json(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=1)
    text = (pytester.path / "baselines" / "gloo" / "g.json").read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_an_unchanged_baseline_is_left_as_it_is(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    """--commgate-update-baselines leaves a baseline whose communication did not change byte for byte as it
    was (so git diff shows only real changes); --commgate-refresh-latency stores the new latency samples."""
    scenario_file("g")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=1)
    path = pytester.path / "baselines" / "gloo" / "g.json"
    before = path.read_bytes()
    again = pytester.runpytest("--commgate-update-baselines")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["g: *g.json left as it is: communication unchanged*"])
    assert path.read_bytes() == before
    refreshed = pytester.runpytest("--commgate-update-baselines", "--commgate-refresh-latency")
    refreshed.assert_outcomes(passed=1)
    refreshed.stdout.fnmatch_lines(["g: *g.json *"])
    assert path.read_bytes() != before  # new provenance date and this run's samples
    alone = pytester.runpytest("--commgate-refresh-latency")
    assert alone.ret == pytest.ExitCode.USAGE_ERROR
