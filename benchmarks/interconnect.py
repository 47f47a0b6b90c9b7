"""Qi et al.'s interconnect study on one machine: the communication fraction against iteration time as
the link between two "nodes" slows (Linux, root).

    sudo .venv/bin/python benchmarks/interconnect.py [--links 25gbit 10gbit 1gbit] [--out out/links]
        [PATH ...]

For each link, the ranks' two halves run in two network namespaces joined by a veth pair shaped with
tc (``commgate.run.links``):

1. the microbenchmarks' ops and sizes run over it (``commgate.run.workloads.probes:sweep``), and their
   captured durations make that link's bandwidth curve (``commgate.report.bandwidth.samples``), stored as
   "HARDWARE | link RATE" beside the machine's own in OUT/bandwidth-gloo.json, with the machine's GEMM
   rates and calibration;
2. every scenario (default: DDP, TP and a pipeline at 2 ranks) runs over it, and the time model predicts
   it with that link's curve.

The scenarios also run without a link (loopback) for reference. One report holds every run (ids
suffixed ``@LINK``); its HTML page has the "Links of different speeds" figure. Prints per link the
curve's all-reduce busbw at 4 MiB and per run the measured and modelled fraction and step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

from commgate.judge.store import BaselineStore
from commgate.model.loader import load_paths, load_text
from commgate.model.scenario import Scenario
from commgate.pipeline import Options, run_scenario
from commgate.report import bandwidth, htmlreport
from commgate.report.report import Report
from commgate.run import links
from commgate.run.launcher import launch_local
from commgate.run.runners import LocalRanks

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [
    f"schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu, s: 256}}\nparallelism: {par}\n"
    for name, par in (
        ("ddp", "{scheme: ddp, dp: 2}"),
        ("tp", "{scheme: tp, tp: 2}"),
        ("pp", "{scheme: pp, pp: 2, micro_batches: 4}"),
    )
]
SWEEP = (
    "schema_version: 1\nname: sweep\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
    "workload: commgate.run.workloads.probes:sweep\nwarmup_steps: 1\nsteps: 2\n"
)


def link_curve(network: links.Network, machine: bandwidth.Curve) -> bandwidth.Curve:
    (sweep,) = load_text(SWEEP)
    cap = launch_local(sweep, network=network)
    measured = [s for s in bandwidth.samples(cap.calls, world=2)]
    curve = bandwidth.fit(measured, backend="gloo", hardware=f"{machine.hardware} | link {network.link}")
    # the machine's compute and calibration: the link changes the network, not the cores
    return dataclasses.replace(
        curve,
        compute_flops=machine.compute_flops,
        utilization=machine.utilization,
        calibrated=machine.calibrated,
        host_s=machine.host_s,
        lag=machine.lag,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--links", nargs="+", default=["25gbit", "10gbit", "1gbit"])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "links")
    ap.add_argument("--baselines", type=Path, default=ROOT / "baselines")
    a = ap.parse_args(argv)
    if why := links.refusal():
        print(f"interconnect study: {why}", file=sys.stderr)
        return 2
    scenarios: list[Scenario] = load_paths(a.paths) if a.paths else [s for t in DEFAULT for s in load_text(t)]
    a.out.mkdir(parents=True, exist_ok=True)
    curves = BaselineStore(a.out).curve_path("gloo")
    shutil.copy(BaselineStore(a.baselines).curve_path("gloo"), curves)
    options = Options(baseline_dir=a.out, gate=False)
    report = Report(a.out / "report.json")
    start = time.monotonic()
    for s in scenarios:  # the reference: no link, the loopback curve
        if (result := run_scenario(dataclasses.replace(s, id=f"{s.id}@loopback"), LocalRanks(), options)) is not None:
            report.add(result)
            print(result.summary().splitlines()[0], flush=True)
    for text in a.links:
        link = links.Link.parse(text)
        with links.shaped(link) as network:
            machine = next(iter(bandwidth.load_all(curves).values()))
            curve = link_curve(network, machine)
            bandwidth.store(curves, curve)
            big = [x for x in curve.samples if x.op == "all_reduce"]
            top = max(big, key=lambda x: x.nbytes)
            print(
                f"{link}: curve over {len(curve.samples)} points; all_reduce {top.nbytes >> 20} MiB busbw "
                f"{bandwidth.busbw('all_reduce', 2, top.nbytes, top.median_s) * 8 / 1e9:.2f} Gbit/s",
                flush=True,
            )
            runner = LocalRanks(network=network)
            for s in scenarios:
                if (result := run_scenario(dataclasses.replace(s, id=f"{s.id}@{link}"), runner, options)) is not None:
                    report.add(result)
                    print(result.summary().splitlines()[0], flush=True)
    page = htmlreport.write(a.out, report.document())
    print(f"{len(report.scenarios)} runs in {time.monotonic() - start:.0f} s; report: {a.out / 'report.json'}, {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
