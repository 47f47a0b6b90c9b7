"""The effective-bandwidth curve C(bytes, group size, backend) that the APNet time model divides volumes
by, fitted from the collective microbenchmarks (``benchmarks/test_collectives.py``) and stored per
hardware fingerprint in the baseline directory (``commgate.judge.store.BaselineStore.curve_path``).

A curve is a table of measured median latencies per (op, world size, group size) over message sizes,
plus the compute rate one rank reaches while ``world`` ranks share the machine (a GEMM). Between
measured sizes the latency is interpolated log-log; below the smallest size it is the smallest size's
latency (the latency floor); above the largest it grows linearly with the bytes (the bandwidth bound).

Torch-free. Message size is nccl-tests' ``size``: the largest buffer of the call, as in
``commgate.model.collectives``; algbw = size / time and busbw = algbw x the op's bus factor (nccl-tests'
PERFORMANCE.md), so a busbw is comparable across ops and group sizes.
"""

from __future__ import annotations

import bisect
import datetime
import functools
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commgate.core import env, schemas
from commgate.core.errors import CommgateError
from commgate.core.fsutil import atomic_write_json, read_json
from commgate.model.collectives import OPS as OPS_TABLE
from commgate.model.collectives import SWEEPS, Op, bus_factor

CURVE_VERSION = 1
OPS = tuple(SWEEPS)
"""The swept ops, as the microbenchmarks and the curve name them."""


def algbw(nbytes: int, seconds: float) -> float:
    """Bytes per second as nccl-tests' algbw."""
    return nbytes / seconds if seconds > 0 else math.inf


def busbw(op: str, group_size: int, nbytes: int, seconds: float) -> float:
    return algbw(nbytes, seconds) * bus_factor(op, group_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One microbenchmark result: median and p99 latency of ``op`` on ``nbytes`` in groups of
    ``group_size`` while ``world`` ranks run (every group at once, as TP or DP groups do)."""

    op: str
    world: int
    group_size: int
    nbytes: int
    median_s: float
    p99_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    backend: str
    hardware: str
    measured: str
    """ISO date of the sweep."""
    samples: tuple[Sample, ...]
    compute_flops: Mapping[int, float] = field(default_factory=dict)
    """world size -> fp32 FLOP/s one rank reaches while that many ranks compute at once."""
    utilization: float = 1.0
    """u: the share of F a training step reaches (APNet); 1 until calibrated."""
    calibrated: str | None = None
    """How u was calibrated (the report and date), None if it was not."""
    lag: Mapping[str, float] = field(default_factory=dict)
    """In-flight time beyond the curve per second of compute, by workload kind, calibrated with u
    (``commgate.report.timemodel.PredictedTime.t_lag``). Empty until calibrated."""
    host_s: Mapping[str, float] = field(default_factory=dict)
    """Host time per layer pass by workload kind (``commgate.report.timemodel.host_key``), calibrated
    with u: the framework's cost beyond the FLOPs. Empty until calibrated."""

    def _table(self, op: str, world: int, group_size: int) -> list[Sample]:
        keys = {(s.world, s.group_size) for s in self.samples if s.op == op}
        if not keys:
            raise CommgateError(f"the bandwidth curve for {self.hardware} has no {op} measurements")
        # The closest group size, then the closest world size (log distance; a tie goes to the busier world).
        w, g = min(keys, key=lambda k: (abs(math.log(k[1] / group_size)), abs(math.log(k[0] / world)), -k[0]))
        return sorted((s for s in self.samples if (s.op, s.world, s.group_size) == (op, w, g)), key=lambda s: s.nbytes)

    def seconds(self, op: str, *, group_size: int, world: int, nbytes: int) -> float:
        """Predicted latency of one call of captured op ``op`` (its ``OpSpec.sweep`` stands for it)."""
        if group_size <= 1:
            return 0.0
        table = self._table(OPS_TABLE[Op(op)].sweep, world, group_size)
        sizes = [s.nbytes for s in table]
        if nbytes <= sizes[0]:
            return table[0].median_s
        if nbytes >= sizes[-1]:
            return table[-1].median_s * nbytes / sizes[-1]
        i = bisect.bisect_left(sizes, nbytes)
        lo, hi = table[i - 1], table[i]
        x = (math.log(nbytes) - math.log(lo.nbytes)) / (math.log(hi.nbytes) - math.log(lo.nbytes))
        return math.exp(math.log(lo.median_s) + x * (math.log(hi.median_s) - math.log(lo.median_s)))

    def flops(self, world: int) -> float:
        """One rank's compute rate with ``world`` ranks computing (nearest measured world size)."""
        if not self.compute_flops:
            raise CommgateError(f"the bandwidth curve for {self.hardware} has no compute rate")
        w = min(self.compute_flops, key=lambda k: (abs(math.log(k / world)), -k))
        return self.compute_flops[w]

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "measured": self.measured,
            "compute_flops": {str(w): f for w, f in sorted(self.compute_flops.items())},
            "utilization": self.utilization,
            "calibrated": self.calibrated,
            **({"host_s": dict(sorted(self.host_s.items()))} if self.host_s else {}),
            **({"lag": dict(sorted(self.lag.items()))} if self.lag else {}),
            "samples": [
                {
                    "op": s.op,
                    "world": s.world,
                    "group_size": s.group_size,
                    "bytes": s.nbytes,
                    "median_s": s.median_s,
                    "p99_s": s.p99_s,
                }
                for s in sorted(self.samples, key=lambda s: (s.op, s.world, s.group_size, s.nbytes))
            ],
        }

    @classmethod
    def from_json(cls, hardware: str, d: Mapping[str, Any]) -> Curve:
        samples = tuple(
            Sample(
                op=s["op"],
                world=s["world"],
                group_size=s["group_size"],
                nbytes=s["bytes"],
                median_s=s["median_s"],
                p99_s=s["p99_s"],
            )
            for s in d["samples"]
        )
        flops = {int(w): float(f) for w, f in d.get("compute_flops", {}).items()}
        return cls(
            backend=d["backend"],
            hardware=hardware,
            measured=d["measured"],
            samples=samples,
            compute_flops=flops,
            utilization=float(d.get("utilization", 1.0)),
            calibrated=d.get("calibrated"),
            host_s={k: float(v) for k, v in d.get("host_s", {}).items()},
            lag={k: float(v) for k, v in d.get("lag", {}).items()},
        )


