"""The iteration-time model against measurement, on scenarios it was not calibrated on.

    .venv/bin/python benchmarks/time_model_accuracy.py [--seed 2 --count 12] [--max-ranks 4] [PATH ...]
        [--dump rows.json]

Runs each scenario (the YAML files given, and ``--count`` scenarios drawn by the seeded generator of
``tests/scenario_gen.py``) on local gloo ranks, predicts its step with ``commgate.report.timemodel``
(the bandwidth curve, F and u of ``baselines/bandwidth-gloo.json``), and prints per scenario the
predicted and measured T_iter, T_comm (time with a call in flight), exposed T_comm (time the training
thread was blocked) and communication fraction, then the median and worst absolute error of the
fraction (goal: median <= 0.10 on scenarios of at most 4 ranks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from commgate.model.predict import predict
from commgate.model.scenario import Scenario, load_paths
from commgate.report import timemodel
from commgate.run.launcher import RunError, launch_local
from commgate.run.workloads import skip_reason

ROOT = Path(__file__).resolve().parent.parent


def drawn(seed: int, count: int, max_ranks: int) -> list[Scenario]:
    sys.path.insert(0, str(ROOT / "tests"))
    from scenario_gen import scenarios  # the generator the tests use

    out: list[Scenario] = []
    k = 0
    while len(out) < count and k < 20:
        out += [s for s in scenarios(seed * 1000 + k, count) if s.world_size <= max_ranks and not s.emulate]
        k += 1
    return out[:count]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--baselines", type=Path, default=ROOT / "baselines")
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args(argv)
    chosen = [s for s in load_paths(a.paths) if s.world_size <= a.max_ranks and not s.emulate] if a.paths else []
    chosen += drawn(a.seed, a.count, a.max_ranks) if a.count else []
    rows = []
    head = f"{'scenario':<44} {'ranks':>5} {'T_iter ms':>17} {'T_comm ms':>17} {'exposed ms':>17} {'fraction':>13}"
    print(head + f" {'err':>6}   (predicted/measured)")
    for s in chosen:
        if reason := skip_reason(s, gpus=0):
            print(f"{s.id:<44} skipped: {reason}")
            continue
        try:
            cap = launch_local(s)
        except RunError as exc:
            print(f"{s.id:<44} error: {str(exc).splitlines()[0]}")
            continue
        t = timemodel.assess(predict(s), cap, a.baselines)
        doc = t.document()
        rows.append({"id": s.id, "ranks": s.world_size, "scheme": s.parallelism.scheme, **doc})
        p, m = doc["predicted"], doc["measured"]
        if not isinstance(p, dict) or not isinstance(m, dict):
            print(f"{s.id:<44} {t.note}")
            continue
        err = t.fraction_error or 0.0
        print(
            f"{s.id[:44]:<44} {s.world_size:>5} {p['t_iter_s'] * 1e3:8.1f}/{m['t_iter_s'] * 1e3:8.1f}"
            f" {p['t_comm_s'] * 1e3:8.1f}/{m['t_comm_s'] * 1e3:8.1f}"
            f" {p['t_exposed_s'] * 1e3:8.1f}/{(m['t_exposed_s'] or 0) * 1e3:8.1f}"
            f" {p['in_flight_fraction']:6.2f}/{m['comm_fraction']:6.2f} {err:+6.2f}",
            flush=True,
        )
    errors = [abs(r["comm_fraction_error"]) for r in rows if r["comm_fraction_error"] is not None]
    if errors:
        median, worst = statistics.median(errors), max(errors)
        print(f"|comm_fraction error| over {len(errors)} scenarios: median {median:.3f}, worst {worst:.3f}")
    if a.dump:
        a.dump.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
