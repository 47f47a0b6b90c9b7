"""``torchrun -m commgate run``: every process is a rank; rank 0 gathers, reconciles and reports."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = (
    "schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu}}\n"
    "parallelism: {{scheme: {scheme}, {degrees}}}\nsteps: 2\n"
)
# Every scheme that runs on 2 ranks, in one process each: what one scenario leaves behind (DeepSpeed's
# cached groups, ZeRO-3's patched F.linear) must not change the next one. c-four needs 4 ranks.
SEQUENCE = (
    ("a-zero1", "zero1", "dp: 2"),
    ("b-zero2", "zero2", "dp: 2"),
    ("c-zero3", "zero3", "dp: 2"),
    ("d-ddp", "ddp", "dp: 2"),
    ("e-tp", "tp", "tp: 2"),
    ("f-pp", "pp", "pp: 2"),
    ("g-moe", "moe", "dp: 2, moe: {experts: 2, ep: 2}"),
    ("h-four", "ddp", "dp: 4"),
)


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun is not installed next to this Python")
    return subprocess.run(
        [exe, "--standalone", "--nproc-per-node", "2", "-m", "commgate", "run", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_scenarios_in_sequence_under_torchrun(tmp_path: Path) -> None:
    for name, scheme, degrees in SEQUENCE:
        (tmp_path / f"{name}.yaml").write_text(SCENARIO.format(name=name, scheme=scheme, degrees=degrees))
    proc = torchrun(str(tmp_path), "--report-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 7  # printed once, by rank 0
    # commgate's own workloads read the loss without a warning on every rank (found by an adversarial pass)
    assert "UserWarning" not in proc.stderr, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    status = {s["name"]: s["status"] for s in doc["scenarios"]}
    assert status == {name: "skipped" if name == "h-four" else "passed" for name, _, _ in SEQUENCE}
    (ddp,) = [s for s in doc["scenarios"] if s["name"] == "d-ddp"]
    assert {c["rank"] for c in ddp["capture"]["calls"]} == {0, 1}  # gathered from both ranks
    assert all(c["unexplained_bytes"] == 0 for c in ddp["collectives"])


def test_a_crash_under_torchrun_fails_the_job(tmp_path: Path) -> None:
    text = SCENARIO.format(name="crash", scheme="ddp", degrees="dp: 2")
    text += "workload: commgate.run.workloads.faults:crash\n"
    (tmp_path / "crash.yaml").write_text(text)
    proc = torchrun(str(tmp_path / "crash.yaml"))
    assert proc.returncode != 0
    assert "crash: rank 1 raised" in proc.stderr and "planted crash on rank 1 at step 1" in proc.stderr
