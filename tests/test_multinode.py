"""Two torchrun agents on this machine as two nodes (``--nnodes 2``, c10d rendezvous on loopback), one
rank each, running a DDP and a pipeline scenario over gloo: every byte the ranks exchange crosses the
"node" boundary, and the captured traffic matrix must equal the model's."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multinode

SCENARIOS = {
    "mn-ddp": "parallelism: {scheme: ddp, dp: 2}",
    "mn-pp": "parallelism: {scheme: pp, pp: 2, micro_batches: 2}",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_over_loopback(tmp_path: Path) -> None:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun is not installed next to this Python")
    for name, par in SCENARIOS.items():
        (tmp_path / f"{name}.yaml").write_text(
            f"schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu}}\n{par}\nsteps: 2\n"
        )
    out, port = tmp_path / "out", free_port()
    agents = [
        subprocess.Popen(
            [
                exe,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--max-restarts",
                "0",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "commgate-test",
                "-m",
                "commgate",
                "run",
                str(tmp_path),
                "--report-dir",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [a.communicate(timeout=400)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)[-4000:]
    doc = json.loads((out / "report.json").read_text())
    assert {s["name"]: s["status"] for s in doc["scenarios"]} == {"mn-ddp": "passed", "mn-pp": "passed"}
    for s in doc["scenarios"]:
        measured, predicted = s["traffic_matrix"]["measured"], s["traffic_matrix"]["predicted"]
        assert measured == predicted
        crossing = {(t["src"], t["dst"]): t["bytes_per_step"] for t in measured}
        assert set(crossing) == {(0, 1), (1, 0)} and all(b > 0 for b in crossing.values())
    ddp = next(s for s in doc["scenarios"] if s["name"] == "mn-ddp")
    # a 2-rank ring all-reduce sends each rank's whole gradient once to the other node
    gradient = next(c for c in ddp["collectives"] if c["op"] == "all_reduce")["measured_bytes"] / 2
    assert min(t["bytes_per_step"] for t in ddp["traffic_matrix"]["measured"]) >= gradient
