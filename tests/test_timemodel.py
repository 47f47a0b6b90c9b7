"""Seed 003's iteration-time model and the measured communication fraction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from commgate.model.loader import load_text
from commgate.model.predict import predict
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
    from commgate.judge.store import BaselineStore
    from commgate.pipeline import time_model

    pred = predict(scenario("{scheme: ddp, dp: 2}"))  # type: ignore[arg-type]
    windows = (StepWindow(rank=0, step=1, start_ns=0, end_ns=100),)
    cap = Capture(
        scenario="s", world_size=2, warmup_steps=1, steps=1, backend="gloo", calls=(call(0, 1, 10, 20),),
        stack={"hardware": "cpu"}, step_windows=windows,
    )  # fmt: skip
    t = time_model(pred, cap, BaselineStore(tmp_path))  # none measured: commgate's shipped gloo curve, said so
    assert t.predicted is not None and "no bandwidth curve" in t.note and "default gloo curve" in t.note
    from dataclasses import replace

    t = time_model(pred, replace(cap, backend="nccl"), BaselineStore(tmp_path))  # none shipped for nccl
    assert t.predicted is None and t.measured is not None and "no bandwidth curve" in t.note
    (tmp_path / "bandwidth-gloo.json").write_text("{")
    t = time_model(pred, cap, BaselineStore(tmp_path))
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


def test_ddp_buckets_hide_behind_the_backward_all_but_the_last() -> None:
    """DDP's bucket all-reduces are issued without waiting: each but the last runs behind the backward
    while it lasts, so the exposed time is the last bucket, or what does not fit."""
    s = scenario("{scheme: ddp, dp: 2, ddp_bucket_mb: 0.5}")
    pred = predict(s)  # type: ignore[arg-type]
    buckets = [c for c in pred.steady if c.overlaps]
    assert len(buckets) >= 2 and all(c.op == "all_reduce" and str(c.phase) == "backward" for c in buckets)
    per_call = 1e-3
    t_flops = step_flops(pred) / 1e9
    fast = predict_time(pred, flat_curve(per_call))  # compute >> communication: all but one bucket hidden
    assert fast.t_exposed == pytest.approx(per_call)
    assert fast.t_iter == pytest.approx(t_flops + per_call)
    slow = predict_time(pred, flat_curve(10.0))  # communication >> compute: the backward hides what it can
    assert slow.t_hidden == pytest.approx(2 / 3 * t_flops)
    assert slow.t_exposed == pytest.approx(slow.t_comm - 2 / 3 * t_flops)


def test_blocking_collectives_are_all_exposed() -> None:
    pred = predict(scenario("{scheme: tp, tp: 2}"))  # type: ignore[arg-type]
    t = predict_time(pred, flat_curve(1e-3))
    assert not any(c.overlaps for c in pred.steady) and t.t_hidden == 0 and t.t_exposed == t.t_comm


def doc(compute: float, flops: float, passes: int, key: str, domain: str | None = None) -> dict[str, object]:
    predicted = {"t_flops_s": flops, "layer_passes": passes, "host_key": key}
    measured = {"t_iter_s": compute + 0.01, "t_exposed_s": 0.01, "t_comm_s": 0.02}
    return {"predicted": predicted, "measured": measured, "domain": domain}


def test_calibration_recovers_u_and_each_kinds_host_time() -> None:
    """Runs made by a known u = 0.25 and host times of 1 ms (ddp) and 4 ms (tp) per layer pass, one of
    them noisy: the fit gives them back; runs outside the domain are left out."""
    from commgate.report.timemodel import calibrate

    docs = [
        doc(f / 0.25 + n * h, f, n, k)
        for k, h in (("ddp", 1e-3), ("tp", 4e-3))
        for f, n in ((0.01, 8), (0.05, 12), (0.2, 16), (0.4, 8))
    ]
    docs.append(doc(5.0, 0.01, 8, "ddp"))  # a run that stalled: the medians shrug it off
    docs.append(doc(99.0, 0.01, 8, "tp", domain="out of the model's domain: 4 ranks on 2 cores"))
    fit = calibrate(docs)
    assert fit is not None and fit.scenarios == 9
    assert fit.utilization == pytest.approx(0.25, rel=0.05)
    assert fit.host_s["ddp"] == pytest.approx(1e-3, rel=0.1) and fit.host_s["tp"] == pytest.approx(4e-3, rel=0.1)
    assert calibrate([doc(1.0, 0.1, 4, "ddp", domain="out")]) is None


def test_a_host_time_the_runs_cannot_tell_from_u_is_said_to_be_undetermined() -> None:
    """One scenario, or runs of one size (FLOPs and layer passes in one proportion), fit u and a host time
    equally well in any mix: ``commgate calibrate`` printed "host time per layer pass, ddp 0.000 ms" as if
    measured. The kind is named undetermined, its host time 0 and u fitted without it. Beside runs of other
    sizes that fix u, the same runs do determine it."""
    from commgate.report.timemodel import calibrate

    one = calibrate([doc(0.05 / 0.25 + 12 * 1e-3, 0.05, 12, "ddp")])
    assert one is not None and one.undetermined == ("ddp",) and one.host_s == {"ddp": 0.0}
    assert one.utilization == pytest.approx(0.05 / (0.05 / 0.25 + 12e-3))
    same_size = [doc(0.05 / 0.25 + 12e-3, 0.05, 12, "ddp") for _ in range(3)]
    sized = [doc(f / 0.25 + n * 4e-3, f, n, "tp") for f, n in ((0.01, 8), (0.2, 16), (0.4, 8))]
    alone = calibrate(same_size)
    assert alone is not None and alone.undetermined == ("ddp",)
    mixed = calibrate(same_size + sized)
    assert mixed is not None and mixed.undetermined == () and mixed.utilization == pytest.approx(0.25, rel=0.05)
    assert mixed.host_s == pytest.approx({"ddp": 1e-3, "tp": 4e-3}, rel=0.1)


def test_an_uncalibrated_kind_takes_the_median_host_time() -> None:
    import dataclasses

    from commgate.report.timemodel import per_kind

    curve = dataclasses.replace(flat_curve(1e-3), host_s={"ddp": 1e-3, "tp": 3e-3, "fsdp": 2e-3})
    assert per_kind(curve.host_s, "tp") == 3e-3 and per_kind(curve.host_s, "zero3") == 2e-3
    assert per_kind({}, "tp") == 0.0
    pred = predict(scenario("{scheme: tp, tp: 2}"))  # type: ignore[arg-type]
    t = predict_time(pred, curve, utilization=0.5)
    assert t.host_key == "tp" and t.layer_passes == 2 * 6  # forward and backward of 6 layers, 1 micro-batch
    assert t.t_comp == pytest.approx(t.t_flops / 0.5 + 12 * 3e-3)


def test_the_time_gate_fails_past_max_error_and_is_silent_out_of_domain() -> None:
    from commgate.judge.finding import Finding
    from commgate.judge.gate import against_time
    from commgate.report.timemodel import MeasuredTime

    pred = predict_time(predict(scenario("{scheme: ddp, dp: 2}")), flat_curve(1e-3))  # type: ignore[arg-type]
    close = MeasuredTime(t_iter=pred.t_iter, t_comm=pred.t_comm, comm_fraction=pred.in_flight_fraction + 0.05, steps=3)
    far = MeasuredTime(t_iter=pred.t_iter, t_comm=pred.t_comm, comm_fraction=pred.in_flight_fraction + 0.3, steps=3)

    def judged(measured: MeasuredTime, max_error: float | None = 0.15, domain: str | None = None) -> Finding | None:
        return against_time(max_error, predicted=pred.step(), measured=measured.step(), domain=domain, note="")

    assert judged(close) is None
    f = judged(far)
    assert f is not None and f.fail and f.kind == "time" and "error -0.300, allowed 0.15" in f.text()
    assert "commgate calibrate" in f.text()
    assert judged(far, None) is None
    out = judged(far, domain="out of the model's domain: 4 ranks")
    assert out is not None and not out.fail and "4 ranks" in out.title


def test_accuracy_summarises_errors_inside_the_domain_and_overall() -> None:
    from commgate.report.timemodel import accuracy, accuracy_line

    def tm(frac: float | None, t_iter: float | None, domain: str | None = None) -> dict[str, object]:
        errors = {"comm_fraction": frac, "t_iter": t_iter, "t_comm": None, "t_exposed": None}
        return {"errors": errors, "domain": domain}

    docs = [tm(0.05, 0.1), tm(-0.2, -0.3), tm(0.1, None), tm(0.5, 0.9, domain="4 ranks on 2 cores"), tm(None, None)]
    acc = accuracy(docs)
    assert acc["in_domain"]["comm_fraction"] == {"scenarios": 3, "median": 0.1, "worst": 0.2}
    assert acc["all"]["comm_fraction"] == {"scenarios": 4, "median": pytest.approx(0.15), "worst": 0.5}
    assert acc["in_domain"]["t_iter"] == {"scenarios": 2, "median": pytest.approx(0.2), "worst": 0.3}
    assert acc["all"]["t_comm"] is None
    line = accuracy_line(docs)
    assert line == (
        "time model, |comm fraction error|: inside the model's domain (3) median 0.10, worst 0.20; "
        "all (4) median 0.15, worst 0.50"
    )
    assert accuracy_line([tm(None, None)]) is None


def test_a_scenario_gates_on_the_time_model_with_expectations_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real two-rank run judged against the shipped curve: an impossible max_error fails naming both
    fractions; a loose one passes; a run outside the model's domain is noted, not failed."""
    import shutil

    from commgate.model.loader import load_text
    from commgate.pipeline import Options, run_scenario
    from commgate.run.runners import LocalRanks

    shutil.copy(Path(__file__).parents[1] / "baselines" / "bandwidth-gloo.json", tmp_path)
    options = Options(baseline_dir=tmp_path, gate=False)

    def run(max_error: float, dp: int = 2):  # type: ignore[no-untyped-def]
        text = (
            f"schema_version: 1\nname: t\nmodel: {{preset: 19M-cpu, s: 32}}\nparallelism: {{scheme: ddp, dp: {dp}}}\n"
            f"steps: 2\nexpectations: {{time: {{max_error: {max_error}}}}}\n"
        )
        (s,) = load_text(text)
        assert s.expectations.time_max_error == max_error
        result = run_scenario(s, LocalRanks(), options)
        assert result is not None and result.time_model is not None
        return result

    strict = run(0.0001)
    assert strict.status == "failed" and "[time] the iteration-time model misses" in strict.reason
    assert "comm fraction: obtained" in strict.reason and "allowed 0.0001" in strict.reason
    assert run(1.0).status == "passed"
    if (os.cpu_count() or 1) < 3:  # three ranks on fewer cores: outside the model's domain
        crowded = run(0.0001, dp=3)
        assert crowded.status == "passed"
        assert any(f.kind == "time" and "out of the model's domain" in f.title for f in crowded.findings)


