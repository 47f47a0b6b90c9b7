"""The APNet iteration-time model next to what a run measured.

Predicted, for rank 0 (the paper's "any GPU at stage 1"):

    T_iter = T_comp + T_TP + T_PP + T_DP (+ T_EP) + T_bubble
    T_comp = FLOPs per step of the busiest stage / (u x F)        F: measured GEMM rate at this world size
    T_X    = sum over rank 0's collectives on axis X of calls x C(op, bytes, group size)
    T_bubble = (p - 1)/m x (T_comp + T_PP + T_TP)               R_bubble = T_bubble / T_iter ~ (p-1)/(p-1+m)
               (p - 1)/(v m) interleaved over v virtual stages; a third of that zero-bubble (``bubble_factor``)
    comm_fraction = (T_TP + T_PP + T_DP + T_EP) / T_iter

C is the effective-bandwidth curve (``commgate.report.bandwidth``), F its compute rate, u the utilisation the
paper calibrates per GPU type (0.3 and 0.4 there), calibrated here per hardware by ``commgate
calibrate`` from a report (the median over its scenarios of the u that matches each one's measured
compute time) and stored with the curve. The per-collective rows are the implementation-aware model's
(``commgate.model.expectation``), not Eqs. 2-5's idealised totals.

Measured, on rank 0's measured steps: T_iter is the median step window; communication time is the
union of the intervals in which at least one of its calls was in flight (so overlapped asynchronous
calls count once), and comm_fraction the median over steps of that union / the step. A pipeline rank
waits out its bubble inside a recv, so the measurement is compared with the model's in-flight fraction
(T_comm + T_bubble) / T_iter; without a pipeline the two are the paper's comm fraction.

This module computes; it neither reads the curve (the caller looks it up: ``commgate.pipeline``) nor
judges (``expectations.time.max_error`` is the gate's: ``commgate.judge.gate.against_time``). Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from commgate.core.errors import CommgateError
from commgate.judge.gate import StepTime
from commgate.model import transformer
from commgate.model.expectation import ExpectedCollective, Phase, Prediction
from commgate.model.scenario import Parallelism, Scenario
from commgate.model.schemes import SCHEMES
from commgate.report.bandwidth import Curve
from commgate.run.capture import Capture, busy_ns

AXIS_TERM = {"tp": "T_TP", "mp": "T_TP", "pp": "T_PP", "dp": "T_DP", "hpz": "T_DP", "ep": "T_EP"}
"""Which of the paper's terms a collective's axis belongs to (MoE's expert all-to-all is not in the
paper's PTP model: it gets its own term, counted as communication)."""


def step_flops(prediction: Prediction) -> float:
    """Training FLOPs per step on one rank of the busiest pipeline stage (``transformer.step_flops``)."""
    return transformer.step_flops(prediction.scenario.model, prediction.scenario.parallelism)


def host_key(scenario: Scenario) -> str:
    """The workload kind whose host time per layer pass and lag the calibration measures (the scheme's
    record says: ``Scheme.workload_kind``)."""
    return SCHEMES[scenario.parallelism.scheme].workload_kind(scenario.parallelism)


def layer_passes(scenario: Scenario) -> int:
    """Layer passes per step on one rank of the fullest stage: each layer's forward and backward on
    every micro-batch, and its recomputed forward under activation checkpointing."""
    par = scenario.parallelism
    per_layer = 3 if par.activation_checkpointing else 2
    return -(-scenario.model.L // par.pp) * par.micro_batches * per_layer


def per_kind(values: Mapping[str, float], key: str) -> float:
    """A calibrated value of workload kind ``key`` (host time per layer pass, lag): its own, or the median
    over the kinds calibrated when it was not among them (0 before any calibration)."""
    if key in values:
        return values[key]
    return statistics.median(values.values()) if values else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictedTime:
    t_comp: float
    terms: dict[str, float]
    """T_TP, T_PP, T_DP, T_EP in seconds per step (rank 0)."""
    t_bubble: float
    utilization: float
    curve_note: str
    t_hidden: float = 0.0
    """Communication the framework runs behind compute (``overlap``): in ``t_comm``, not on the
    critical path."""
    t_flops: float = 0.0
    """FLOPs per step / F: ``t_comp`` at u = 1 without host time (what calibration fits u against)."""
    t_host: float = 0.0
    """The framework's host time per step (in ``t_comp``): layer passes x the calibrated time per pass."""
    layer_passes: int = 0
    host_key: str = ""
    t_lag: float = 0.0
    """Time rank 0's calls are in flight beyond the curve's time (``Curve.lag`` of the workload kind x
    ``t_comp``): a collective completes only when its last member joins, and ranks do not compute at one
    pace; an asynchronous call stays in flight while its caller works on before it waits (DTensor's
    dispatch). In the in-flight share only: no bytes move meanwhile, and the caller is not blocked."""
    bubble_factor: float = 0.0

    @property
    def t_comm(self) -> float:
        return sum(self.terms.values())

    @property
    def t_exposed(self) -> float:
        """The communication on the critical path: what the training thread waits for."""
        return self.t_comm - self.t_hidden

    @property
    def t_iter(self) -> float:
        return self.t_comp + self.t_exposed + self.t_bubble

    @property
    def comm_fraction(self) -> float:
        """The paper's T_comm / T_iter (at most 1: overlapped calls share the step with compute)."""
        return min(1.0, self.t_comm / self.t_iter) if self.t_iter else 0.0

    @property
    def in_flight_fraction(self) -> float:
        """What the capture can measure: the share of the step with a call in flight. A pipeline rank spends
        its bubble blocked in a recv, so the bubble counts here (and not in ``comm_fraction``). Calls
        overlapped with compute are in flight at the same time as it: at most the whole step."""
        return min(1.0, (self.t_comm + self.t_lag + self.t_bubble) / self.t_iter) if self.t_iter else 0.0

    @property
    def bubble_ratio(self) -> float:
        return self.t_bubble / self.t_iter if self.t_iter else 0.0

    def step(self) -> StepTime:
        """The modelled step as the time gate compares it: the share with a call in flight."""
        return StepTime(comm_fraction=self.in_flight_fraction, t_iter=self.t_iter, t_comm=self.t_comm)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredTime:
    t_iter: float
    """Median of rank 0's measured step windows, seconds."""
    t_comm: float
    """Median per step of the time rank 0 had a call in flight, seconds."""
    comm_fraction: float
    """Median over measured steps of (time with a call in flight) / step."""
    steps: int
    t_exposed: float | None = None
    """Median per step of the time rank 0's training thread was blocked (``StepWindow.blocked_ns``):
    the communication it waited on, the exposed part of ``t_comm``; None where not measured."""

    def step(self) -> StepTime:
        """The measured step as the time gate compares it."""
        return StepTime(comm_fraction=self.comm_fraction, t_iter=self.t_iter, t_comm=self.t_comm)


def bubble_factor(par: Parallelism) -> float:
    """T_bubble / (the stage's work per step), by the pipeline schedule: (p-1)/m for GPipe, 1F1B and
    DeepSpeed's engine; (p-1)/(v*m) interleaved over v virtual stages (Narayanan et al. 2021); a third of
    that for the zero-bubble schedule, whose split backward fills two thirds of 1F1B's bubble (ZB-H1,
    Penghui Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024). So R_bubble ~ (p-1)/(p-1+m), (p-1)/(p-1+v*m)."""
    p, m, pl = par.pp, par.micro_batches, par.pipeline
    if p == 1:
        return 0.0
    if pl.schedule == "zero-bubble":
        return (p - 1) / (3 * pl.virtual_stages * m)
    return (p - 1) / (pl.virtual_stages * m)


FORWARD_SHARE = 1 / 3
"""The forward's share of a step's compute (2 of the 6 FLOPs per parameter and token); the backward
holds the rest."""


def overlap(rows: list[tuple[ExpectedCollective, float]], t_comp: float) -> float:
    """Seconds of communication hidden behind compute, from rank 0's rows and each one's seconds per call.

    In each phase, the calls the framework issues without waiting (``ExpectedCollective.overlaps``)
    run behind that phase's compute (a third of ``t_comp`` forward, two thirds backward), all but the
    phase's last call, which nothing follows (DDP's last bucket is ready when the backward ends)."""
    hidden = 0.0
    for phase, share in ((Phase.FORWARD, FORWARD_SHARE), (Phase.BACKWARD, 1 - FORWARD_SHARE)):
        mine = [(c, per_call) for c, per_call in rows if c.overlaps and c.phase == phase]
        if mine:
            behind = sum(c.calls * per_call for c, per_call in mine) - mine[-1][1]
            hidden += min(max(behind, 0.0), share * t_comp)
    return hidden


def predict_time(prediction: Prediction, curve: Curve, *, note: str = "", utilization: float = 1.0) -> PredictedTime:
    s = prediction.scenario
    world, par = s.world_size, s.parallelism
    terms = {"T_TP": 0.0, "T_PP": 0.0, "T_DP": 0.0, "T_EP": 0.0}
    rows = []
    for c in prediction.steady:
        if 0 not in c.participants():
            continue
        per_call = curve.seconds(str(c.op), group_size=c.group_size, world=world, nbytes=c.bytes_per_call)
        terms[AXIS_TERM.get(str(c.axis), "T_DP")] += c.calls * per_call
        rows.append((c, per_call))
    t_flops = step_flops(prediction) / curve.flops(world)
    key, passes = host_key(s), layer_passes(s)
    t_host = passes * per_kind(curve.host_s, key)
    t_comp = t_flops / utilization + t_host
    factor = bubble_factor(par)
    bubble = factor * (t_comp + terms["T_PP"] + terms["T_TP"])
    return PredictedTime(
        t_comp=t_comp,
        terms=terms,
        t_bubble=bubble,
        utilization=utilization,
        curve_note=note,
        t_hidden=overlap(rows, t_comp),
        t_lag=per_kind(curve.lag, key) * t_comp if any(c.calls for c, _ in rows) else 0.0,
        bubble_factor=factor,
        t_flops=t_flops,
        t_host=t_host,
        layer_passes=passes,
        host_key=key,
    )


def measure(capture: Capture, rank: int = 0) -> MeasuredTime | None:
    """Rank ``rank``'s measured step times and communication fraction (None without step windows)."""
    windows = [w for w in capture.step_windows if w.rank == rank and w.step >= capture.warmup_steps]
    if not windows:
        return None
    mine = [c for c in capture.calls if c.rank == rank]
    busy = [busy_ns([c for c in mine if c.step == w.step], w.start_ns, w.end_ns) for w in windows]
    fractions = [b / w.duration_ns for b, w in zip(busy, windows, strict=True) if w.duration_ns > 0]
    blocked = [w.blocked_ns for w in windows if w.blocked_ns is not None]
    return MeasuredTime(
        t_iter=statistics.median(w.duration_ns for w in windows) / 1e9,
        t_comm=statistics.median(busy) / 1e9,
        comm_fraction=statistics.median(fractions) if fractions else 0.0,
        steps=len(windows),
        t_exposed=statistics.median(blocked) / 1e9 if len(blocked) == len(windows) else None,
    )


def _relative(predicted: float, measured: float | None) -> float | None:
    return None if not measured else (predicted - measured) / measured


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeAssessment:
    """The model's iteration time next to the run's (either may be missing; ``note`` says why)."""

    predicted: PredictedTime | None
    measured: MeasuredTime | None
    note: str
    domain: str | None = None
    """Why the run is outside the model's domain (None: inside). More local ranks than cores take turns
    on them, and a collective then waits for peers the scheduler has set aside, which no term of the
    model describes: such a run is reported, not judged."""

    @property
    def errors(self) -> dict[str, float | None]:
        """Relative errors of T_iter, T_comm, exposed T_comm; the absolute one of the comm fraction."""
        p, m = self.predicted, self.measured
        if p is None or m is None:
            return dict.fromkeys(("t_iter", "t_comm", "t_exposed", "comm_fraction"))
        return {
            "t_iter": _relative(p.t_iter, m.t_iter),
            "t_comm": _relative(p.t_comm, m.t_comm),
            "t_exposed": _relative(p.t_exposed, m.t_exposed),
            "comm_fraction": self.fraction_error,
        }

    @property
    def fraction_error(self) -> float | None:
        """Predicted minus measured share of the step with a call in flight (percentage points / 100)."""
        if self.predicted is None or self.measured is None:
            return None
        return self.predicted.in_flight_fraction - self.measured.comm_fraction

    def document(self) -> dict[str, object]:
        p, m = self.predicted, self.measured
        doc: dict[str, object] = {"note": self.note, "predicted": None, "measured": None}
        if p is not None:
            doc["predicted"] = {
                "t_comp_s": p.t_comp,
                "t_flops_s": p.t_flops,
                "t_host_s": p.t_host,
                "t_lag_s": p.t_lag,
                "bubble_factor": p.bubble_factor,
                "layer_passes": p.layer_passes,
                "host_key": p.host_key,
                **{f"{k.lower()}_s": v for k, v in p.terms.items()},
                "t_bubble_s": p.t_bubble,
                "t_iter_s": p.t_iter,
                "t_comm_s": p.t_comm,
                "t_exposed_s": p.t_exposed,
                "comm_fraction": p.comm_fraction,
                "in_flight_fraction": p.in_flight_fraction,
                "bubble_ratio": p.bubble_ratio,
                "utilization": p.utilization,
            }
        if m is not None:
            doc["measured"] = {
                "t_iter_s": m.t_iter,
                "t_comm_s": m.t_comm,
                "t_exposed_s": m.t_exposed,
                "comm_fraction": m.comm_fraction,
                "steps": m.steps,
            }
        doc["comm_fraction_error"] = self.fraction_error
        doc["errors"] = self.errors
        doc["domain"] = self.domain
        return doc


def curve_key(stack: dict[str, str | None]) -> str:
    """The bandwidth curve a run's time is modelled with: its hardware's, or that hardware's over the
    shaped link it ran on (``commgate.run.links``)."""
    hardware = stack.get("hardware") or ""
    return f"{hardware} | link {stack['link']}" if stack.get("link") else hardware


def assess(prediction: Prediction, capture: Capture, curve: Curve | None, note: str) -> TimeAssessment:
    """The model with ``curve`` (the capture's hardware's, ``curve_key``; None: no model, ``note`` says why)
    next to what the capture measured."""
    measured = measure(capture)
    crowded = capture.stack.get("oversubscribed")
    domain = f"out of the model's domain: {crowded}" if crowded else None
    if curve is None:
        return TimeAssessment(predicted=None, measured=measured, note=note, domain=domain)
    u = curve.utilization
    note += f"; u = {u:.3g}" + (" (calibrated)" if curve.calibrated else " (not calibrated: `commgate calibrate`)")
    try:
        predicted = predict_time(prediction, curve, note=note, utilization=u)
    except CommgateError as exc:  # a partial curve leaves the model out of this report, saying why
        return TimeAssessment(predicted=None, measured=measured, note=f"no time model: {exc}", domain=domain)
    return TimeAssessment(predicted=predicted, measured=measured, note=note, domain=domain)


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    utilization: float
    host_s: dict[str, float]
    """Host seconds per layer pass by workload kind."""
    scenarios: int
    lag: dict[str, float] = field(default_factory=dict)
    """In-flight time beyond the curve per second of compute, by workload kind (``PredictedTime.t_lag``)."""
    undetermined: tuple[str, ...] = ()
    """Workload kinds whose host time the runs cannot tell from compute (their FLOPs and layer passes in one
    proportion: one scenario, or one size): fixed at 0, u fitted without it."""


def calibrate(docs: list[dict[str, object]]) -> Calibration | None:
    """u and the host time per layer pass that best explain the measured compute time (the step less
    the time the training thread was blocked) of report scenarios' ``time_model`` documents:

        compute = t_flops / u + layer_passes x host_s[kind]

    a linear least-squares fit of 1/u and every kind's host time, on relative errors (a 20 ms step
    counts as much as a 2 s one), then refitted without the runs more than half off and beyond 3 median
    deviations (a run that stalled). Scenarios outside the model's domain, or without both sides, are left out.
    None when none is left."""
    rows = [
        (compute, p["t_flops_s"], p["layer_passes"], p["host_key"])
        for p, m, compute in _calibration_runs(docs)
        if p["t_flops_s"] > 0 and p["layer_passes"] > 0
    ]
    if not rows:
        return None
    inv_u, host, undetermined = _fit(rows)
    residuals = [abs((inv_u * f + host[k] * n) / c - 1) for c, f, n, k in rows]
    # a run more than half off, and beyond 3 median deviations, stalled or was disturbed: refit without it
    limit = max(0.5, 3 * statistics.median(residuals))
    kept = [r for r, e in zip(rows, residuals, strict=True) if e <= limit]
    if len(kept) < len(rows) and kept:
        inv_u, fitted, undetermined = _fit(kept)
        host = {k: fitted.get(k, v) for k, v in host.items()}
    u = 1 / max(inv_u, 0.1)
    return Calibration(
        utilization=u, host_s=host, scenarios=len(rows), lag=_lag(docs, u, host), undetermined=undetermined
    )


def _lag(docs: list[dict[str, object]], u: float, host: dict[str, float]) -> dict[str, float]:
    """Per workload kind, the median over its runs of (time in flight - the curve's time for the calls
    - the bubble at the fitted u and host times) / compute time."""
    lags: dict[str, list[float]] = {}
    for p, m, compute in _calibration_runs(docs):
        if p.get("t_comm_s"):
            t_comp = p["t_flops_s"] / u + p["layer_passes"] * host.get(p["host_key"], 0.0)
            bubble = p.get("bubble_factor", 0.0) * (t_comp + p.get("t_pp_s", 0.0) + p.get("t_tp_s", 0.0))
            lags.setdefault(p["host_key"], []).append(max(0.0, (m["t_comm_s"] - p["t_comm_s"] - bubble) / compute))
    return {k: statistics.median(v) for k, v in lags.items()}


def _calibration_runs(docs: list[dict[str, object]]) -> Iterator[tuple[dict[str, Any], dict[str, Any], float]]:
    """(predicted, measured, compute time) of the runs calibration can use: inside the model's domain,
    both sides present, a positive compute time (the step less the time the thread was blocked; in older
    reports, less the time a call was in flight)."""
    for doc in docs:
        p, m = doc.get("predicted"), doc.get("measured")
        if not isinstance(p, dict) or not isinstance(m, dict) or doc.get("domain") or "t_flops_s" not in p:
            continue
        exposed = m.get("t_exposed_s")
        compute = m["t_iter_s"] - (exposed if exposed is not None else m["t_comm_s"])
        if compute > 0:
            yield p, m, compute


def _fit(rows: list[tuple[float, float, int, str]]) -> tuple[float, dict[str, float], tuple[str, ...]]:
    """Least squares of ``compute / compute = (inv_u x flops + host[kind] x passes) / compute`` over the
    rows, by the normal equations; a kind whose host time comes out negative, or that the rows do not
    determine (returned), is fixed at 0 and the rest refitted."""
    kinds = sorted({k for *_, k in rows})
    free, undetermined = list(kinds), []
    while True:
        cols = 1 + len(free)
        ata = [[0.0] * cols for _ in range(cols)]
        atb = [0.0] * cols
        for c, f, n, k in rows:
            x = [f / c] + [n / c if k == j else 0.0 for j in free]
            for i in range(cols):
                atb[i] += x[i]
                for j in range(cols):
                    ata[i][j] += x[i] * x[j]
        solution, singular = _solve(ata, atb)
        if lost := [free[i - 1] for i in singular if i > 0]:
            undetermined += lost
            free = [k for k in free if k not in lost]
            continue
        host = dict.fromkeys(kinds, 0.0) | dict(zip(free, solution[1:], strict=True))
        negative = [k for k in free if host[k] < 0]
        if not negative:
            return solution[0], host, tuple(sorted(undetermined))
        free = [k for k in free if k not in negative]


def _solve(a: list[list[float]], b: list[float]) -> tuple[list[float], list[int]]:
    """``a x = b`` by Gaussian elimination with partial pivoting, and the columns the system does not determine
    (a pivot under 1e-9 of its column's diagonal: solved to 0)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = [abs(a[i][i]) for i in range(n)]
    singular = []
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) <= 1e-9 * scale[col] or abs(m[col][col]) < 1e-300:
            singular.append(col)
            continue
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [x - k * y for x, y in zip(m[r], m[col], strict=True)]
    return [0.0 if i in singular else m[i][n] / m[i][i] for i in range(n)], singular


ERROR_KEYS = ("comm_fraction", "t_iter", "t_comm", "t_exposed")
SCOPES = (("in_domain", "inside the model's domain"), ("all", "all"))
"""The scopes ``accuracy`` summarises, with their labels."""


def accuracy(docs: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, float] | None]]:
    """The model's accuracy over a report's scenarios (``time_model`` documents): per error kind
    (``TimeAssessment.errors``) the count, median and worst absolute error, over the scenarios inside
    the model's domain (``in_domain``) and over all of them (``all``)."""
    out: dict[str, dict[str, dict[str, float] | None]] = {}
    for scope, _ in SCOPES:
        kept = [d for d in docs if scope == "all" or not d.get("domain")]
        out[scope] = {}
        for key in ERROR_KEYS:
            errors = [abs(e) for d in kept if (e := (d.get("errors") or {}).get(key)) is not None]
            out[scope][key] = None
            if errors:
                out[scope][key] = {"scenarios": len(errors), "median": statistics.median(errors), "worst": max(errors)}
    return out


def accuracy_line(docs: Iterable[dict[str, Any]]) -> str | None:
    """One line for a run's end: the comm fraction's median and worst error (None without any)."""
    acc = accuracy(list(docs))
    parts = []
    for scope, label in SCOPES:
        s = acc[scope]["comm_fraction"]
        if s is not None:
            parts.append(f"{label} ({s['scenarios']:g}) median {s['median']:.2f}, worst {s['worst']:.2f}")
    return "time model, |comm fraction error|: " + "; ".join(parts) if parts else None
