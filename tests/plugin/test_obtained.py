"""The obtained file: a run whose communication differs from its baseline leaves ``<id>.obtained.json``
beside it (what it sent, in the baseline's schema), names it, and a run that matches removes it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from commgate.judge.baseline import load


def test_a_mismatch_leaves_the_obtained_baseline_which_accepts_the_change_when_copied(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path], accepted: Path
) -> None:
    expected = accepted
    obtained = expected.with_name("g.obtained.json")
    assert not obtained.exists()

    scenario_file("g", extra=", ddp_bucket_mb: 0.5")  # the model follows; the baseline does not
    changed = pytester.runpytest(str(pytester.path))
    changed.assert_outcomes(failed=1)
    # the baseline named by its path (a bare g.json read as a file where the user stands)
    changed.stdout.fnmatch_lines([f"*accept it with --commgate-update-baselines; or copy {obtained} over {expected}"])
    assert "baselines no scenario used" not in changed.stdout.str()  # the obtained file is no baseline
    accepted = load(obtained, scenario="g")  # a valid baseline of the scenario, with this run's calls
    assert accepted.calls != load(expected).calls

    shutil.copy(obtained, expected)  # accepting the change by hand, as --commgate-update-baselines would
    pytester.runpytest().assert_outcomes(passed=1)
    assert not obtained.exists()  # the run matched its baseline: nothing left to accept


def test_a_stale_obtained_file_is_removed_when_the_run_matches(pytester: pytest.Pytester, accepted: Path) -> None:
    stale = accepted.with_name("g.obtained.json")
    stale.write_text("{}")
    pytester.runpytest().assert_outcomes(passed=1)
    assert not stale.exists()