def test_the_lag_is_fitted_per_kind_and_counts_in_flight_only() -> None:
    """Runs whose calls stay in flight 10% (ddp) and 50% (tp) of their compute beyond the curve: the fit
    gives each kind its own lag; the prediction adds it to the in-flight share, not to the exposed time."""
    import dataclasses

    from commgate.report.timemodel import calibrate

    docs = []
    for k, lag in (("ddp", 0.1), ("tp", 0.5)):
        for f, n in ((0.01, 8), (0.05, 12), (0.2, 16)):
            d = doc(f / 0.25 + n * 1e-3, f, n, k)
            d["predicted"] |= {"t_comm_s": 0.004, "t_pp_s": 0.0, "t_tp_s": 0.0, "bubble_factor": 0.0}  # type: ignore[operator]
            compute = f / 0.25 + n * 1e-3
            d["measured"] |= {"t_comm_s": 0.004 + lag * compute}  # type: ignore[operator]
            docs.append(d)
    fit = calibrate(docs)
    assert fit is not None and fit.lag == pytest.approx({"ddp": 0.1, "tp": 0.5}, rel=1e-6)
    pred = predict(scenario("{scheme: tp, tp: 2}"))  # type: ignore[arg-type]
    curve = dataclasses.replace(flat_curve(1e-3), lag=fit.lag)
    t = predict_time(pred, curve)
    assert t.t_lag == pytest.approx(0.5 * t.t_comp) and t.t_exposed == t.t_comm
    assert t.in_flight_fraction == pytest.approx(min(1.0, (t.t_comm + t.t_lag) / t.t_iter))
