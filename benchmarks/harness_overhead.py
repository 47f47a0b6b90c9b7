"""The harness's own cost per scenario: wall time beyond the scenario's steps, on local gloo ranks.

    .venv/bin/python benchmarks/harness_overhead.py [--rounds 5] [PATH ...]

Runs each scenario (default: the DDP and ZeRO-1 scenarios of the default suite) ``--rounds`` times
through the local launcher, interleaved, and prints per scenario the median of

* wall: ``launch_local`` from call to merged capture;
* steps: rank 0's warm-up and measured steps (``Capture.timeline``);
* build: rank 0's workload and engine construction (model, ``DistributedDataParallel``,
  ``deepspeed.initialize``): the framework's cost, not the harness's;
* overhead = wall - steps - build: forking the ranks, rendezvous, collecting the calls, teardown
  (goal: <= 1 s).

The first round also starts the forkserver (torch and DeepSpeed imported once); it is reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from commgate.model.loader import load_paths
from commgate.run.launcher import launch_local

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "scenarios" / "ddp.yaml", ROOT / "scenarios" / "zero1.yaml"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    scenarios = load_paths(a.paths)
    rows: dict[str, list[tuple[float, float, float]]] = {s.id: [] for s in scenarios}
    t0 = time.monotonic()
    first = launch_local(scenarios[0])  # starts the forkserver
    print(f"first run, forkserver start included: {time.monotonic() - t0:.2f} s {first.timeline}", flush=True)
    for r in range(a.rounds):
        for s in scenarios if r % 2 == 0 else reversed(scenarios):
            t = time.monotonic()
            cap = launch_local(s)
            wall = time.monotonic() - t
            rows[s.id].append((wall, cap.timeline["steps"], cap.timeline["build"]))
            print(f"  round {r} {s.id}: wall {wall:.2f} s {cap.timeline}", file=sys.stderr, flush=True)
    print(f"{'scenario':<22} {'ranks':>5} {'wall':>7} {'steps':>7} {'build':>7} {'overhead':>9}  (medians, s)")
    for s in scenarios:
        wall, steps, build = (statistics.median(x[i] for x in rows[s.id]) for i in range(3))
        over = statistics.median(w - st - b for w, st, b in rows[s.id])
        print(f"{s.id:<22} {s.world_size:>5} {wall:7.2f} {steps:7.2f} {build:7.2f} {over:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
