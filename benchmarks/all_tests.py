"""The README's second command's pytest, timed test by test, with what the machine's cores did meanwhile.

    .venv/bin/python benchmarks/all_tests.py [--out profile.json] [PYTEST_ARGS ...]

Runs ``python -m pytest`` in this checkout (every test, or those the arguments name) with this file as a
plugin. For each test (its setup, call and teardown) it records the wall time and the CPU time the whole
machine spent meanwhile (``/proc/stat``: the test's own process, the ranks and commands it starts, their
servers), so that on an otherwise idle machine a test that waits in real time (a deadline, a Slurm time
limit, a stall to be detected) shows as wall time with idle cores, and a test that computes as busy cores.
Prints the total, the files and the tests taking longest, and the share of the wall time the cores were
idle; writes every test's figures as JSON (``--out``).

What it answers: how far the suite is from a wall-time goal, and whether the gap is work (busy core-seconds:
on ``n`` cores no schedule takes less than busy / n) or waiting (idle core-seconds: tests that could overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_suite import busy  # this folder is not a package

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "COMMGATE_ALL_TESTS_PROFILE"
"""Where the plugin writes its figures (set by ``main``)."""

_ROWS: list[dict[str, Any]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    idle0, total0 = busy()
    t0 = time.monotonic()
    yield
    wall = time.monotonic() - t0
    idle1, total1 = busy()
    jiffies = max(total1 - total0, 1)
    cores = os.cpu_count() or 1
    busy_core_s = wall * cores * (1 - (idle1 - idle0) / jiffies)
    _ROWS.append({"test": item.nodeid, "wall_s": round(wall, 3), "busy_core_s": round(busy_core_s, 3)})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(OUT_ENV)
    if path:
        doc = {"cores": os.cpu_count(), "exit_status": int(exitstatus), "tests": _ROWS}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def summary(doc: dict[str, Any], wall: float, top: int = 15) -> str:
    rows, cores = doc["tests"], doc["cores"]
    tests_wall = sum(r["wall_s"] for r in rows)
    work = sum(r["busy_core_s"] for r in rows)
    lines = [
        f"{len(rows)} tests in {wall:.0f} s of wall time ({tests_wall:.0f} s inside the tests), pytest exit "
        f"{doc['exit_status']}",
        f"busy core-seconds {work:.0f} on {cores} cores: no schedule of this work on {cores} cores takes less "
        f"than {work / cores:.0f} s; the cores were idle {100 * (1 - work / (tests_wall * cores)):.0f}% of the "
        "tests' wall time",
    ]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["test"].split("::", 1)[0]]
        f[0], f[1], f[2] = f[0] + r["wall_s"], f[1] + r["busy_core_s"], f[2] + 1
    lines.append(f"\n{'file':<52} {'tests':>5} {'wall s':>7} {'busy':>7} {'idle %':>6}")
    for name, (w, b, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        idle = min(100.0, max(0.0, 100 * (1 - b / max(w * cores, 1e-9))))  # /proc/stat counts in 10 ms ticks
        lines.append(f"{name:<52} {n:>5} {w:7.0f} {b:7.0f} {idle:6.0f}")
    lines.append(f"\n{'test':<100} {'wall s':>7} {'idle %':>6}")
    for r in sorted(rows, key=lambda r: -r["wall_s"])[:top]:
        idle = min(100.0, max(0.0, 100 * (1 - r["busy_core_s"] / max(r["wall_s"] * cores, 1e-9))))
        lines.append(f"{r['test'][:100]:<100} {r['wall_s']:7.1f} {idle:6.0f}")
    waiting = [r for r in rows if r["busy_core_s"] < 0.25 * r["wall_s"] * cores]
    lines.append(
        f"\n{len(waiting)} tests kept the cores under a quarter busy: {sum(r['wall_s'] for r in waiting):.0f} s "
        "of wall time spent mostly waiting"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("all-tests-profile.json"))
    a, pytest_args = ap.parse_known_args(argv)
    env = os.environ | {OUT_ENV: str(a.out.resolve())}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "all_tests", *pytest_args], cwd=ROOT, env=env)
    wall = time.monotonic() - t0
    if not a.out.is_file():
        print(f"all_tests: pytest exited {rc} and wrote no profile ({a.out})", file=sys.stderr)
        return rc or 1
    print(summary(json.loads(a.out.read_text()), wall))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
