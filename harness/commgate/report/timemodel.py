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
(T_comm + T_bubble) / T_iter; without a pipeline the two are the paper's comm fraction. Torch-free.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from commgate.core.errors import CommgateError
from commgate.model import transformer
from commgate.model.expectation import Prediction
from commgate.model.scenario import Parallelism
from commgate.report import bandwidth
from commgate.report.bandwidth import Curve
from commgate.run.capture import Capture, busy_ns

AXIS_TERM = {"tp": "T_TP", "mp": "T_TP", "pp": "T_PP", "dp": "T_DP", "hpz": "T_DP", "ep": "T_EP"}
"""Which of the paper's terms a collective's axis belongs to (MoE's expert all-to-all is not in the
paper's PTP model: it gets its own term, counted as communication)."""


def step_flops(prediction: Prediction) -> float:
    """Training FLOPs per step on one rank of the busiest pipeline stage (``transformer.step_flops``)."""
    return transformer.step_flops(prediction.scenario.model, prediction.scenario.parallelism)


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictedTime:
    t_comp: float
    terms: dict[str, float]
    """T_TP, T_PP, T_DP, T_EP in seconds per step (rank 0)."""
    t_bubble: float
    utilization: float
    curve_note: str

    @property
    def t_comm(self) -> float:
        return sum(self.terms.values())

    @property
    def t_iter(self) -> float:
        return self.t_comp + self.t_comm + self.t_bubble

    @property
    def comm_fraction(self) -> float:
        return self.t_comm / self.t_iter if self.t_iter else 0.0

    @property
    def in_flight_fraction(self) -> float:
        """What the capture can measure: the share of the step with a call in flight. A pipeline rank spends
        its bubble blocked in a recv, so the bubble counts here (and not in ``comm_fraction``)."""
        return (self.t_comm + self.t_bubble) / self.t_iter if self.t_iter else 0.0

    @property
    def bubble_ratio(self) -> float:
        return self.t_bubble / self.t_iter if self.t_iter else 0.0


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


def predict_time(prediction: Prediction, curve: Curve, *, note: str = "", utilization: float = 1.0) -> PredictedTime:
    s = prediction.scenario
    world, par = s.world_size, s.parallelism
    terms = {"T_TP": 0.0, "T_PP": 0.0, "T_DP": 0.0, "T_EP": 0.0}
    for c in prediction.steady:
        if 0 not in c.participants():
            continue
        per_call = curve.seconds(str(c.op), group_size=c.group_size, world=world, nbytes=c.bytes_per_call)
        terms[AXIS_TERM.get(str(c.axis), "T_DP")] += c.calls * per_call
    t_comp = step_flops(prediction) / (utilization * curve.flops(world))
    bubble = bubble_factor(par) * (t_comp + terms["T_PP"] + terms["T_TP"])
    return PredictedTime(t_comp=t_comp, terms=terms, t_bubble=bubble, utilization=utilization, curve_note=note)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeAssessment:
    """The model's iteration time next to the run's (either may be missing; ``note`` says why)."""

    predicted: PredictedTime | None
    measured: MeasuredTime | None
    note: str

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
                **{f"{k.lower()}_s": v for k, v in p.terms.items()},
                "t_bubble_s": p.t_bubble,
                "t_iter_s": p.t_iter,
                "t_comm_s": p.t_comm,
                "t_exposed_s": p.t_comm,
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
        return doc


def assess(prediction: Prediction, capture: Capture, curves: Path) -> TimeAssessment:
    """The model with the bandwidth curve of the capture's hardware from the baseline directory ``curves``."""
    measured = measure(capture)
    hardware = capture.stack.get("hardware") or ""
    try:
        curve, note = bandwidth.lookup(bandwidth.path_for(curves, capture.backend), hardware)
        if curve is None:
            return TimeAssessment(predicted=None, measured=measured, note=note)
        u = curve.utilization
        note += f"; u = {u:.3g}" + (" (calibrated)" if curve.calibrated else " (not calibrated: `commgate calibrate`)")
        predicted = predict_time(prediction, curve, note=note, utilization=u)
    except CommgateError as exc:  # a bad or partial curve leaves the model out of this report, saying why
        return TimeAssessment(predicted=None, measured=measured, note=f"no time model: {exc}")
    return TimeAssessment(predicted=predicted, measured=measured, note=note)


def implied_utilization(doc: dict[str, object]) -> float | None:
    """The u at which a scenario's predicted compute time equals its measured one (the step less the time
    with a call in flight), from a report's ``time_model``; None without both sides."""
    p, m = doc.get("predicted"), doc.get("measured")
    if not isinstance(p, dict) or not isinstance(m, dict):
        return None
    compute = m["t_iter_s"] - m["t_comm_s"]
    if compute <= 0:
        return None
    return float(p["t_comp_s"] * p["utilization"] / compute)
