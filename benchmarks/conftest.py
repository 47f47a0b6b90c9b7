"""Options and session hooks of the collective microbenchmarks (``test_collectives.py``).

After the sweep the terminal summary shows, per point, the harness path against the bare torch.distributed
loop of the same run; ``--commgate-curve-dir DIR`` fits the effective-bandwidth curve from the sweep and
stores it as ``DIR/bandwidth-{backend}.json`` for this hardware (what the time model reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

RESULTS = pytest.StashKey[list[dict[str, Any]]]()
"""One row per finished benchmark (the extra_info it stored), in run order."""


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = []


@pytest.fixture
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Where a microbenchmark leaves its row for the session summary and the curve."""
    return request.config.stash[RESULTS]


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("commgate-bench", "commgate collective microbenchmarks")
    g.addoption(
        "--commgate-bench-worlds",
        default="2,4,8",
        help="world sizes to sweep; every divisor >= 2 of each is a group size (default 2,4,8)",
    )
    g.addoption(
        "--commgate-bench-max-bytes",
        type=int,
        default=64 << 20,
        help="largest message in bytes; sizes go 4 B, 64 B, ... x16 up to it (default 64 MiB)",
    )
    g.addoption(
        "--commgate-bench-ops",
        default="all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv",
        help="comma-separated ops (default: all six)",
    )
    g.addoption(
        "--commgate-bench-backend",
        default="gloo",
        choices=["gloo", "nccl"],
        help="gloo on CPU (default), or nccl (RCCL on ROCm) with one GPU per rank on one node",
    )
    g.addoption(
        "--commgate-curve-dir",
        type=Path,
        help="fit the effective-bandwidth curve from this sweep and store it as DIR/bandwidth-{backend}.json",
    )


def hardware(backend: str) -> str:
    """The fingerprint a scenario's capture records on this machine (``Capture.stack``), so that the time
    model finds this curve for it."""
    from commgate.run.rank import stack

    return stack(backend, local_ranks=1)["hardware"] or ""  # the fingerprint only


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    from commgate.report.benchreport import harness_vs_bare

    rows = config.stash.get(RESULTS, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section("commgate: harness vs bare torch.distributed (medians, same run)")
    lines, worst = harness_vs_bare(rows)
    for line in lines:
        tr.write_line(line)
    if worst is not None:
        tr.write_line(f"largest harness/bare ratio: {worst:.3f} (goal <= 1.1)")
    curve_dir = config.getoption("--commgate-curve-dir")
    if curve_dir is not None:
        from commgate.judge.store import BaselineStore
        from commgate.report import bandwidth
        from commgate.report.benchreport import samples

        compute = {r["world"]: r["flops"] for r in rows if r["op"] == "gemm"}
        if not samples(rows):
            tr.write_line("no sweep points ran (test_collective): bandwidth curve not written")
            return
        backend = config.getoption("--commgate-bench-backend")
        curve = bandwidth.fit(samples(rows), backend=backend, hardware=hardware(backend), compute_flops=compute)
        path = bandwidth.store(BaselineStore(curve_dir).curve_path(backend), curve)
        tr.write_line(f"bandwidth curve for {curve.hardware!r}: {len(curve.samples)} points -> {path}")
        tr.write_line("the time model's u is reset to 1 for it: calibrate with `commgate calibrate REPORT.json`")