def fit(
    samples: Iterable[Sample], *, backend: str, hardware: str, compute_flops: Mapping[int, float] | None = None
) -> Curve:
    """A curve from microbenchmark samples; repeated keys keep the lowest median (the least disturbed run)."""
    best: dict[tuple[str, int, int, int], Sample] = {}
    for s in samples:
        if s.op not in SWEEPS:
            raise CommgateError(f"bandwidth sample: unknown op {s.op!r} (one of {', '.join(OPS)})")
        key = (s.op, s.world, s.group_size, s.nbytes)
        if key not in best or s.median_s < best[key].median_s:
            best[key] = s
    if not best:
        raise CommgateError("bandwidth: no samples to fit")
    return Curve(
        backend=backend,
        hardware=hardware,
        measured=datetime.date.today().isoformat(),
        samples=tuple(best.values()),
        compute_flops=dict(compute_flops or {}),
    )


def samples(calls: Iterable[Any], *, world: int, rank: int = 0) -> list[Sample]:
    """Samples from a capture's calls (``commgate.run.capture.CapturedCall``) instead of the
    microbenchmarks: rank ``rank``'s completed calls of each swept op (send_recv: its recvs) on the whole
    world, by message size, median and p99 of their durations. For runs whose ranks the microbenchmarks
    cannot host (``commgate.run.workloads.probes:sweep`` over shaped links)."""
    by_sweep = {op: name for name, op in SWEEPS.items() if op != Op.SEND} | {Op.RECV: "send_recv"}
    by: dict[tuple[str, int], list[float]] = {}
    for c in calls:
        if c.rank == rank and c.duration_ns is not None and len(c.group) == world and c.op in by_sweep:
            by.setdefault((by_sweep[c.op], c.bytes), []).append(c.duration_ns / 1e9)
    out = []
    for (op, nbytes), times in sorted(by.items()):
        times.sort()
        p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
        out.append(
            Sample(op=op, world=world, group_size=world, nbytes=nbytes, median_s=statistics.median(times), p99_s=p99)
        )
    return out


