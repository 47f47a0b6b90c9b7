"""The latency rule replayed on real runs: false warnings on unchanged runs, and planted slowdowns flagged.

    .venv/bin/python benchmarks/latency_rule.py --unchanged u1 u2 ... u12 --planted all_reduce=ar1,ar2 \\
        --planted all_gather=ag1,ag2 [--history 3 8] [--exact 2 2.5]

Each DIR holds a ``report.json`` of the default suite (``pytest scenarios --commgate-report-dir DIR``, the
latency histories left as they are: nothing is rerun); ``--planted OP=DIR,...``, runs with
``--commgate-fault slow=OP:2``. Every run's captures are summarized as the gate does
(``commgate.judge.drift.summarize``) and judged with the gate's own ``shifts``, two steps as the gate takes
them: the first run alone, and where it looks shifted, with the two confirming reruns.

* Unchanged: per scenario, 60 draws of H runs as the stored history and 3 others as a run and its reruns;
  every verdict other than "~" is a false warning.
* Planted: per (scenario, OP) where OP holds at least 5% of the step in the unchanged runs, 10 draws of a
  history of H unchanged runs against the planted runs; flagged when the verdict is "slower".
* Exact (``--exact F``): the unchanged runs with every call of an op made exactly F times its own time (its
  floor and time per step x F), per (scenario, op) holding 5% of the step, 20 draws each.

Prints the figures docs/gate.md quotes, and each miss and false warning.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "harness"))

from commgate.judge.drift import RunLatency, _median_issued, shifts, summarize
from commgate.model.scenario import LatencyRule
from commgate.run.capture import Capture

SHARE = 0.05
Runs = dict[str, RunLatency]


def load(d: Path) -> Runs:
    """Scenario name -> the run's latency, for every scenario of ``d/report.json`` that holds a capture."""
    doc = json.loads((d / "report.json").read_text())
    return {s["name"]: summarize(Capture.from_json(s["capture"])) for s in doc["scenarios"] if "capture" in s}


def verdicts(now: list[RunLatency], base: list[RunLatency], rule: LatencyRule) -> dict[str, str]:
    """The gate's two steps: the first run alone, then with its reruns where it looked shifted."""
    if not shifts(now[:1], base, rule).changed():
        return {}
    return {s.op: s.verdict for s in shifts(now, base, rule).changed()}


def share(op: str, runs: list[RunLatency]) -> float:
    """``op``'s median time per step over the median step time of ``runs`` (0 without step times)."""
    step = statistics.median(_median_issued(r.step) for r in runs)
    return statistics.median(r.op_time(op) for r in runs) / step if step else 0.0


def exact(run: RunLatency, op: str, factor: float) -> RunLatency:
    """``run`` with every call of ``op`` ``factor`` times its own time."""
    keys = {k: tuple(int(t * factor) for t in v) if k[0] == op else v for k, v in run.keys.items()}
    return replace(run, keys=keys, floor={k: int(v * factor) if k[0] == op else v for k, v in run.floor.items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unchanged", type=Path, nargs="+", required=True)
    ap.add_argument("--planted", action="append", default=[], help="OP=DIR[,DIR...]")
    ap.add_argument("--history", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--exact", type=float, nargs="*", default=[2.0])
    a = ap.parse_args(argv)
    rule = LatencyRule()
    unchanged = [load(d) for d in a.unchanged]
    planted = {op: [load(Path(d)) for d in dirs.split(",")] for op, _, dirs in (p.partition("=") for p in a.planted)}
    names = sorted(set.intersection(*(set(u) for u in unchanged)))
    for h in a.history:
        if h + 3 > len(unchanged):
            print(f"H={h}: needs {h + 3} unchanged runs, {len(unchanged)} given")
            continue
        rng = random.Random(1)
        warnings, trials, hits, misses = [], 0, 0, []
        for name in names:
            us = [u[name] for u in unchanged]
            for _ in range(60):
                pick = rng.sample(us, h + 3)
                got = verdicts(pick[h:], pick[:h], rule)
                trials += 1
                warnings += [f"{name}: {op} {v}" for op, v in got.items()]
            for op, runs in planted.items():
                ps = [r[name] for r in runs if name in r]
                if len(ps) < 2 or op not in us[0].ops() or share(op, us) < SHARE:
                    continue
                n = sum(verdicts(ps, rng.sample(us, h), rule).get(op) == "slower" for _ in range(10))
                hits += n == 10
                if n < 10:
                    misses.append(f"{name}: {op} ({share(op, us):.0%} of the step) flagged in {n} of 10 histories")
        print(
            f"H={h}: unchanged: {len(warnings)} warning(s) in {trials} trials; planted: flagged under every "
            f"history in {hits} of {hits + len(misses)} (scenario, op) pairs holding {SHARE:.0%} of the step"
        )
        for line in warnings + misses:
            print(f"    {line}")
        for factor in a.exact:
            rng = random.Random(1)
            always = total = 0
            flagged = 0
            for name in names:
                us = [u[name] for u in unchanged]
                for op in sorted(us[0].ops()):
                    if share(op, us) < SHARE:
                        continue
                    n = 0
                    for _ in range(20):
                        pick = rng.sample(us, h + 3)
                        now = [exact(r, op, factor) for r in pick[h:]]
                        n += verdicts(now, pick[:h], rule).get(op) == "slower"
                    total += 1
                    always += n == 20
                    flagged += n
            print(
                f"    exact x{factor:g}: flagged under every history in {always} of {total} (scenario, op) pairs, "
                f"{flagged / 20:.1f} on average"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
