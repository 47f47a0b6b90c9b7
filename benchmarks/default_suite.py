"""The README's first command after the install: ``commgate run scenarios --report-dir DIR``, timed whole.

    .venv/bin/python benchmarks/default_suite.py [--runs 3] [--against OTHER_CHECKOUT]

With ``--against``, the same command of another checkout of commgate (its ``harness/`` put first on
``PYTHONPATH``, the same environment and the same ``scenarios/``) runs alternately with this one (A B, B A,
...), and the two reports are compared: they must differ only in timings (every call's bytes, every
reconciliation, every finding the same), which is what "behaviour unchanged" means for a speed change. Prints
each run's wall time, the medians and their ratio, and the machine's busy share of its 2 cores over each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TIMED = {
    "wall_s", "start_ns", "duration_ns", "end_ns", "blocked_ns", "monotonic_ns", "wall_ns", "timeline",
    "time_model", "comm_fraction", "cold_starts", "latency_note",
}  # fmt: skip
"""The report's keys whose values are times, or judged from times alone (a cold start is a slow first call)."""


def busy() -> tuple[int, int]:
    """(idle, total) jiffies of the machine so far (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def run(harness: Path, out: Path) -> tuple[float, float]:
    """One run of the default suite with ``harness`` first on the path: (its wall time, the machine's busy
    share over it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(harness), os.environ.get("PYTHONPATH", "")])}
    idle0, total0 = busy()
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "commgate", "run", "scenarios", "--report-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.monotonic() - t0
    idle1, total1 = busy()
    if done.returncode != 0:
        sys.exit(f"{harness}: the default suite failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return wall, 1 - (idle1 - idle0) / max(1, total1 - total0)


def differences(a: Any, b: Any, path: str = "$") -> list[str]:
    """Where two report documents differ outside ``TIMED``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: on one side only" for k in set(a) ^ set(b) if k not in TIMED]
        for k in sorted(set(a) & set(b) - TIMED):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:60]} against {str(b)[:60]}"]


def scenarios(report: Path) -> dict[str, Any]:
    return {s["name"]: s for s in json.loads(report.read_text())["scenarios"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", type=Path, help="another checkout of commgate, run alternately with this one")
    a = ap.parse_args()
    sides = {"this": ROOT / "harness"} | ({"against": a.against.resolve() / "harness"} if a.against else {})
    walls: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                wall, share = run(sides[side], Path(tmp, side))
                walls[side].append(wall)
                print(f"run {i + 1} {side:8} {wall:7.1f} s  (machine busy {share:.0%} of its cores)", flush=True)
            if a.against:
                this, other = (
                    scenarios(Path(tmp, "this", "report.json")),
                    scenarios(Path(tmp, "against", "report.json")),
                )
                diff = differences(this, other)
                print(f"    reports: {'differ only in timings' if not diff else 'DIFFER: ' + '; '.join(diff[:5])}")
    for side, w in walls.items():
        print(f"{side:8} median {statistics.median(w):.1f} s over {len(w)} runs ({', '.join(f'{x:.1f}' for x in w)})")
    if a.against:
        print(f"this / against: x{statistics.median(walls['this']) / statistics.median(walls['against']):.2f}")


if __name__ == "__main__":
    main()
