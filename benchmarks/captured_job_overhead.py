"""What ``commgate capture`` costs a real job: nanoGPT's train.py (tests/data/nanogpt) under
``torchrun --nproc-per-node 2`` on CPU gloo, run with and without the capture, interleaved (A B A B ...),
so that a drifting machine weighs on both alike.

    .venv/bin/python benchmarks/captured_job_overhead.py [--pairs 5] [--iters 30]

Per run: nanoGPT's own time per iteration (its ``iter k: ... time X ms`` lines, the median of iterations
5 and later; rank 0) and the job's wall time (torchrun's start to its exit, the capture's files written).
Prints each variant's medians over the runs and the ratios captured / bare.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)


def run(job: Path, command: list[str], capture_dir: Path | None) -> tuple[float, float]:
    """(median ms per iteration from iteration 5 on, wall seconds) of one run."""
    full = (
        command
        if capture_dir is None
        else [sys.executable, "-m", "commgate", "capture", "-o", str(capture_dir), "--", *command]
    )
    started = time.monotonic()
    done = subprocess.run(full, cwd=job, capture_output=True, text=True, timeout=600, check=True)
    wall = time.monotonic() - started
    times = [float(ms) for it, ms in ITER.findall(done.stdout) if int(it) >= 5]
    return statistics.median(times), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "data" / "nanogpt"))
    from job import nanogpt_job

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "nanogpt"
        command = nanogpt_job(job, max_iters=a.iters)
        results: dict[str, list[tuple[float, float]]] = {"bare": [], "captured": []}
        for i in range(a.pairs):
            order = ("bare", "captured") if i % 2 == 0 else ("captured", "bare")
            for variant in order:
                where = Path(tmp) / f"capture-{i}" if variant == "captured" else None
                results[variant].append(run(job, command, where))
                print(
                    f"pair {i} {variant}: {results[variant][-1][0]:.2f} ms/iter, {results[variant][-1][1]:.2f} s wall",
                    flush=True,
                )
    med = {v: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for v, rs in results.items()}
    for v, (ms, wall) in med.items():
        print(
            f"{v:>9}: {ms:.2f} ms per iteration, {wall:.2f} s wall (medians of {a.pairs} runs, {os.cpu_count()} cores)"
        )
    print(
        f"ratio captured / bare: {med['captured'][0] / med['bare'][0]:.3f} per iteration, "
        f"{med['captured'][1] / med['bare'][1]:.3f} wall"
    )


if __name__ == "__main__":
    main()
