"""The gate's quality, measured: planted faults caught, and false alarms over back-to-back A/A runs.

    .venv/bin/python benchmarks/gate_quality.py [--aa 20] [--faults-only | --aa-only | --slow-only] [--slow 2]

* Faults: each planted fault (``--commgate-fault``) on the default-suite scenario it targets must fail
  the gate, with the fault named and the expected kind of finding in the failure.
* A/A: the unchanged default gate (``pytest scenarios``, committed baselines) run ``--aa`` times back to
  back; every run must pass. Latency shifts only warn by default, so they are counted apart.

* Slowdowns: every call of one op made ``--slow`` times as long (``--commgate-fault slow=OP:F``) in a
  scenario where that op weighs much; counted as flagged when the gate reports ``latency slower: OP``
  (a warning by default) after its confirming reruns. What is not flagged is within the spread the
  stored runs show on this machine (the threshold is printed); a run with more ranks than cores is not
  judged at all (counted apart).

Prints one line per run and the figures; exits 1 unless every fault is caught and no A/A run fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULTS = [
    ("delay-first-recv", "scenarios/pp.yaml", "[cold-start]"),
    ("extra-collective", "scenarios/ddp.yaml", "[model]"),
    ("ddp-bucket-mb=0.5", "scenarios/ddp.yaml", "[baseline]"),
    ("zero-stage=3", "scenarios/zero1.yaml", "[model]"),
]
SLOWDOWNS = [  # (pytest node ids, op): the op where it weighs most in schemes with 2 ranks, then with 4
    ("scenarios/zero3-checkpointing-accumulation.yaml::zero3-19m-ac-m2", "all_gather"),
    ("scenarios/zero2-bf16-accumulation.yaml::zero2-19m-bf16-m4", "all_reduce"),
    ("scenarios/zero1.yaml::zero1-19m-dp2", "all_reduce"),
    ("scenarios/weak.yaml::ddp-19m-weak[dp=2]", "all_reduce"),
    ("scenarios/tp.yaml::tp-19m-t2[s=512]", "all_reduce"),
    ("scenarios/pp.yaml::pp-19m-p2[s=512]", "recv"),
    ("scenarios/zeropp.yaml", "all_gather"),
    ("scenarios/zero3.yaml::zero3-19m-dp4", "all_gather"),
    ("scenarios/moe.yaml", "all_to_all"),
    ("scenarios/ddp.yaml", "all_reduce"),
]


def pytest(*args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def _warnings(out: str) -> list[str]:
    """The heads of the "commgate warnings" section's entries ("scenario: [kind] title", then the lines
    under it), each with its first line under it."""
    lines = out.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if "commgate warnings" in line and line.startswith("="))
    except StopIteration:
        return []
    heads = []
    for i, line in enumerate(lines[start + 1 :], start + 1):
        if line.startswith("=") or (line and line[0].isdigit() and " passed" in line):
            break
        if line and not line.startswith(" "):
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            heads.append(f"{line[:160]} | {nxt[:200]}")
    return heads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aa", type=int, default=20, help="back-to-back runs of the unchanged gate")
    ap.add_argument("--faults-only", action="store_true")
    ap.add_argument("--aa-only", action="store_true")
    ap.add_argument("--slow-only", action="store_true")
    ap.add_argument("--slow", type=float, default=2.0, help="the planted slowdown factor (default 2)")
    a = ap.parse_args(argv)
    if a.slow_only:
        flagged = judged = 0
        for target, op in SLOWDOWNS:
            with tempfile.TemporaryDirectory() as tmp:
                fault = f"slow={op}:{a.slow:g}"
                rc, out, wall = pytest(target, "--commgate-fault", fault, "--commgate-report-dir", tmp)
                notes = [s["latency_note"] for s in json.loads((Path(tmp) / "report.json").read_text())["scenarios"]]
            hit = f"latency slower: {op}" in out
            crowded = any(n.startswith("latency not judged:") and " ranks on " in n for n in notes)
            judged += not crowded
            flagged += hit
            verdict = "flagged" if hit else "not judged (oversubscribed)" if crowded else "not flagged"
            print(f"slow={op}:{a.slow:g} on {target}: {verdict} ({wall:.0f} s)", flush=True)
            for line in [*notes, *(x.strip() for x in out.splitlines() if f"latency slower: {op}" in x)]:
                print(f"    {line[:220]}")
        print(f"planted {a.slow:g}x slowdowns flagged: {flagged} of {judged} judged ({len(SLOWDOWNS)} planted)")
        return 0
    caught = 0
    if not a.aa_only:
        for fault, target, kind in FAULTS:
            rc, out, wall = pytest(target, "--commgate-fault", fault)
            named = f"(planted fault: {fault.split('=')[0]}"  # the message spells out the value, default included
            ok = rc == 1 and named in out and kind in out
            caught += ok
            print(
                f"fault {fault:<20} on {target:<22} {'caught' if ok else 'MISSED'} ({kind}, {wall:.0f} s)", flush=True
            )
    failures = warned = 0
    if not a.faults_only:
        for i in range(a.aa):
            rc, out, wall = pytest("scenarios")
            failures += rc != 0
            warnings = _warnings(out)
            warned += any("[latency]" in w for w in warnings)
            summary = out.strip().splitlines()[-1] if out.strip() else ""
            print(f"A/A run {i + 1:>2}/{a.aa}: rc {rc} ({wall:.0f} s) {summary}", flush=True)
            for w in warnings:
                print(f"    warning: {w}", flush=True)
    if not a.aa_only:
        print(f"planted faults caught: {caught} of {len(FAULTS)}")
    if not a.faults_only:
        print(f"A/A: {failures} failed of {a.aa} (latency warnings in {warned}; cold starts warn apart)")
    return 0 if caught == (0 if a.aa_only else len(FAULTS)) and failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
