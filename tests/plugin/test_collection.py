"""Scenario files are collected as tests: ids, sweeps, markers, -k, bad files, hardware skips."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def test_scenarios_and_sweeps_are_items_with_readable_ids(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("a")
    scenario_file("b", tail="sweep:\n  model.s: [128, 256]\n")
    pytester.makefile(".yaml", other="key: value\n")  # not a scenario: not collected
    result = pytester.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["a.yaml::a", "b.yaml::b[[]s=128[]]", "b.yaml::b[[]s=256[]]", "3 tests collected*"])


def test_keyword_and_marker_selection(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("fast")
    scenario_file("night", tail="markers: [nightly]\n")
    pytester.runpytest("--collect-only", "-q", "-k", "night").stdout.fnmatch_lines(["night.yaml::night", "1/2 *"])
    result = pytester.runpytest("--collect-only", "-q", "-m", "not nightly", "--strict-markers")
    result.stdout.fnmatch_lines(["fast.yaml::fast", "1/2 *"])


def test_a_malformed_scenario_is_a_one_line_collection_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("bad", extra=", tp: 3")  # 8 heads are not divisible by 3
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*bad.yaml*: $.parallelism*"])
    assert "Traceback" not in result.stdout.str()


def test_hardware_this_machine_lacks_is_a_skip_with_the_reason(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("commgate.run.launcher.gpu_visible", lambda: False)
    scenario_file("gpu", tail="markers: [gpu]\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs GPUs (marker gpu or backend nccl); this machine has none*"])
