"""--commgate-backend: every scenario on the named backend (NCCL needs GPUs: skipped with the reason)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def test_nccl_without_gpus_is_skipped_with_the_reason(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("commgate.run.launcher.gpu_visible", lambda: False)
    scenario_file("g")
    result = pytester.runpytest("--commgate-backend", "nccl", "-rs", "--junitxml", "out.xml")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs GPUs (marker gpu or backend nccl); this machine has none*"])
    xml = (pytester.path / "out.xml").read_text()
    assert 'name="g"' in xml and "<skipped" in xml


def test_an_unknown_backend_is_a_usage_error(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    result = pytester.runpytest("--commgate-backend", "mpi")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --commgate-backend: invalid choice: 'mpi'*"])
