"""Seed 003's iteration-time model and the measured communication fraction."""

from __future__ import annotations

import pytest
from commgate.model.predict import predict
from commgate.model.scenario import load_text
from commgate.report.bandwidth import Sample, fit
from commgate.report.timemodel import measure, predict_time, step_flops
from commgate.run.capture import Capture, CapturedCall, StepWindow, busy_ns


def call(rank: int, step: int, start: int, dur: int | None, op: str = "all_reduce") -> CapturedCall:
    return CapturedCall(
        rank=rank, seq=start, step=step, phase="backward", op=op, group=(0, 1), peer=None, dtype="fp32",
        elements=1, bytes=4, tensors=1, start_ns=start, duration_ns=dur,
    )  # fmt: skip


def test_busy_time_is_the_union_of_overlapping_calls_clipped_to_the_window() -> None:
    calls = [call(0, 1, 10, 10), call(0, 1, 15, 10), call(0, 1, 40, 5), call(0, 1, 95, 20), call(0, 1, 50, None)]
    assert busy_ns(calls, 0, 100) == 15 + 5 + 5  # [10,25) + [40,45) + [95,100)
    assert busy_ns([], 0, 100) == 0


def test_measure_takes_rank_0s_measured_steps() -> None:
    windows = (
        StepWindow(rank=0, step=0, start_ns=0, end_ns=1000),  # warm-up: ignored
        StepWindow(rank=0, step=1, start_ns=1000, end_ns=2000),
        StepWindow(rank=0, step=2, start_ns=2000, end_ns=2400),
        StepWindow(rank=1, step=1, start_ns=0, end_ns=9000),  # another rank: ignored
    )
    calls = (call(0, 0, 0, 900), call(0, 1, 1000, 250), call(0, 2, 2000, 200), call(1, 1, 0, 9000))
    cap = Capture(
        scenario="s", world_size=2, warmup_steps=1, steps=2, backend="gloo", calls=calls, step_windows=windows
    )
    m = measure(cap)
    assert m is not None and m.steps == 2
    assert m.t_iter == pytest.approx(700e-9)  # median of 1000 and 400 ns
    assert m.comm_fraction == pytest.approx((0.25 + 0.5) / 2)
    assert measure(Capture(scenario="s", world_size=2, warmup_steps=1, steps=2, backend="gloo", calls=calls)) is None


def scenario(par: str, model: str = "{preset: 19M-cpu}") -> object:
    (s,) = load_text(f"schema_version: 1\nname: t\nmodel: {model}\nparallelism: {par}\n")
    return s


def flat_curve(seconds: float, flops: float = 1e9):  # type: ignore[no-untyped-def]
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
    samples = [
        Sample(op=op, world=w, group_size=g, nbytes=n, median_s=seconds, p99_s=seconds)
        for op in ops
        for w, g in ((2, 2), (4, 2), (4, 4), (8, 8))
        for n in (1, 1 << 40)
    ]
    return fit(samples, backend="gloo", hardware="x", compute_flops={2: flops, 4: flops, 8: flops})


def test_the_bubble_ratio_is_p_minus_1_over_p_minus_1_plus_m_without_communication() -> None:
    for p, m in ((2, 4), (3, 8), (2, 1)):
        pred = predict(scenario(f"{{scheme: pp, pp: {p}, micro_batches: {m}}}"))  # type: ignore[arg-type]
        t = predict_time(pred, flat_curve(0.0 + 1e-30))
        assert t.bubble_ratio == pytest.approx((p - 1) / (p - 1 + m), rel=1e-6)


def test_each_collective_costs_its_calls_times_the_curve_on_its_axis() -> None:
    pred = predict(scenario("{scheme: tp, tp: 2}"))  # type: ignore[arg-type]
    t = predict_time(pred, flat_curve(1e-3))
    tp_calls = sum(c.calls for c in pred.steady if str(c.axis) in ("tp", "mp") and 0 in c.participants())
    assert tp_calls > 0 and t.terms["T_TP"] == pytest.approx(tp_calls * 1e-3)
    assert t.t_bubble == 0 and t.terms["T_PP"] == 0
    assert t.t_comp == pytest.approx(step_flops(pred) / 1e9)
    assert t.comm_fraction == pytest.approx(t.t_comm / (t.t_comm + t.t_comp))
    slower = predict_time(pred, flat_curve(1e-3, flops=5e8))
    assert slower.t_comp == pytest.approx(2 * t.t_comp) and slower.comm_fraction < t.comm_fraction


def test_flops_follow_megatron_and_checkpointing_adds_a_forward() -> None:
    base = predict(scenario("{scheme: ddp, dp: 2}", "{preset: 19M-cpu, s: 128}"))  # type: ignore[arg-type]
    ckpt = predict(scenario("{scheme: ddp, dp: 2, activation_checkpointing: true}", "{preset: 19M-cpu, s: 128}"))  # type: ignore[arg-type]
    m = base.scenario.model
    fwd = m.L * (24 * m.s * m.h**2 + 4 * m.s**2 * m.h) + 2 * m.s * m.h * m.V
    assert step_flops(base) == 3 * fwd and step_flops(ckpt) == 4 * fwd
    tp2 = predict(scenario("{scheme: tp, tp: 2}", "{preset: 19M-cpu, s: 128}"))  # type: ignore[arg-type]
    assert step_flops(tp2) == 3 * fwd / 2


def test_assess_names_a_missing_or_bad_curve_instead_of_failing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from commgate.report.timemodel import assess

    pred = predict(scenario("{scheme: ddp, dp: 2}"))  # type: ignore[arg-type]
    windows = (StepWindow(rank=0, step=1, start_ns=0, end_ns=100),)
    cap = Capture(
        scenario="s", world_size=2, warmup_steps=1, steps=1, backend="gloo", calls=(call(0, 1, 10, 20),),
        stack={"hardware": "cpu"}, step_windows=windows,
    )  # fmt: skip
    t = assess(pred, cap, tmp_path)
    assert t.predicted is None and t.measured is not None and "no bandwidth curve" in t.note
    (tmp_path / "bandwidth-gloo.json").write_text("{")
    t = assess(pred, cap, tmp_path)
    assert t.predicted is None and t.note.startswith("no time model:") and "not valid JSON" in t.note
    assert t.document()["comm_fraction_error"] is None


def test_a_missing_bandwidth_curve_says_how_to_make_one_in_the_summary() -> None:
    from commgate.report.report import ScenarioResult
    from commgate.report.timemodel import MeasuredTime, TimeAssessment

    (s,) = load_text("schema_version: 1\nname: d\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    note = "no bandwidth curve in baselines/bandwidth-gloo.json: run `pytest benchmarks/ --commgate-bench-save`"
    tm = TimeAssessment(
        predicted=None, measured=MeasuredTime(t_iter=0.1, t_comm=0.03, comm_fraction=0.3, steps=2), note=note
    )
    head = ScenarioResult(prediction=predict(s), status="passed", time_model=tm).summary().splitlines()[0]
    assert head.endswith(f"comm fraction 30% (model -: {note})")
