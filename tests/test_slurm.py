"""The nightly job under a real Slurm: ``ci/slurm-in-a-box.sh`` brings up a two-node cluster on this
machine (network namespaces joined by a veth pair, slurmctld and one slurmd per node), and
``ci/nightly.sbatch`` is submitted to it unchanged with ``sbatch --wait``, as users submit it. One rank
per node, so every byte the ranks exchange crosses the link between the nodes. Root and Linux only;
skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[1]
BOX = ROOT / "ci" / "slurm-in-a-box.sh"


def refusal() -> str | None:
    if os.uname().sysname != "Linux":
        return "Slurm in a box needs Linux network namespaces"
    if os.geteuid() != 0:
        return "Slurm in a box needs root (network namespaces, daemons)"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return "Slurm is not installed and apt-get is not there to install it"
    return None


pytestmark.append(pytest.mark.skipif(refusal() is not None, reason=str(refusal())))


def box(*command: str, tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHON": sys.executable}
    run = subprocess.run([str(BOX), *command], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if run.returncode == 3:
        pytest.skip(f"Slurm cannot be installed here: {run.stderr.strip().splitlines()[-1:]}")
    return run


def nightly(tmp: Path, suite: Path | str, baselines: Path | str = "baselines") -> subprocess.CompletedProcess[str]:
    export = f"ALL,GPUS_PER_NODE=1,BENCH=0,SUITE={suite},REPORTS={tmp / 'reports'},BASELINES={baselines}"
    return box("sbatch", "--wait", f"--output={tmp}/%x-%j.out", f"--export={export}", "ci/nightly.sbatch", tmp=tmp)


def test_the_nightly_job_runs_across_two_slurm_nodes_and_its_report_matches_the_model(tmp_path: Path) -> None:
    run = nightly(tmp_path, "ci/box")
    log = "".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert run.returncode == 0, run.stderr[-3000:] + log[-3000:]
    assert "node0 and node1 idle" in run.stderr
    assert "commgate-nightly: COMPLETED, exit 0:0, nodes node[0-1]" in run.stderr  # Slurm's own word
    (report,) = (tmp_path / "reports").glob("*/report.json")  # where the script says: REPORTS/<date>-<job>
    doc = json.loads(report.read_text())
    assert {s["name"]: s["status"] for s in doc["scenarios"]} == {"box-ddp": "passed", "box-pp": "passed"}
    for s in doc["scenarios"]:
        measured, predicted = s["traffic_matrix"]["measured"], s["traffic_matrix"]["predicted"]
        assert measured == predicted  # one rank per node: this is the traffic between the nodes
        assert {(c["src"], c["dst"]) for c in measured} == {(0, 1), (1, 0)}
    assert (report.parent / "index.html").exists()


def test_a_failing_scenario_fails_the_slurm_job(tmp_path: Path) -> None:
    """A planted failure: a scenario with no baseline (the gate writes it and fails). The job's exit
    status, which ``sbatch --wait`` returns, is not zero."""
    suite = tmp_path / "suite"
    suite.mkdir()
    text = (ROOT / "ci" / "box" / "box-ddp.yaml").read_text().replace("name: box-ddp", "name: box-planted")
    (suite / "planted.yaml").write_text(text)
    baselines = tmp_path / "baselines"
    shutil.copytree(ROOT / "baselines", baselines)
    run = nightly(tmp_path, suite, baselines)
    assert run.returncode != 0
    assert "commgate-nightly: FAILED" in run.stderr, run.stderr[-3000:]
    (report,) = (tmp_path / "reports").glob("*/report.json")
    (s,) = json.loads(report.read_text())["scenarios"]
    assert s["status"] == "failed" and "no baseline yet" in s["reason"]


def test_a_job_past_its_time_limit_is_a_timeout_not_a_pass(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --time=1\nsleep 600\n")
    run = box("sbatch", "--wait", f"--output={tmp_path}/%x-%j.out", str(script), tmp=tmp_path)
    assert run.returncode != 0
    assert "timed out: Slurm cancelled it at its time limit" in run.stderr, run.stderr[-2000:]
