"""Emulated runs at production world size (issue 15): wall time and peak memory of rank 0 alone standing for
the job, each run reconciled with the model from rank 0's view.

    .venv/bin/python benchmarks/emulation.py [--only NAME] [--fits]

Targets (issue 15): the 1.3B preset under ZeRO-3 at dp = 256 (s = 16) in <= 5 min and <= 8 GB; 350M DDP at
dp = 1024 in <= 5 min; 13B ZeRO-3 at dp = 1024 in <= 15 min. Issue 31: 13B in <= 120 s and <= 8 GiB; Llama-3
70B under FSDP2 at dp = 512 x tp = 8 in <= 15 min. Peak memory is the largest sum of the resident sets of this
process and the rank processes it starts (sampled every 0.2 s), beside the largest of those processes alone and
the memory check's estimate for a rank (``commgate.run.budget``). Prints one line per run; exits 1 if a run does
not reconcile to 0 unexplained bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

RUNS = {
    # bf16: DeepSpeed's fp16 runs on GPUs only; 1.3B's preset dtype is fp16
    "zero3-1.3B-dp256": "model: {preset: 1.3B, s: 16, dtype: bf16}\nparallelism: {scheme: zero3, dp: 256}",
    "ddp-350M-dp1024": "model: {preset: 350M, s: 16, dtype: fp32}\nparallelism: {scheme: ddp, dp: 1024}",
    # partitioned as it is built (deepspeed.zero.Init): the 52 GB of parameters never exist whole; fp32, since
    # bf16 matrix products are ~20x slower on this CPU (a bf16 first step took 8 min)
    "zero3-13B-dp1024": "model: {preset: 13B, s: 16, dtype: fp32}\nparallelism: {scheme: zero3, dp: 1024}",
    # torchtitan's 2-D at 4,096 ranks: built on the meta device, TP and FSDP2 sharded there; rank 0's tensor
    # shard computes 1/8 of the layers' width, its tensor- and data-parallel peers emulated
    "fsdp-tp-llama3-70B-dp512-tp8": "model: {preset: llama3-70B, s: 16, dtype: fp32}\n"
    "parallelism: {scheme: fsdp, dp: 512, tp: 8}",
}


FITS = {
    # what else fits a 24 GiB machine (README's table); DDP and ZeRO-1/2 build the model whole first
    "ddp-760M-dp1024": "model: {preset: 760M, s: 16, dtype: fp32}\nparallelism: {scheme: ddp, dp: 1024}",
    "zero2-2.7B-dp256": "model: {preset: 2.7B, s: 16, dtype: bf16}\nparallelism: {scheme: zero2, dp: 256}",
    # FSDP2 emulated: built on the meta device and sharded there
    "fsdp-6.7B-dp256": "model: {preset: 6.7B, s: 16, dtype: fp32}\nparallelism: {scheme: fsdp, dp: 256}",
}


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _ours() -> list[int]:
    """This process and the rank processes (forked from the launcher's forkserver, whose command line names
    commgate)."""
    out = [os.getpid()]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (
                    b"commgate" in (entry / "cmdline").read_bytes()
                    and b"emulation.py" not in (entry / "cmdline").read_bytes()
                ):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def main() -> int:
    from commgate.judge.reconcile import reconcile
    from commgate.model.loader import load_text
    from commgate.model.predict import predict
    from commgate.run import budget
    from commgate.run.launcher import RANK_MEMORY, launch_local

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(RUNS | FITS))
    ap.add_argument("--fits", action="store_true", help="also the runs of the README's table of what fits")
    a = ap.parse_args()
    failed = 0
    for name, body in (RUNS | FITS if a.fits or a.only in FITS else RUNS).items():
        if a.only and name != a.only:
            continue
        text = f"schema_version: 1\nname: {name}\n{body}\nemulate: true\nsteps: 2\nwarmup_steps: 1\ndeadline_s: 1800\n"
        (s,) = load_text(text)
        peak, largest, done = [0], [0], threading.Event()

        def sample(peak: list[int] = peak, largest: list[int] = largest, done: threading.Event = done) -> None:
            while not done.wait(0.2):
                sizes = [_rss_kib(p) for p in _ours()[1:]]
                peak[0] = max(peak[0], _rss_kib(os.getpid()) + sum(sizes))
                largest[0] = max(largest[0], *sizes, 0)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            capture = launch_local(s, workdir=Path(tmp))
        wall = time.monotonic() - started
        done.set()
        watcher.join()
        rec = reconcile(predict(s), capture)
        exact = rec.ok and all(k.measured_calls for k in rec.keys)
        failed += not exact
        t = capture.timeline
        print(
            f"{name}: world {capture.world_size}, rank 0 run; wall {wall:.1f} s (build {t.get('build', 0):.1f} s, "
            f"steps {t.get('steps', 0):.1f} s for {s.warmup_steps + s.steps}), peak RSS {peak[0] / 2**20:.2f} GiB "
            f"(its largest process {largest[0] / 2**20:.2f} GiB; estimated a rank "
            f"{budget.per_rank(s, RANK_MEMORY).total / 2**30:.2f} GiB), "
            f"{len(capture.calls)} calls captured, {'0 unexplained bytes' if exact else 'NOT reconciled'}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
