"""One scenario's life, the same whatever started it (``commgate run``, ``torchrun -m commgate run``, the
pytest gate): predict -> run -> reconcile -> time model -> judge -> ``ScenarioResult``.

The entry points only adapt: they choose a ``Runner`` (``commgate.run.runners``) and ``Options``, print
or raise what the result says, and add it to a report. A field added to the result here (a reason, a
finding) so reaches every output at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from commgate.core.errors import CommgateError, WriteError
from commgate.judge.baseline import BaselineError
from commgate.judge.finding import Finding
from commgate.judge.gate import UPDATE_FLAG, against_time, judge, model_findings, sibling_flag
from commgate.judge.reconcile import reconcile
from commgate.judge.store import BaselineStore
from commgate.model.expectation import Prediction
from commgate.model.predict import predict
from commgate.model.scenario import Backend, Scenario
from commgate.model.trainers import TRAINERS
from commgate.report import bandwidth
from commgate.report.report import ScenarioResult
from commgate.report.timemodel import TimeAssessment, assess, curve_key
from commgate.run.capture import Capture
from commgate.run.captured import FromCapture, load
from commgate.run.launcher import RunError
from commgate.run.runners import Runner


@dataclass(frozen=True, kw_only=True)
class Options:
    baseline_dir: Path = Path("baselines")
    """The baseline directory: baselines and bandwidth curves (laid out by ``commgate.judge.store``)."""
    gate: bool = True
    """Judge as the regression gate does (model, paper, baseline, drift); else against the model only."""
    update_baselines: bool = False
    refresh_latency: bool = False
    """With ``update_baselines``: also rewrite a baseline whose communication is unchanged, to store this
    run's latency samples."""
    update_flag: str = UPDATE_FLAG
    """The flag a failure names as the way to accept a change."""
    backend: Backend | None = None
    """Run on this backend instead of the one the scenario declares."""
    faulty: bool = False
    """Faults are planted (``--commgate-fault``): a difference from the baseline is theirs, nothing to accept."""


def run_scenario(scenario: Scenario, runner: Runner, options: Options) -> ScenarioResult | None:
    """The result of running ``scenario`` with ``runner`` (None on a torchrun rank that does not report).
    Every result carries its status, its findings and, unless it passed, the reason."""
    started = time.monotonic()
    if options.backend:
        scenario = replace(scenario, backend=options.backend)
    prediction = predict(scenario)

    def result(**kw: object) -> ScenarioResult:
        return ScenarioResult(prediction=prediction, wall_s=time.monotonic() - started, **kw)  # type: ignore[arg-type]

    if reason := TRAINERS[scenario.trainer].unavailable():  # an error, not a skip: the gate did not run
        return result(status="error", reason=reason)
    if scenario.capture is not None:  # a job already captured (``capture:``): judged as commgate check judges it
        try:
            runner = FromCapture(captured=load(Path(scenario.capture)))
        except CommgateError as exc:
            return result(status="error", reason=f"{scenario.file}: capture: {exc}")
        if reason := runner.mismatch(scenario):  # the scenario's error: the suite goes on (it stopped the run)
            return result(status="error", reason=reason)
    if reason := runner.skip_reason(scenario):
        return result(status="skipped", reason=reason)
    try:
        capture = runner.run(scenario)
    except RunError as exc:
        return result(status="error", reason=str(exc))
    if capture is None:
        return None
    rec = reconcile(prediction, capture)
    store = BaselineStore(options.baseline_dir)
    e = scenario.expectations
    baseline, written, latency_note = None, None, ""
    if options.gate:
        try:
            j = judge(
                e,
                prediction.comparison(),
                capture,
                rec,
                store,
                update=options.update_baselines,
                refresh_latency=options.refresh_latency,
                update_flag=options.update_flag,
                rerun=lambda: _rerun(runner, scenario),
            )
            if options.faulty:  # the planted fault's difference: no obtained file to copy, no change to accept
                store.discard_obtained(capture.backend, capture.scenario)
        except (BaselineError, WriteError) as exc:
            # the scenario's baseline cannot be read or written: its error, one line, and the suite goes on
            # (``commgate run --gate`` stopped at the first, with no report; found by an adversarial pass);
            # the file is still this scenario's (it was listed among the baselines no scenario used)
            try:
                own = store.path(capture.backend, capture.scenario)
            except WriteError:
                own = None
            return result(status="error", reason=str(exc), baseline=own)
        findings, baseline, written, latency_note = j.findings, j.baseline, j.written, j.latency_note
        if options.faulty:
            fault = sibling_flag(options.update_flag, "fault")
            hint = f"a planted fault ({fault}) made this difference: nothing to accept, the baseline stands"
            findings = tuple(replace(f, hint=hint) if f.kind == "baseline" and f.fail else f for f in findings)
    else:
        findings = model_findings(e, rec)
    # an emulated run's calls complete without a peer: no communication time to model
    # nor for a job no scenario describes: the prediction is a stand-in's
    known = e.model_known and capture.ranks is None
    timed = time_model(prediction, capture, store) if known else None
    gate_time = _against_time(e.time_max_error, timed) if timed is not None else None
    warned = (Finding(kind="config", fail=False, title=w) for w in scenario.remarks)
    findings = (*findings, *warned, *filter(None, [gate_time]))
    failing = [f for f in findings if f.fail]
    judged = options.gate or e.model_check  # without --gate, a baseline-only scenario is judged by nothing
    return result(
        status="failed" if failing else "passed" if judged else "unjudged",
        reason="\n".join(f.text() for f in failing) if judged else UNJUDGED,
        findings=findings,
        baseline=baseline,
        baseline_written=written,
        latency_note=latency_note,
        capture=capture,
        reconciliation=rec,
        time_model=timed,
    )


UNJUDGED = (
    "ran, not judged: its model check is off (expectations.model.check: false) and commgate run without --gate "
    "judges the model only; add --gate to judge it against its baseline and drift"
)


def time_model(prediction: Prediction, capture: Capture, store: BaselineStore) -> TimeAssessment:
    """The time model of a run, with the bandwidth curve of its hardware (and link) read from the store;
    a curve file that cannot be read leaves the model out of the report, saying why."""
    try:
        curve, note = bandwidth.lookup(store.curve_path(capture.backend), curve_key(capture.stack))
    except CommgateError as exc:
        curve, note = None, f"no time model: {exc}"
    return assess(prediction, capture, curve, note)


def _against_time(max_error: float | None, timed: TimeAssessment) -> Finding | None:
    """The time gate (``commgate.judge.gate.against_time``) on the numbers of the assessment."""
    p, m = timed.predicted, timed.measured
    return against_time(
        max_error,
        predicted=p.step() if p is not None else None,
        measured=m.step() if m is not None else None,
        domain=timed.domain,
        note=timed.note,
    )


def _rerun(runner: Runner, scenario: Scenario) -> Capture | None:
    """The scenario run again to confirm a latency shift (None if that run failed: no confirmation)."""
    print(f"    latency looks shifted: rerunning {scenario.id} to confirm", flush=True)
    try:
        return runner.run(scenario)
    except RunError:
        return None
