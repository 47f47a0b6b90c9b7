"""--commgate-backend: every scenario on the named backend (NCCL needs GPUs: skipped with the reason)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


def test_nccl_without_gpus_is_skipped_with_the_reason(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("commgate.run.launcher.gpu_visible", lambda: False)
    scenario_file("g")
    argv = ["--commgate-backend", "nccl", "-rs", "--junitxml", "out.xml", "--commgate-report-dir", "report"]
    result = pytester.runpytest(*argv)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs GPUs (marker gpu or backend nccl); this machine has none*"])
    xml = (pytester.path / "out.xml").read_text()
    assert 'name="g"' in xml and "<skipped" in xml
    (entry,) = json.loads((pytester.path / "report" / "report.json").read_text())["scenarios"]
    assert entry["status"] == "skipped" and "this machine has none" in entry["reason"]  # the report lists it too
    assert "this machine has none" in (pytester.path / "report" / "index.html").read_text()


def test_an_unknown_backend_is_a_usage_error(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    result = pytester.runpytest("--commgate-backend", "mpi")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --commgate-backend: invalid choice: 'mpi'*"])
