"""``commgate compare BEFORE AFTER``: identical runs pass, a planted volume change fails and is shown."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commgate.cli import main

DATA = Path(__file__).parent / "data" / "baselines"


def baseline_dir(tmp: Path, name: str, fixture: str) -> Path:
    (tmp / name / "gloo").mkdir(parents=True)
    shutil.copy(DATA / fixture, tmp / name / "gloo" / "ddp.json")
    return tmp / name


def test_identical_baseline_sets_compare_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = baseline_dir(tmp_path, "a", "ddp.json"), baseline_dir(tmp_path, "b", "ddp.json")
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "ddp-19m-dp4: unchanged (latency ~ on" in out and "0 of 1 scenario(s) changed" in out


def test_a_volume_change_fails_and_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = baseline_dir(tmp_path, "a", "ddp.json"), baseline_dir(tmp_path, "b", "ddp-split-bucket.json")
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "ddp-19m-dp4:",
        "    calls [steps] all_reduce fp32 1061888 B backward group [0, 1, 2, 3]: after 0, before 12 (-12)",
    ]
    assert out[-1] == "1 of 1 scenario(s) changed"


def test_reports_of_real_runs(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "commgate", "run", str(scenario), "--report-dir", str(tmp_path / "a")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    before = tmp_path / "a" / "report.json"
    assert main(["compare", str(before), str(before)]) == 0
    doc = json.loads(before.read_text())
    doc["scenarios"][0]["calls"][-1]["measured_calls"] += 1  # a planted extra call
    after = tmp_path / "after.json"
    after.write_text(json.dumps(doc))
    assert main(["compare", str(before), str(after)]) == 1


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a report"}')
    assert main(["compare", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{bad}: $: 'schema_version' is a required property"  # validated as a report
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(bad)]) == 2
    assert "no baseline files" in capsys.readouterr().err