def validate(doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid bandwidth-curve file."""
    schemas.validate("bandwidth", doc)


def load_all(path: Path) -> dict[str, Curve]:
    """Every hardware's curve in a bandwidth file ({} when there is none); bad files are one-line errors.
    The file is parsed and validated once per version of it (the time model asks for every scenario)."""
    if not path.exists():
        return {}
    st = path.stat()
    return dict(_parsed(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, Curve]:
    hint = f"; measure this machine's curve again to rewrite it: `{sweep_command(Path(path).parent)}`"
    doc = read_json(Path(path), validate, hint=hint, version=CURVE_VERSION)
    return {hw: Curve.from_json(hw, d) for hw, d in doc["curves"].items()}


DEFAULTS = Path(__file__).resolve().parents[1] / "core" / "curves"
"""The curves commgate ships, one file per backend (``bandwidth-{backend}.json``, the repository's own
measured curve): the time model of a user who has measured none yet."""


def lookup(path: Path, hardware: str) -> tuple[Curve | None, str]:
    """The curve for ``hardware`` and a note: exact, another machine's (named), commgate's shipped default
    for the backend (said to be one), or none."""
    curves = load_all(path)
    if hardware in curves:
        return curves[hardware], f"bandwidth curve of this hardware ({curves[hardware].measured})"
    if curves:
        other = sorted(curves)[0]
        return curves[other], f"no bandwidth curve for {hardware!r}; using the one measured on {other!r}"
    measure = f"measure this machine's: `{sweep_command(path.parent)}`"
    shipped = load_all(DEFAULTS / path.name)
    if shipped:
        other = sorted(shipped)[0]
        return shipped[other], (
            f"no bandwidth curve in {path}: using commgate's default {path.stem.removeprefix('bandwidth-')} curve, "
            f"measured on {other!r} ({shipped[other].measured}), not this machine; {measure}"
        )
    return None, f"no bandwidth curve in {path}: {measure}"


def sweep_command(curve_dir: Path) -> str:
    """The command that measures this machine's curve into ``curve_dir``, runnable from any directory: the
    microbenchmarks of commgate's checkout by absolute path (an installed wheel has none: say where)."""
    bench = Path(__file__).resolve().parents[3] / "benchmarks" / "test_collectives.py"
    target = curve_dir.resolve()
    python = env.python_command(anywhere=True)
    if bench.is_file():
        return f"{python} -m pytest {bench} -p no:cacheprovider --commgate-curve-dir {target}"
    return f"{python} -m pytest benchmarks/test_collectives.py --commgate-curve-dir {target} (in a commgate checkout)"


def calibrate(
    path: Path,
    hardware: str,
    utilization: float,
    how: str,
    host_s: Mapping[str, float] | None = None,
    lag: Mapping[str, float] | None = None,
) -> Curve:
    """Set u (and the host time per layer pass) of ``hardware``'s curve in ``path`` (the curve must exist:
    measure it first)."""
    import dataclasses

    curves = can_calibrate(path, hardware, utilization)
    curve = dataclasses.replace(
        curves[hardware], utilization=utilization, calibrated=how, host_s=dict(host_s or {}), lag=dict(lag or {})
    )
    store(path, curve)
    return curve


def can_calibrate(path: Path, hardware: str, utilization: float) -> dict[str, Curve]:
    """The curves in ``path``, where ``hardware``'s is there to take a plausible ``utilization``; else a
    ``CommgateError`` that says the fix (``calibrate`` checks it, and a caller with several fits checks them all
    before it writes or says any)."""
    curves = load_all(path)
    if hardware not in curves:
        raise CommgateError(
            f"{path}: no bandwidth curve for {hardware!r} to calibrate; "
            f"measure it first: `{sweep_command(path.parent)}`"
        )
    if not 0 < utilization <= 10:
        raise CommgateError(f"calibration: u = {utilization:g} is implausible (expected within (0, 10])")
    return curves


def merged(old: Curve, new: Curve) -> Curve:
    """``new``'s points over ``old``'s: a partial sweep (a few ops, sizes or worlds) refits those points and
    keeps the rest. u is reset (the rates it was calibrated against changed): calibrate again."""
    import dataclasses

    points = {(s.op, s.world, s.group_size, s.nbytes): s for s in (*old.samples, *new.samples)}
    flops = {**old.compute_flops, **new.compute_flops}
    return dataclasses.replace(new, samples=tuple(points.values()), compute_flops=flops)


def store(path: Path, curve: Curve) -> Path:
    """Add ``curve`` as its hardware's entry, merged into the one stored (``merged``), keeping the other
    machines' (atomic)."""
    curves = load_all(path)
    if curve.hardware in curves and curves[curve.hardware].backend == curve.backend:
        curve = merged(curves[curve.hardware], curve)
    curves[curve.hardware] = curve
    doc = {"schema_version": CURVE_VERSION, "curves": {hw: c.to_json() for hw, c in sorted(curves.items())}}
    validate(doc)
    return atomic_write_json(path, doc)
