"""The regression gate's verdict on one run: the three kinds of assertion and the drift checks, each a
``Finding`` (``commgate.judge.finding``) that shows only what differs (obtained / expected / difference),
bounded in length.

1. Model: every (window, op, group, dtype, size, phase) call count and every op's bytes per step
   against the per-collective model (exact unless the scenario declares tolerances), and the traffic
   matrix when both are exact.
2. Paper: each equation against the model, after the named residual terms, within ``paper.rtol``.
3. Baseline: counts, bytes and the message-size histogram exactly (``commgate.judge.baseline``, stored by
   ``commgate.judge.store``); latency against the stored runs by ``commgate.judge.drift.shifts``, a
   slowdown confirmed by rerunning the scenario (warn, or fail where the scenario says so); not where the
   run had more ranks on a host than it has cores (gloo) or GPUs: there the calls' times are the
   scheduler's (on this project's 2-core CI machine, 4-rank runs of the unchanged suite came out
   x1.6-x2.9 slower on some days than on others).
Plus the cold-start check within the run, and the time model's communication fraction against
``expectations.time.max_error`` (``against_time``). The gate takes what it judges: the scenario's
``Expectations``, the run's capture and reconciliation, the prediction's paper comparison; the scenario
and backend a baseline belongs to are the capture's. Torch-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from commgate.core.units import human_bytes, shown, signed
from commgate.judge.baseline import Baseline, compare, provenance
from commgate.judge.causes import CallKey, Cause, recognise
from commgate.judge.drift import (
    MEASURE,
    Assessment,
    RunLatency,
    cold_starts,
    shifts,
    slow_start_text,
    slow_starts,
    summarize,
)
from commgate.judge.finding import Difference, Finding
from commgate.judge.reconcile import KeyCount, Reconciliation
from commgate.judge.store import BaselineStore
from commgate.model.expectation import TermComparison
from commgate.model.scenario import Expectations
from commgate.run.capture import Capture

UPDATE_FLAG = "--commgate-update-baselines"


def sibling_flag(update_flag: str, name: str) -> str:
    """Option ``name`` as the entry point whose update flag is ``update_flag`` spells it (pytest's
    ``--commgate-…`` or ``commgate run --gate``'s)."""
    return update_flag.replace("update-baselines", name)


def refresh_flags(update_flag: str) -> str:
    """The flags that add a run to the latency history at the entry point whose update flag is ``update_flag``."""
    return f"{update_flag} {sibling_flag(update_flag, 'refresh-latency')}"


@dataclass(kw_only=True)
class Verdict:
    findings: list[Finding] = field(default_factory=list)
    latency_note: str = ""
    """How latency was judged (or why it was not), for the summary."""


def against_model(e: Expectations, rec: Reconciliation) -> Finding | None:
    differing = [k for k in rec.keys if not e.model_calls.allows(k.measured_calls, k.predicted_calls)]
    diffs = [Difference(k.label, k.measured_calls, k.predicted_calls, detail=k.source) for k in differing]
    for o in rec.ops:
        expected = o.predicted_bytes + sum((b for _, b in o.residuals), Fraction(0))
        if not e.model_bytes.allows(o.measured_bytes, expected):
            unexplained = f"{signed(o.unexplained_bytes)} unexplained"
            diffs.append(Difference(f"bytes per step, {o.op}", o.measured_bytes, expected, detail=unexplained))
    exact = e.model_calls.rtol == e.model_calls.atol == e.model_bytes.rtol == e.model_bytes.atol == 0
    if exact and rec.traffic_measured != rec.traffic_predicted:
        pairs = sorted(set(rec.traffic_measured) | set(rec.traffic_predicted))
        for src, dst in pairs:
            a, b = rec.traffic_measured.get((src, dst), Fraction(0)), rec.traffic_predicted.get((src, dst), Fraction(0))
            if a != b:
                diffs.append(Difference(f"traffic {src} -> {dst}", a, b, unit="B/step"))
    if not diffs:
        return None
    return Finding(
        kind="model",
        fail=True,
        title="measured communication differs from the per-collective model",
        causes=model_causes(differing, steps=rec.steps),
        differences=tuple(diffs),
    )


def model_causes(keys: Sequence[KeyCount], *, steps: int | None) -> tuple[Cause, ...]:
    """What the call keys whose count differs from the model's mean, in words (``recognise``)."""

    def key(k: KeyCount) -> CallKey:
        return (k.window, k.op, k.group, k.dtype, k.bytes_per_call, k.phase)

    measured = {key(k): k.measured_calls for k in keys}
    return recognise(measured, {key(k): k.predicted_calls for k in keys}, steps=steps)


def unchecked(e: Expectations) -> Finding:
    """What the baseline-only mode says instead of the model's verdict (never a failure)."""
    why = "expectations.model.check: false" if e.model_known else "no scenario describes the job"
    return Finding(
        kind="model",
        fail=False,
        title=f"the model was not checked ({why}): only the baseline and drift gate this run",
    )


def model_findings(e: Expectations, rec: Reconciliation) -> tuple[Finding, ...]:
    """The model's verdict alone (``commgate run`` without ``--gate``)."""
    if not e.model_check:  # and no baseline, no drift: nothing judges the run (its status says so)
        return (
            Finding(
                kind="model",
                fail=False,
                title="the model was not checked (expectations.model.check: false), and without --gate neither "
                "its baseline nor drift: nothing judged this run",
            ),
        )
    f = against_model(e, rec)
    return (f,) if f else ()


def against_paper(e: Expectations, paper: Sequence[TermComparison]) -> Finding | None:
    """Each of the paper's equations against the model (``Prediction.comparison()``), after the named terms."""
    lines = []
    for c in paper:
        term = c.term.bytes
        if abs(c.unexplained_bytes) > e.paper_rtol * term:
            named = ", ".join(f"{r.name} {human_bytes(r.bytes)}" for r in c.residuals) or "none"
            lines.append(
                f"{c.term.equation}: model {human_bytes(c.model_bytes)}, paper {human_bytes(term)}, "
                f"named terms: {named}; unexplained {shown(c.unexplained_bytes)} B "
                f"(> rtol {e.paper_rtol:g})"
            )
    if not lines:
        return None
    return Finding(
        kind="paper",
        fail=True,
        title="the model differs from the paper's equations beyond the named terms",
        notes=tuple(lines),
    )


def against_baseline(
    e: Expectations, now: Baseline, stored: Baseline, update_flag: str = UPDATE_FLAG, *, steps: int | None = None
) -> list[Finding]:
    """Counts, bytes and message sizes against the stored baseline; what the differing calls mean in words
    where a pattern proves it (``steps``, the run's measured steps, gives an added call's rate)."""
    out = []
    diffs = compare(now, stored, bytes_tol=e.baseline_bytes, calls_tol=e.baseline_calls)
    if diffs:
        taken = stored.provenance
        sizes = _sizes(now, stored)
        sized = f"; at world size {sizes[0]}, this run {sizes[1]}" if sizes else ""
        out.append(
            Finding(
                kind="baseline",
                fail=True,
                title=f"communication differs from the baseline (taken {taken.get('date')} at "
                f"{taken.get('commit') or 'no commit'}, torch {taken.get('torch')}, "
                f"deepspeed {taken.get('deepspeed') or 'none'}{sized})",
                causes=recognise(now.calls, stored.calls, steps=steps),
                differences=tuple(diffs),
                hint=f"if the change is intended, accept it with {update_flag}",
            )
        )
    return out


def _sizes(now: Baseline, stored: Baseline) -> tuple[int, int] | None:
    """The stored baseline's world size and this run's, where they differ (a scenario's ``dp`` edited under the
    same name): its calls are another job's, which the finding's title did not say (found by an adversarial
    pass), and its latency history another job's too."""
    a, b = stored.provenance.get("world_size"), now.provenance.get("world_size")
    return (a, b) if isinstance(a, int) and isinstance(b, int) and a != b else None


Rerun = Callable[[], Capture | None]
"""Runs the scenario again and returns its capture (None when it could not): the gate's confirmation."""


def against_latency(
    e: Expectations,
    now: Baseline,
    stored: Baseline,
    rerun: Rerun | None = None,
    update_flag: str = UPDATE_FLAG,
) -> tuple[Finding | None, str]:
    """This run's latency against the stored runs on the same hardware (``commgate.judge.drift.shifts``).
    An op that looks slower (or faster) is confirmed by up to ``latency.confirm`` reruns (``rerun``): it
    stays *slower* only if every run is. Returns the finding (a speed-up is reported, never a failure)
    and a line saying how latency was judged."""
    rule = e.latency
    hw = now.provenance["hardware"]
    history = stored.latency.get(hw, ())
    counted = sum(r.measure == MEASURE for r in history)  # an earlier version's runs are not compared
    runs: list[RunLatency] = list(now.latency.get(hw, ()))
    a = shifts(runs, history, rule)
    reruns, unconfirmed = 0, ""
    while (a.slower or a.faster) and reruns < rule.confirm and rerun is not None:
        capture = rerun()
        if capture is None:
            unconfirmed = " (not confirmed: a rerun failed)"  # so it never fails the gate
            break
        reruns += 1
        runs.append(summarize(capture))
        a = shifts(runs, history, rule)
    note = f"{a.note} (stored runs; {refresh_flags(update_flag)} adds one)" if a.note else _judged(a, counted, reruns)
    moved = a.changed()
    if not moved:
        return None, note
    return (
        Finding(
            kind="latency",
            fail=rule.action == "fail" and a.slower and not unconfirmed,
            title=f"latency shifted against {counted} stored run(s) on {hw}{unconfirmed}",
            notes=tuple(m.text() for m in moved),
            hint=f"if this machine is now the reference, store this run with {refresh_flags(update_flag)}",
        ),
        note,
    )


def _judged(a: Assessment, stored: int, reruns: int) -> str:
    confirmed = f" and {reruns} confirming rerun(s)" if reruns else ""
    return f"latency judged against {stored} stored run(s){confirmed}: {a.summary()}"


def cold_start(e: Expectations, capture: Capture) -> Finding | None:
    rule = e.cold_start
    spikes = cold_starts(capture, rule)
    if not spikes:
        return None
    return Finding(
        kind="cold-start",
        fail=rule.action == "fail",
        title=f"first-step latency spikes (> {rule.factor:g}x the steady median, or the time expected for the "
        f"size, and > {rule.min_excess_ms:g} ms slower)",
        notes=tuple(c.text() for c in spikes) + _crowded(capture),
    )


def _crowded(capture: Capture) -> tuple[str, ...]:
    """What a spike on a run with more ranks than cores cannot tell: a rank waiting for a core to
    deliver its side looks the same as a slow link."""
    crowded = capture.stack.get("oversubscribed")
    if not crowded:
        return ()
    return (f"this run had {crowded}: a rank that waited for a core after both sides issued looks the same as a "
            "slow link; judge cold starts where each rank has a core (or a GPU) of its own",)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """Rank 0's step as the time gate compares it, modelled or measured (``commgate.report.timemodel``
    computes both sides): the share of the step with a call in flight, the step and the time in flight."""

    comm_fraction: float
    t_iter: float
    """Seconds per step."""
    t_comm: float
    """Seconds per step with a call in flight."""


def against_time(
    max_error: float | None, *, predicted: StepTime | None, measured: StepTime | None, domain: str | None, note: str
) -> Finding | None:
    """The ``expectations.time`` gate: a failure when the measured comm fraction is off the model's by more
    than ``max_error``; a note (not a failure) when the run cannot be judged: outside the model's ``domain``,
    or a side missing (``note`` says why)."""
    if max_error is None:
        return None
    why = domain or (note if predicted is None or measured is None else None)
    if why:
        return Finding(kind="time", fail=False, title=f"time model not judged (expectations.time.max_error): {why}")
    if predicted is None or measured is None:
        return None
    err = predicted.comm_fraction - measured.comm_fraction
    if abs(err) <= max_error:
        return None
    p, m = predicted, measured
    fraction = Difference(
        "comm fraction", m.comm_fraction, p.comm_fraction, detail=f"error {err:+.3f}, allowed {max_error:g}"
    )
    times = (
        f"T_iter: obtained {m.t_iter * 1e3:.1f} ms, expected {p.t_iter * 1e3:.1f} ms; "
        f"T_comm: obtained {m.t_comm * 1e3:.1f} ms, expected {p.t_comm * 1e3:.1f} ms"
    )
    return Finding(
        kind="time",
        fail=True,
        title="the iteration-time model misses the measured communication fraction",
        differences=(fraction,),
        notes=(times,),
        hint="recalibrate on other scenarios (commgate calibrate REPORT), or raise expectations.time.max_error",
    )


def evaluate(
    e: Expectations,
    paper: Sequence[TermComparison],
    capture: Capture,
    rec: Reconciliation,
    now: Baseline,
    stored: Baseline | None,
    update_flag: str = UPDATE_FLAG,
    rerun: Rerun | None = None,
) -> Verdict:
    v = Verdict()
    checks = (against_model(e, rec), against_paper(e, paper)) if e.model_check else (unchecked(e),)
    emulated = capture.ranks is not None  # rank 0 alone: its calls complete at once, no latencies
    for f in (*checks, None if emulated else cold_start(e, capture)):
        if f is not None:
            v.findings.append(f)
    if stored is not None:
        v.findings += against_baseline(e, now, stored, update_flag, steps=capture.steps)
        if emulated:
            v.latency_note = (
                f"latency not judged: an emulated run (rank 0 of {capture.world_size}), whose calls complete "
                "without a peer"
            )
        elif sizes := _sizes(now, stored):
            v.latency_note = (
                f"latency not judged: the baseline's runs were of world size {sizes[0]}, this run's is {sizes[1]}"
            )
        else:
            latency, v.latency_note = against_latency(e, now, stored, rerun, update_flag)
            if latency is not None:
                v.findings.append(latency)
    if not emulated and (slow := slow_start_text(slow_starts(capture, e.cold_start))):
        v.latency_note = f"{v.latency_note}; {slow}" if v.latency_note else slow
    return v


def settle_baseline(
    v: Verdict,
    now: Baseline,
    stored: Baseline | None,
    store: BaselineStore,
    *,
    update: bool,
    refresh_latency: bool = False,
    update_flag: str = UPDATE_FLAG,
) -> tuple[list[Finding], str | None]:
    """The baseline policy. A missing baseline is written and the test fails (nothing passes silently);
    with ``update`` a baseline whose communication changed is rewritten (this machine's latency history
    restarting with this run, other machines' kept) and what changed is reported instead of failing, one
    whose communication did not is left as it is, so that ``git diff`` shows only real changes, unless
    ``refresh_latency`` asks to add this run to this machine's latency history; a run that fails the
    model or the paper is never stored. Without ``update``, a run whose communication differs from the
    baseline leaves what it sent beside it (``BaselineStore.save_obtained``: copying it over the baseline
    accepts it, as ``update`` would) and its finding names the file; any other run removes a stale one.
    Returns the findings that stand and, when a file was written or left alone, a line saying so."""
    path = store.path(now.backend, now.scenario)
    if stored is not None and not update:
        return _obtained(v.findings, now, stored, store), None
    store.discard_obtained(now.backend, now.scenario)
    changed = [f for f in v.findings if f.kind in ("baseline", "latency")]
    findings = [f for f in v.findings if f.kind not in ("baseline", "latency")]
    if any(f.fail for f in findings):
        return findings, None
    communication = [f for f in changed if f.kind == "baseline"]
    if stored is not None and not communication and not refresh_latency:
        kept = f"; latency history kept ({refresh_flags(update_flag)} adds this run)" if changed else ""
        return findings, f"{path} left as it is: communication unchanged{kept}"
    store.save(_accepted(now, stored, refresh=not communication))
    if stored is None:
        if not update:
            findings.append(
                Finding(
                    kind="baseline",
                    fail=True,
                    title=f"no baseline yet: wrote {path}",
                    hint="rerun to compare against it",
                )
            )
        return findings, f"{path} written"
    if changed:
        return findings, f"{path} updated: " + "; ".join(line for f in changed for line in f.lines[:3])
    return findings, f"{path} rewritten: this run added to the latency history"


def _accepted(now: Baseline, stored: Baseline | None, *, refresh: bool) -> Baseline:
    """What accepting this run stores: with the same communication (``refresh``) this run joins the
    latency history; with other traffic this machine's history restarts with it (other machines' kept)."""
    if stored is None:
        return now
    if refresh:
        return now.with_history(stored)
    return replace(now, latency={**stored.latency, **now.latency})


def _obtained(findings: list[Finding], now: Baseline, stored: Baseline, store: BaselineStore) -> list[Finding]:
    """``findings``, the communication difference's naming the obtained file it left (what accepting the
    run would store); without such a difference, a stale obtained file removed."""
    if not any(f.kind == "baseline" and f.fail for f in findings):
        store.discard_obtained(now.backend, now.scenario)
        return findings
    obtained = store.save_obtained(_accepted(now, stored, refresh=False))
    accept = f"; or copy {obtained} over {store.path(now.backend, now.scenario)}"
    return [replace(f, hint=f.hint + accept) if f.kind == "baseline" and f.fail else f for f in findings]


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    findings: tuple[Finding, ...]
    baseline: Path
    """The baseline file this run was judged against (or wrote)."""
    written: str | None
    """A line saying what was written to the baseline, if anything."""
    latency_note: str = ""
    """How latency was judged, or why it was not."""

    @property
    def failed(self) -> bool:
        return any(f.fail for f in self.findings)


def judge(
    e: Expectations,
    paper: Sequence[TermComparison],
    capture: Capture,
    rec: Reconciliation,
    store: BaselineStore,
    *,
    update: bool = False,
    update_flag: str = UPDATE_FLAG,
    refresh_latency: bool = False,
    rerun: Rerun | None = None,
) -> Judgement:
    """The whole gate for one run (the pytest plugin's and ``commgate run --gate``'s): the baseline of the
    capture's scenario and backend from ``store``, the verdict, and the baseline policy
    (``settle_baseline``). A failure names ``update_flag`` as the way to accept a change; ``rerun`` runs
    the scenario again to confirm a latency slowdown."""
    now = Baseline.from_run(capture, rec, provenance(capture, capture.world_size))
    # updating: the baseline read is the one written back to, whatever another run does meanwhile
    with store.only_writer(capture.backend) if update else contextlib.nullcontext():
        stored = store.load(capture.backend, capture.scenario)
        verdict = evaluate(e, paper, capture, rec, now, stored, update_flag, rerun)
        findings, written = settle_baseline(
            verdict, now, stored, store, update=update, refresh_latency=refresh_latency, update_flag=update_flag
        )
    return Judgement(
        findings=tuple(findings),
        baseline=store.path(capture.backend, capture.scenario),
        written=written,
        latency_note=verdict.latency_note,
    )
