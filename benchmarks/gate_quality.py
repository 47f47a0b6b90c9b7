"""The gate's quality, measured: planted faults caught, and false alarms over back-to-back A/A runs.

    .venv/bin/python benchmarks/gate_quality.py [--aa 20] [--faults-only | --aa-only | --slow-only] [--slow 2]
    .venv/bin/python benchmarks/gate_quality.py --slow-only --ops all_reduce,all_gather [--report DIR]

* Faults: each planted fault (``--commgate-fault``) on the default-suite scenario it targets must fail
  the gate, with the fault named and the expected kind of finding in the failure.
* A/A: the unchanged default gate (``pytest scenarios``, committed baselines) run ``--aa`` times back to
  back; every run must pass. Latency shifts only warn by default, so they are counted apart.

* Slowdowns: every call of one op made ``--slow`` times as long (``--commgate-fault slow=OP:F``) in the
  whole default suite, once per op of ``--ops``; counted in every scenario where that op holds at least
  ``SHARE`` of the step in the committed baseline's stored runs (their median), and flagged when the gate
  reports ``latency slower: OP`` (a warning by default) after its confirming reruns. Each miss is printed
  with the scenario's latency note. ``--report DIR`` reads an earlier such run's report instead of running
  (``DIR/report.json``, one op).

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
SHARE = 0.05
"""A planted slowdown must be flagged in every scenario where its op holds at least this share of the step."""


def shares(op: str) -> dict[str, float]:
    """Per scenario with a committed gloo baseline whose stored runs issue ``op``: its median share of the
    step (time per step in ``op`` over the step time, each the stored runs' median)."""
    sys.path.insert(0, str(ROOT / "harness"))
    from commgate.judge import baseline as bl
    from latency_rule import share  # (this directory: the replay's own measure of an op's share)

    out = {}
    for f in sorted((ROOT / "baselines" / "gloo").glob("*.json")):
        b = bl.load(f)
        runs = [r for history in b.latency.values() for r in history if op in r.ops()]
        if runs:
            out[b.scenario] = share(op, runs)
    return out


def slow_figures(report: dict[str, object], op: str) -> tuple[list[str], list[str]]:
    """(flagged, missed): the scenarios of ``report`` where ``op`` holds at least ``SHARE`` of the step,
    split by whether the gate reported it slower; each missed one with its latency note."""
    weigh = shares(op)
    flagged, missed = [], []
    for sc in report["scenarios"]:  # type: ignore[attr-defined]
        share = weigh.get(sc["name"], 0.0)
        if share < SHARE:
            continue
        lines = [line for f in sc["findings"] if f["kind"] == "latency" for line in f["lines"]]
        if any(line.startswith(f"latency slower: {op} ") for line in lines):
            flagged.append(f"{sc['name']} ({share:.0%})")
        else:
            missed.append(f"{sc['name']} ({share:.0%}): {sc['status']}; {sc['latency_note']}")
    return flagged, missed


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
    ap.add_argument("--ops", default="all_reduce,all_gather", help="the ops slowed, one suite run each")
    ap.add_argument("--report", type=Path, help="with --slow-only and one op: judge this run's report instead")
    a = ap.parse_args(argv)
    if a.slow_only:
        total_flagged = total = 0
        for op in a.ops.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                where, wall = a.report, 0.0
                if where is None:
                    where = Path(tmp)
                    rc, out, wall = pytest(
                        "scenarios", "--commgate-fault", f"slow={op}:{a.slow:g}", "--commgate-report-dir", tmp
                    )
                report = json.loads((where / "report.json").read_text())
            flagged, missed = slow_figures(report, op)
            total_flagged += len(flagged)
            total += len(flagged) + len(missed)
            print(
                f"slow={op}:{a.slow:g}: flagged in {len(flagged)} of {len(flagged) + len(missed)} scenarios where "
                f"{op} holds at least {SHARE:.0%} of the step ({wall:.0f} s)",
                flush=True,
            )
            for line in flagged:
                print(f"    flagged: {line}")
            for line in missed:
                print(f"    MISSED: {line[:300]}")
        print(f"planted {a.slow:g}x slowdowns flagged: {total_flagged} of {total}")
        return 0 if total_flagged == total else 1
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
