"""The iteration-time model against measurement, calibrated on one set of scenarios and judged on another.

    .venv/bin/python benchmarks/time_model_accuracy.py --calibrate PATH... --judge PATH...
        [--calibrate-seed 1 --calibrate-count 12] [--seed 2 --count 12] [--steps 6] [--dump rows.json]

The calibration set (YAML files, and scenarios drawn by the seeded generator of ``tests/scenario_gen.py``)
runs first on local gloo ranks; ``commgate.report.timemodel.calibrate`` fits u and the host time per
layer pass to it, into a copy of ``baselines/bandwidth-gloo.json`` (the stored one is not touched).
Then every judged scenario runs and is predicted with that copy: per scenario the predicted and
measured T_iter, T_comm (time with a call in flight), exposed T_comm (time the training thread was
blocked) and communication fraction, then the median and worst absolute error of the fraction, over
the scenarios inside the model's domain (no more ranks than cores) and over all. A scenario in both
sets is refused: the point is out-of-sample accuracy (goal: median <= 0.10).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from commgate.judge.store import BaselineStore
from commgate.model.loader import load_paths
from commgate.model.predict import predict
from commgate.model.scenario import Scenario
from commgate.report import bandwidth, timemodel
from commgate.run.launcher import RunError, launch_local
from commgate.run.workloads import skip_reason

ROOT = Path(__file__).resolve().parent.parent


def drawn(seed: int, count: int, max_ranks: int) -> list[Scenario]:
    sys.path.insert(0, str(ROOT / "tests"))
    from scenario_gen import scenarios  # the generator the tests use

    out: list[Scenario] = []
    for k in range(20):
        batch = [s for s in scenarios(seed * 1000 + k, count) if s.world_size <= max_ranks and not s.emulate]
        out += [dataclasses.replace(s, id=f"seed{seed}-{k}:{s.id}") for s in batch]
        if len(out) >= count:
            break
    return out[:count]


def chosen(paths: list[Path], seed: int, count: int, a: argparse.Namespace) -> list[Scenario]:
    out = [s for s in load_paths(paths) if s.world_size <= a.max_ranks and not s.emulate] if paths else []
    out += drawn(seed, count, a.max_ranks) if count else []
    return [dataclasses.replace(s, steps=a.steps) if a.steps else s for s in out]


def run(scenarios: list[Scenario], curves: Path, *, show: bool) -> list[dict[str, Any]]:
    rows = []
    for s in scenarios:
        if reason := skip_reason(s, gpus=False):
            print(f"{s.id:<44} skipped: {reason}")
            continue
        try:
            cap = launch_local(s)
        except RunError as exc:
            print(f"{s.id:<44} error: {str(exc).splitlines()[0]}")
            continue
        t = timemodel.assess(predict(s), cap, curves)
        rows.append({"id": s.id, "ranks": s.world_size, "scheme": s.parallelism.scheme, **t.document()})
        p, m = t.predicted, t.measured
        if not show:
            print(f"  calibration run: {s.id}", flush=True)
        elif p is None or m is None:
            print(f"{s.id:<44} {t.note}")
        else:
            print(
                f"{s.id[:44]:<44} {s.world_size:>5} {p.t_iter * 1e3:8.1f}/{m.t_iter * 1e3:8.1f}"
                f" {p.t_comm * 1e3:8.1f}/{m.t_comm * 1e3:8.1f}"
                f" {p.t_exposed * 1e3:8.1f}/{(m.t_exposed or 0) * 1e3:8.1f}"
                f" {p.in_flight_fraction:6.2f}/{m.comm_fraction:6.2f} {t.fraction_error or 0:+6.2f}"
                + ("  (out of domain)" if t.domain else ""),
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", nargs="*", type=Path, default=[])
    ap.add_argument("--calibrate-seed", type=int, default=1)
    ap.add_argument("--calibrate-count", type=int, default=0)
    ap.add_argument("--judge", nargs="*", type=Path, default=[])
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="measured steps per run (default: the scenario's)")
    ap.add_argument("--baselines", type=Path, default=ROOT / "baselines")
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args(argv)
    cal = chosen(a.calibrate, a.calibrate_seed, a.calibrate_count, a)
    judged = chosen(a.judge, a.seed, a.count, a)

    def what(s: Scenario) -> str:  # the scenario's substance, whatever its name
        return repr((s.model, s.parallelism, s.workload, s.deepspeed))

    if both := {what(s) for s in cal} & {what(s) for s in judged}:
        ap.error(f"{len(both)} scenario(s) in both the calibration and the judged set")
    curves = Path(tempfile.mkdtemp(prefix="commgate-accuracy-"))
    shutil.copy(BaselineStore(a.baselines).curve_path("gloo"), curves)
    if cal:
        fit = timemodel.calibrate([r for r in run(cal, curves, show=False)])
        if fit is None:
            ap.error("no calibration scenario inside the model's domain ran")
        hardware = next(iter(bandwidth.load_all(BaselineStore(curves).curve_path("gloo"))))
        bandwidth.calibrate(
            BaselineStore(curves).curve_path("gloo"), hardware, fit.utilization, "benchmark", fit.host_s, fit.lag
        )
        host = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(fit.host_s.items()))
        print(f"calibrated on {fit.scenarios} scenarios: u = {fit.utilization:.3f}")
        print(f"host time per layer pass: {host}")
    head = f"{'scenario':<44} {'ranks':>5} {'T_iter ms':>17} {'T_comm ms':>17} {'exposed ms':>17} {'fraction':>13}"
    print(head + f" {'err':>6}   (predicted/measured)")
    rows = run(judged, curves, show=True)
    for label, keep in (("inside the model's domain", lambda r: not r["domain"]), ("all", lambda r: True)):
        errors = [abs(r["comm_fraction_error"]) for r in rows if keep(r) and r["comm_fraction_error"] is not None]
        if errors:
            median, worst = statistics.median(errors), max(errors)
            print(f"|comm_fraction error|, {label}: {len(errors)} scenarios, median {median:.3f}, worst {worst:.3f}")
    if a.dump:
        a.dump.write_text(json.dumps(rows, indent=1))
    shutil.rmtree(curves)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
