"""Baselines (load, validate, migrate, compare, write) and drift statistics, on committed JSON fixtures
and synthetic captures: no ranks started here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from commgate.judge import baseline as bl
from commgate.judge.drift import MEASURE, RunLatency, cold_starts, shifts, spread, summarize
from commgate.model.collectives import Op
from commgate.model.scenario import ColdStartRule, LatencyRule, Scenario, Tolerance
from commgate.run.capture import Capture, CapturedCall, StepWindow

DATA = Path(__file__).parent / "data" / "baselines"
EXACT = Tolerance()


def test_a_baseline_round_trips_canonically() -> None:
    b = bl.load(DATA / "ddp.json")
    assert b.scenario == "ddp-19m-dp4" and b.backend == "gloo" and b.provenance["world_size"] == 4
    assert json.dumps(b.to_json(), sort_keys=True, indent=2) + "\n" == (DATA / "ddp.json").read_text()


def test_compare_names_every_difference_with_obtained_expected_and_delta() -> None:
    stored, now = bl.load(DATA / "ddp.json"), bl.load(DATA / "ddp-split-bucket.json")
    assert bl.compare(stored, stored, bytes_tol=EXACT, calls_tol=EXACT) == []
    diffs = [d.text() for d in bl.compare(now, stored, bytes_tol=EXACT, calls_tol=EXACT)]
    assert diffs == [
        "calls [steps] all_reduce fp32 1061888 B backward group [0, 1, 2, 3]: obtained 0, expected 12 (-12)",
        "calls [steps] all_reduce fp32 530432 B backward group [0, 1, 2, 3]: obtained 12, expected 0 (+12)",
        "calls [steps] all_reduce fp32 531456 B backward group [0, 1, 2, 3]: obtained 12, expected 0 (+12)",
    ]
    assert bl.compare(now, stored, bytes_tol=EXACT, calls_tol=Tolerance(atol=12)) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "truncated.json",
            r"truncated\.json:\d+: \$: not valid JSON \(.*\); delete it: the next gated run \(pytest, commgate run "
            r"--gate, commgate check\) writes it anew$",
        ),
        (
            "newer.json",
            r"newer\.json: \$\.schema_version: 3 is newer than this commgate reads \(2\); upgrade commgate$",
        ),
        (  # the schema's refusal gets the fix too (it had none: found by an adversarial pass)
            "negative-calls.json",
            r"negative-calls\.json: \$\.calls\[0\]\.calls: -1 is less than the minimum of 1; delete it: the next "
            r"gated run \(pytest, commgate run --gate, commgate check\) writes it anew$",
        ),
    ],
)
def test_a_bad_baseline_is_a_one_line_error_naming_the_file(name: str, message: str) -> None:
    with pytest.raises(bl.BaselineError, match=message) as info:
        bl.load(DATA / name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("version", "said"), [(0, "0 has no migration to 2"), ('"2"', "'2' is not a baseline schema version")]
)
def test_a_baseline_no_migration_reads_gets_the_fix_too(tmp_path: Path, version: object, said: str) -> None:
    """A failed migration is the file's fault as a field the schema refuses is: delete it (only a newer
    commgate's file is upgrade's, and one that cannot be read neither's)."""
    doc = json.loads((DATA / "ddp.json").read_text())
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc).replace('"schema_version": 2', f'"schema_version": {version}', 1))
    with pytest.raises(bl.BaselineError) as info:
        bl.load(path)
    assert str(info.value) == (
        f"{path}: $.schema_version: {said}; delete it: the next gated run (pytest, commgate run --gate, commgate "
        "check) writes it anew"
    )


def test_older_versions_are_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads((DATA / "ddp-v1.json").read_text())
    old = {k: v for k, v in doc.items() if k != "histogram"} | {"schema_version": 0}
    with pytest.raises(bl.BaselineError, match=r"\$\.schema_version: 0 has no migration to 2"):
        bl.migrate(dict(old))
    monkeypatch.setitem(bl.MIGRATIONS, 0, lambda d: d | {"schema_version": 1, "histogram": {}})
    assert bl.migrate(dict(old))["histogram"] == {}


def test_version_1_keeps_its_volumes_and_starts_an_empty_latency_history() -> None:
    """Version 1 pooled every call's duration: no run can be told from another, so no history."""
    v1, v2 = bl.load(DATA / "ddp-v1.json"), bl.load(DATA / "ddp.json")
    assert json.loads((DATA / "ddp-v1.json").read_text())["latency"]  # it had samples
    assert v1.latency == {} and len(v2.latency[v2.provenance["hardware"]]) == 3
    assert (v1.calls, v1.bytes_per_step, v1.histogram) == (v2.calls, v2.bytes_per_step, v2.histogram)


def test_a_failed_write_leaves_the_old_baseline_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gloo" / "x.json"
    bl.write(path, bl.load(DATA / "ddp.json"))
    before = path.read_text()

    def boom(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    from commgate.core.errors import WriteError

    with pytest.raises(WriteError, match="disk full"):  # one line naming the path, and no partial file
        bl.write(path, bl.load(DATA / "ddp-split-bucket.json"))
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_fractions_are_stored_exactly() -> None:
    assert bl.exact(Fraction(4, 3)) == "4/3" and bl.exact(Fraction(6, 3)) == 2
    b = bl.load(DATA / "ddp.json")
    assert bl.Baseline.from_json(json.loads(json.dumps(b.to_json()))) == b


def _run(
    all_reduce: float, broadcast: float = 6.0, compute: float = 10.0, step: float = 100.0, floor: float | None = None
) -> RunLatency:
    """One run: ms per step in two ops (three steps alike), the compute and step times per step; each op one
    call a step whose floor is its time (the all-reduce's ``floor`` where given)."""
    ms = 1_000_000
    ar, bc = ("all_reduce", "group 0,1", 4096, "backward"), ("broadcast", "group 0,1", 8, "forward")
    return RunLatency(
        keys={ar: (int(all_reduce * ms),) * 3, bc: (int(broadcast * ms),) * 3},
        compute=(int(compute * ms),) * 3,
        step=(int(step * ms),) * 3,
        floor={ar: int((all_reduce if floor is None else floor) * ms), bc: int(broadcast * ms)},
        measure=MEASURE,
    )


def _verdicts(now: list[RunLatency], base: list[RunLatency], rule: LatencyRule | None = None) -> dict[str, str]:
    return {s.op: s.verdict for s in shifts(now, base, rule or LatencyRule()).shifts}


BASE = [_run(10.0), _run(11.0), _run(10.5)]


def test_latency_is_judged_on_runs_only_with_enough_stored_runs() -> None:
    a = shifts([_run(100.0)], BASE[:2], LatencyRule())
    assert a.shifts == () and a.note == "latency not judged: 2 run(s) to compare with, 3 needed"
    assert _verdicts([_run(100.0)], BASE[:2], LatencyRule(min_runs=2)) == {"all_reduce": "slower", "broadcast": "~"}


def test_a_slowdown_counts_beyond_the_factor_or_the_stored_runs_own_reach_from_their_median() -> None:
    assert spread(BASE, "all_reduce") == (pytest.approx(11 / 10.5), pytest.approx(10.5 / 10))
    assert _verdicts([_run(12.0)], BASE) == {"all_reduce": "~", "broadcast": "~"}  # x1.14 < 1.75
    assert _verdicts([_run(21.0)], BASE) == {"all_reduce": "slower", "broadcast": "~"}  # x2
    assert _verdicts([_run(5.0)], BASE) == {"all_reduce": "faster", "broadcast": "~"}
    noisy = [_run(10.0), _run(30.0), _run(15.0)]  # this machine itself reaches x2 above the median, x1.5 below
    assert spread(noisy, "all_reduce") == (pytest.approx(2.0), pytest.approx(1.5))
    assert _verdicts([_run(29.0)], noisy)["all_reduce"] == "~"  # x1.93: within what it does
    assert _verdicts([_run(31.0)], noisy)["all_reduce"] == "slower"  # x2.07
    assert _verdicts([_run(8.0)], noisy)["all_reduce"] == "faster"  # x0.53: below the factor's x1/1.75


def test_the_floor_is_judged_and_the_time_per_step_shown_beside_it() -> None:
    """A time per step x3 whose fastest calls are as before (every call waited for a core) is not slower; a
    floor x2 is, whatever the time per step (what a slower collective does to its fastest calls)."""
    (crowded,) = [s for s in shifts([_run(30.0, floor=10.5)], BASE, LatencyRule()).shifts if s.op == "all_reduce"]
    assert crowded.verdict == "~" and crowded.time_ratio == pytest.approx(30 / 10.5) and crowded.ratio == 1.0
    (slow,) = [s for s in shifts([_run(10.5, floor=21.0)], BASE, LatencyRule()).shifts if s.op == "all_reduce"]
    assert slow.verdict == "slower" and slow.time_ratio == 1.0 and slow.ratio == pytest.approx(2.0)


def test_each_op_counts_beyond_its_own_spread_a_noisy_small_op_raises_no_others_threshold() -> None:
    """On a busy machine a 6 ms broadcast moved x10 between three unchanged runs while the all-reduce held
    within x1.1: the broadcast's spread is its own threshold, not the all-reduce's, so a x3 all-reduce is
    still slower (one threshold for all ops let the broadcast hide it: tests/plugin/test_fault.py under a
    CPU hog)."""
    base = [_run(10.0, broadcast=1.0), _run(11.0, broadcast=10.0), _run(10.5, broadcast=3.0)]
    rule = LatencyRule(min_share=0)
    assert spread(base, "broadcast") == (pytest.approx(10 / 3), pytest.approx(3.0))
    a = shifts([_run(31.0, broadcast=3.0)], base, rule)
    assert {s.op: (s.verdict, s.threshold) for s in a.shifts} == {
        "all_reduce": ("slower", 1.75),
        "broadcast": ("~", pytest.approx(10 / 3)),
    }
    assert _verdicts([_run(10.0, broadcast=9.0)], base, rule)["broadcast"] == "~"  # x3: within its own x3.33
    assert _verdicts([_run(10.0, broadcast=11.0)], base, rule)["broadcast"] == "slower"  # x3.67


def test_an_op_under_min_share_of_the_step_is_not_judged_until_it_grows_into_the_step() -> None:
    """A broadcast of 1 ms in a 100 ms step is scheduling noise on a shared machine, whatever its ratio while
    it stays small (x2.5: 2.5 ms, under min_share of the step now too); where its floor is min_share of the
    step or more in every run now, it has grown into the step and is judged."""
    base = [_run(10.0, broadcast=1.0), _run(11.0, broadcast=1.0), _run(10.5, broadcast=1.0)]
    a = shifts([_run(10.0, broadcast=2.5)], base, LatencyRule())
    assert {s.op: s.verdict for s in a.shifts} == {"all_reduce": "~"} and a.unjudged == 1
    assert "1 too small a share of the step to judge (under min_share, or a floor under 1% of it)" in a.summary()
    assert _verdicts([_run(10.0, broadcast=2.5)], base, LatencyRule(min_share=0))["broadcast"] == "slower"
    assert _verdicts([_run(10.0, broadcast=9.0)], base) == {"all_reduce": "~", "broadcast": "slower"}
    assert _verdicts([_run(10.0, broadcast=9.0), _run(10.0, broadcast=2.5)], base) == {"all_reduce": "~"}


def test_an_op_whose_floor_was_a_sliver_of_the_step_is_judged_once_its_floor_fills_it() -> None:
    """Found by an adversarial pass: a broadcast taking 8.7 ms of an 81 ms step in the stored runs, its floor
    0.57 ms (under 1% of the step, so not judged), made 50 times slower (``--commgate-fault
    slow=broadcast:50``): its floor became 4.9 s of a 14.9 s step, and the gate passed under ``action: fail``."""
    ms, bc = 1_000_000, ("broadcast", "group 0,1", 8, "forward")

    def run(broadcast: float, floor: float, step: float) -> RunLatency:
        r = _run(10.0, broadcast=broadcast, step=step)
        return replace(r, floor=r.floor | {bc: int(floor * ms)})

    base = [run(8.7, 0.57, 81.0), run(8.5, 0.55, 80.0), run(8.9, 0.58, 82.0)]
    assert shifts([run(8.8, 0.56, 81.0)], base, LatencyRule()).unjudged == 1
    (shift,) = [s for s in shifts([run(14766.0, 4921.8, 14885.3)], base, LatencyRule()).shifts if s.op == "broadcast"]
    assert shift.verdict == "slower" and shift.ratio > 1000


def test_every_run_must_be_slower_and_only_a_whole_machine_drift_is_excused() -> None:
    assert _verdicts([_run(21.0), _run(10.4)], BASE)["all_reduce"] == "~"  # one run only: not confirmed
    assert _verdicts([_run(21.0), _run(22.0)], BASE)["all_reduce"] == "slower"
    # compute x2 but the other collective as before: the collective itself (its calls overlap compute)
    (shift,) = [s for s in shifts([_run(21.0, compute=20.0)], BASE, LatencyRule()).shifts if s.op == "all_reduce"]
    assert shift.verdict == "slower" and "; the run's compute x2.00" in shift.text()
    # compute and the other collective x2 as well: the whole machine ran slower, that much is excused
    assert _verdicts([_run(21.0, broadcast=12.0, compute=20.0)], BASE)["all_reduce"] == "~"
    assert _verdicts([_run(42.0, broadcast=12.0, compute=20.0)], BASE)["all_reduce"] == "slower"
    assert _verdicts([_run(10.0, compute=5.0)], BASE)["all_reduce"] == "~"
    # the scenario's only collective: the compute ratio alone says how much the machine drifted
    only = [replace(r, keys={k: v for k, v in r.keys.items() if k[0] == "all_reduce"}) for r in BASE]
    now = replace(_run(21.0, compute=20.0), keys={k: v for k, v in _run(21.0).keys.items() if k[0] == "all_reduce"})
    assert _verdicts([now], only) == {"all_reduce": "~"}
    (shift,) = [s for s in shifts([_run(21.0)], BASE, LatencyRule()).shifts if s.verdict != "~"]
    assert shift.text() == (
        "latency slower: all_reduce floor per step x2.00 in each of 1 run(s) vs 3 reference run(s) (counts beyond "
        "x1.75; time per step x2.00): all_reduce group 0,1 4096 B backward x2.00"
    )


def _capture(ms_per_call: float, compute_ms: float = 10.0) -> Capture:
    """Two ranks, one warm-up and three measured steps, one all_reduce per step taking ``ms_per_call``."""
    ms = 1_000_000
    calls, windows = [], []
    for rank in (0, 1):
        t = 0
        for step in range(4):
            start = t
            call = _call(rank, step, step, int(ms_per_call * ms))
            calls.append(replace(call, op=Op.ALL_REDUCE, phase="backward", peer=None, start_ns=t))
            t += int((ms_per_call + compute_ms) * ms)
            windows.append(StepWindow(rank=rank, step=step, start_ns=start, end_ns=t))
    return Capture(
        scenario="s",
        world_size=2,
        warmup_steps=1,
        steps=3,
        backend="gloo",
        calls=tuple(calls),
        step_windows=tuple(windows),
    )


def test_a_run_is_summarised_per_measured_step_with_its_compute_time() -> None:
    run = summarize(_capture(4.0, compute_ms=6.0))
    assert run.keys == {("all_reduce", "group 0,1", 4096, "backward"): (4_000_000,) * 3}
    assert run.compute == (6_000_000,) * 3 and run.op_time("all_reduce") == 4_000_000
    assert run.op_floor("all_reduce") == 4_000_000 and run.measure == MEASURE


def _call(rank: int, step: int, seq: int, ns: int) -> CapturedCall:
    return CapturedCall(
        rank=rank,
        seq=seq,
        step=step,
        phase="pipeline",
        op="recv",
        group=(0, 1),
        peer=1 - rank,
        dtype="fp32",
        elements=1024,
        bytes=4096,
        tensors=1,
        start_ns=0,
        duration_ns=ns,
    )


def test_a_cold_start_spike_names_rank_op_peer_size_and_ratio() -> None:
    calls = [_call(0, 0, 0, 900_000_000)] + [_call(0, k, k, 1_000_000) for k in (1, 2, 3)]
    cap = Capture(scenario="s", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls))
    (spike,) = cold_starts(cap, ColdStartRule(factor=10, min_excess_ms=100))
    assert (
        spike.text() == "cold-start spike: rank 0 recv peer 1 4096 B took 900.0 ms in step 0 vs 1.00 ms steady (900x)"
    )
    assert cold_starts(cap, ColdStartRule(factor=10, min_excess_ms=1000)) == []  # not slow enough in absolute terms
    assert cold_starts(cap, ColdStartRule(factor=1000, min_excess_ms=0)) == []  # nor relatively


def _p2p(rank: int, op: str, step: int, seq: int, start_ms: float, ms: float) -> CapturedCall:
    """A 4 KiB send or recv between ranks 0 and 1, issued at ``start_ms`` on its rank's clock."""
    return replace(_call(rank, step, seq, int(ms * 1e6)), op=Op(op), start_ns=int(start_ms * 1e6))


def _pipeline(first_recv_ms: float, send_late_ms: float) -> Capture:
    """Rank 1 sends rank 0 one activation a step; step 0 is the warm-up. Rank 0's first recv takes
    ``first_recv_ms``; rank 1 issues its send ``send_late_ms`` after rank 0 issued the recv (its first
    forward, say), and the send completes with the recv. Later steps: 1 ms each, both sides on time.
    Rank 1's clock origin is 5 s before rank 0's, on one host (its calls' times are 5 s later)."""
    from commgate.run.capture import RankClock

    calls = [
        _p2p(0, "recv", 0, 0, 100.0, first_recv_ms),
        _p2p(1, "send", 0, 0, 5100.0 + send_late_ms, first_recv_ms - send_late_ms),
    ]
    for k in (1, 2, 3):
        calls += [_p2p(0, "recv", k, k, 100.0 + 2000.0 * k, 1.0), _p2p(1, "send", k, k, 5100.0 + 2000.0 * k, 1.0)]
    clocks = (
        RankClock(rank=0, host="h", monotonic_ns=10**12, wall_ns=0),
        RankClock(rank=1, host="h", monotonic_ns=10**12 - 5 * 10**9, wall_ns=0),
    )
    return Capture(
        scenario="p", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls), clocks=clocks
    )


def test_a_first_recv_that_waited_for_a_late_sender_is_a_slow_start_not_a_cold_link() -> None:
    """The ranks' clocks tell the two apart: rank 0's first recv took 900 ms because rank 1 issued its
    send 890 ms later (a slow first forward): no spike. Without the clocks the same calls are a spike."""
    rule = ColdStartRule(factor=10, min_excess_ms=100)
    late_sender = _pipeline(first_recv_ms=900.0, send_late_ms=890.0)
    assert cold_starts(late_sender, rule) == []
    (spike,) = cold_starts(replace(late_sender, clocks=()), rule)
    assert (spike.rank, spike.op, spike.first_ms, spike.waited_ms) == (0, "recv", 900.0, None)


def test_a_link_slow_once_both_sides_issued_is_one_cold_start_for_the_pair() -> None:
    """Rank 1 issued its send 10 ms after the recv and both then took 890 ms more: a cold link (the
    cold-cache recv of Anthony et al.), flagged once, as the recv, naming the send."""
    (spike,) = cold_starts(
        _pipeline(first_recv_ms=900.0, send_late_ms=10.0), ColdStartRule(factor=10, min_excess_ms=100)
    )
    assert (spike.rank, spike.op, spike.first_ms, spike.waited_ms, spike.partner) == (0, "recv", 890.0, 10.0, 1)
    assert spike.text() == (
        "cold-start spike: rank 0 recv peer 1 4096 B took 890.0 ms in step 0 once every party had issued it "
        "(after waiting 10.0 ms for the last) vs 1.00 ms steady (890x); rank 1's send to it was as slow"
    )


def test_a_collective_that_waited_for_a_late_member_is_not_a_spike() -> None:
    """An all-reduce whose rank 1 issued it 500 ms late: rank 0's 501 ms is waiting (no spike with the
    clocks; without them, the spike names rank 1 as the one that arrived last)."""
    from commgate.run.capture import RankClock

    def ar(rank: int, step: int, start_ms: float, ms: float) -> CapturedCall:
        c = replace(_call(rank, step, step, int(ms * 1e6)), op=Op.ALL_REDUCE, peer=None, start_ns=int(start_ms * 1e6))
        return c

    calls = [ar(0, 0, 0.0, 501.0), ar(1, 0, 500.0, 1.0)]
    calls += [ar(r, k, 1000.0 * k, 1.0) for r in (0, 1) for k in (1, 2, 3)]
    clocks = tuple(RankClock(rank=r, host="h", monotonic_ns=7, wall_ns=0) for r in (0, 1))
    cap = Capture(
        scenario="c", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls), clocks=clocks
    )
    rule = ColdStartRule(factor=10, min_excess_ms=100)
    assert cold_starts(cap, rule) == []
    (spike,) = cold_starts(replace(cap, clocks=()), rule)
    assert (spike.rank, spike.late) == (0, 1)


def test_a_cold_start_on_an_oversubscribed_run_says_what_it_cannot_tell() -> None:
    """On 8 ranks on 2 cores a rank can wait for a core after both sides issued: the finding says so."""
    from commgate.judge.gate import cold_start
    from commgate.model.loader import load_text

    (s,) = load_text("schema_version: 1\nname: p\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    calls = [_call(0, 0, 0, 900_000_000)] + [_call(0, k, k, 1_000_000) for k in (1, 2, 3)]
    cap = Capture(scenario="s", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls))
    quiet = cold_start(s.expectations, cap)
    assert quiet is not None and not any("cores" in n for n in quiet.notes)
    crowded = cold_start(s.expectations, replace(cap, stack={"oversubscribed": "8 ranks on 2 cores"}))
    assert crowded is not None and crowded.notes[-1].startswith(
        "this run had 8 ranks on 2 cores: a rank that waited for a core after both sides issued looks the same"
    )


def test_another_scenarios_baseline_is_a_one_line_error(tmp_path: Path) -> None:
    """A baseline copied or renamed from another scenario's file is not compared with this one's run."""
    stored = bl.load(DATA / "ddp.json")
    assert bl.load(DATA / "ddp.json", scenario=stored.scenario) == stored
    with pytest.raises(
        bl.BaselineError, match=rf"\$\.scenario: '{stored.scenario}' is another scenario's baseline, not 'zero3'"
    ) as info:
        bl.load(DATA / "ddp.json", scenario="zero3")
    assert "\n" not in str(info.value)


def _three_stored_runs_and_a_failing_rule() -> tuple[bl.Baseline, str, Scenario]:
    """The DDP baseline with 3 stored runs of 4 ms all-reduces, its hardware, and the scenario with
    ``latency.action: fail``."""
    from commgate.model.loader import load_text

    stored = bl.load(DATA / "ddp.json")
    hw = stored.provenance["hardware"]
    stored = replace(stored, latency={hw: tuple(summarize(_capture(ms)) for ms in (4.0, 4.2, 4.1))})
    (s,) = load_text(
        "schema_version: 1\nname: ddp-19m-dp4\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 4}\n"
        "expectations: {baseline: {latency: {action: fail}}}\n"
    )
    return stored, hw, s


def test_a_shift_is_confirmed_by_reruns_and_a_speed_up_is_never_a_failure() -> None:
    """With ``latency.action: fail`` a slower op fails the gate only if the reruns are slower too; one
    that got faster (in the reruns too) is reported as a warning only."""
    from commgate.judge.gate import against_latency

    stored, hw, s = _three_stored_runs_and_a_failing_rule()
    reruns: list[float] = []

    def rerun(ms: float) -> Capture:
        reruns.append(ms)
        return _capture(ms)

    def judged(now_ms: float, rerun_ms: float) -> tuple[object, str]:
        now = replace(stored, latency={hw: (summarize(_capture(now_ms)),)})
        return against_latency(s.expectations, now, stored, lambda: rerun(rerun_ms))

    finding, note = judged(12.0, 12.0)
    assert finding is not None and finding.fail and reruns == [12.0, 12.0]  # type: ignore[attr-defined]
    assert note == (  # it said "no latency shift beyond x1.75 in 0 op(s)" beside the shift's finding
        "latency judged against 3 stored run(s) and 2 confirming rerun(s): 1 op(s) shifted beyond x1.75 "
        "(all_reduce slower), 0 unchanged"
    )
    reruns.clear()
    finding, _ = judged(12.0, 4.1)  # the first rerun is back to normal: a one-off, not a regression
    assert finding is None and reruns == [4.1]
    reruns.clear()
    finding, _ = judged(1.0, 1.0)  # faster, and so were both reruns: reported, not a failure
    assert finding is not None and not finding.fail and reruns == [1.0, 1.0]  # type: ignore[attr-defined]
    assert "latency faster: all_reduce" in finding.lines[0]  # type: ignore[attr-defined]
    reruns.clear()
    assert judged(1.0, 4.0)[0] is None and reruns == [4.0]  # a one-off speed-up is not reported either


def test_a_report_with_cold_starts_is_valid_and_compares(tmp_path: Path) -> None:
    """A cold start names the late rank and whether its steady time is estimated: the report schema
    holds both (a report with a spike once failed validation, so `commgate compare` refused it)."""
    from commgate.cli import main
    from commgate.model.loader import load_text
    from commgate.model.predict import predict
    from commgate.report.report import Report, ScenarioResult, validate

    calls = [_call(r, 0, 0, 900_000_000 if r == 0 else 1_000) for r in (0, 1)]
    calls += [_call(r, k, k, 1_000_000) for r in (0, 1) for k in (1, 2, 3)]
    cap = Capture(scenario="p", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls))
    (s,) = load_text("schema_version: 1\nname: p\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    doc = ScenarioResult(prediction=predict(s), status="passed", capture=cap).document()
    assert doc["cold_starts"] and {"expected", "late"} <= set(doc["cold_starts"][0])
    from commgate.judge.reconcile import reconcile

    report = Report(tmp_path / "report.json")
    rec = reconcile(predict(s), cap)  # its calls: what compare compares
    result = ScenarioResult(prediction=predict(s), status="passed", capture=cap, reconciliation=rec)
    report.add(result)
    validate(json.loads((tmp_path / "report.json").read_text()))
    # not judged (no --gate, so no finding): the console says so, as the HTML's markers do
    assert "    not judged (run with --gate to judge): cold-start spike: rank 0 recv peer 1 4096 B" in result.summary()
    assert main(["compare", str(tmp_path / "report.json"), str(tmp_path / "report.json")]) == 0


def test_a_shift_is_judged_on_the_floor_and_an_older_history_does_not_count() -> None:
    """An op is slower only where its floor per step (its calls' fastest decile) moved beyond the threshold:
    a run whose calls the scheduler slowed, all but the fastest, passes (on a 2-core machine, with its calls'
    time alone, 7 of 10 unchanged suite runs had a latency warning); a run whose every call is 3x slower
    fails, its time per step shown beside. Stored runs measured otherwise (an earlier version's, whose times
    counted the waits for late peers or for the calls queued before) do not count, and the note says so."""
    from commgate.judge.gate import evaluate
    from commgate.judge.reconcile import reconcile
    from commgate.model.predict import predict

    stored, hw, s = _three_stored_runs_and_a_failing_rule()
    e, paper = s.expectations, predict(s).comparison()

    def judged(cap: Capture, base: bl.Baseline = stored) -> tuple[list[object], str]:
        cap = replace(cap, stack={"hardware": hw})
        now = replace(base, latency={hw: (summarize(cap),)})
        v = evaluate(e, paper, cap, reconcile(predict(s), cap), now, base, rerun=lambda: cap)
        return [f for f in v.findings if f.kind == "latency"], v.latency_note

    noisy = _capture(12.0)  # every call 12 ms but one per rank, as fast as before: the scheduler's delays
    fast = {c.seq for c in noisy.calls if c.step == 2}
    noisy = replace(noisy, calls=tuple(replace(c, duration_ns=4_000_000) if c.seq in fast else c for c in noisy.calls))
    latency, note = judged(noisy)
    assert not latency and note.startswith("latency judged against 3 stored run(s)")
    latency, _ = judged(_capture(12.0))
    assert latency and latency[0].fail  # type: ignore[attr-defined]
    assert "latency slower: all_reduce floor per step x2.9" in latency[0].lines[0]  # type: ignore[attr-defined]
    assert "time per step x2.9" in latency[0].lines[0]  # type: ignore[attr-defined]
    for measure in ("", "own", "service"):  # before last-party alignment, queues, gloo's two workers
        older = replace(stored, latency={hw: tuple(replace(r, measure=measure) for r in stored.latency[hw])})
        latency, note = judged(_capture(12.0), older)
        assert not latency and note.startswith(
            "latency not judged: 0 run(s) measured by this version (3 stored by an earlier one counted other "
            "waits) to compare with, 3 needed"
        )


def test_a_calls_time_counts_from_when_its_last_party_issued_it() -> None:
    """With the ranks' clocks, a call's time is its own: an all-reduce rank 1 issued 500 ms after rank 0
    costs rank 0 1 ms, not 501 (the wait was rank 1's compute); a broadcast's receivers wait for its root
    alone, and the root, which sent at once, for nobody."""
    from commgate.run.capture import RankClock

    def call(rank: int, step: int, op: Op, start_ms: float, ms: float, root: int | None = None) -> CapturedCall:
        c = replace(_call(rank, step, 2 * step + (op is Op.BROADCAST), int(ms * 1e6)), op=op, peer=None, root=root)
        return replace(c, start_ns=int(start_ms * 1e6), phase="forward")

    calls = []
    for k in range(4):
        t0 = 1000.0 * k
        calls += [call(0, k, Op.ALL_REDUCE, t0, 501.0), call(1, k, Op.ALL_REDUCE, t0 + 500.0, 1.0)]
        # rank 1, the root, issues its broadcast 200 ms after rank 0 and is done in 1 ms; rank 0 waits 202 ms
        calls += [
            call(0, k, Op.BROADCAST, t0 + 600.0, 202.0, root=1),
            call(1, k, Op.BROADCAST, t0 + 800.0, 1.0, root=1),
        ]
    clocks = tuple(RankClock(rank=r, host="h", monotonic_ns=7, wall_ns=0) for r in (0, 1))
    cap = Capture(
        scenario="c", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls), clocks=clocks
    )
    run = summarize(cap)
    assert run.op_time("all_reduce") == run.op_floor("all_reduce") == 1_000_000
    assert (run.op_time("broadcast"), run.op_floor("broadcast")) == (1_500_000, 1_000_000)  # ranks' 2 ms and 1 ms
    unaligned = summarize(replace(cap, clocks=()))  # without clocks: from each call's issue, as before
    assert unaligned.op_time("all_reduce") == 251_000_000


@pytest.mark.parametrize(
    ("backend", "ends_ms"),
    [("nccl", (10.0, 20.0, 30.0, 40.0)), ("gloo", (10.0, 10.01, 20.0, 20.01))],
    ids=["one stream", "two gloo workers"],
)
def test_a_queued_calls_time_counts_from_when_a_worker_of_its_group_was_free(
    backend: str, ends_ms: tuple[float, ...]
) -> None:
    """ZeRO-3 prefetches: four all-gathers issued together, each taking 10 ms, complete 10, 20, 30 and 40 ms
    after their issue on NCCL's one stream, or two at a time on gloo's two worker threads. Each costs 10 ms,
    not its time from its issue (a planted 2x all-gather made that sum *fall*: held before it is posted,
    each call queued behind fewer), nor its time from the completion of the call before it where two ran at
    once (gloo's floor fell into two clusters); a send issued meanwhile is not queued behind them."""

    def call(rank: int, step: int, seq: int, op: Op, start_ms: float, end_ms: float) -> CapturedCall:
        c = replace(_call(rank, step, seq, round((end_ms - start_ms) * 1e6)), op=op, start_ns=round(start_ms * 1e6))
        return replace(c, peer=None, phase="forward") if op is not Op.SEND else replace(c, peer=1 - rank)

    calls = []
    for rank in (0, 1):
        for k in range(4):
            t0 = 100.0 * k
            calls += [call(rank, k, 5 * k + i, Op.ALL_GATHER, t0 + i * 0.01, t0 + e) for i, e in enumerate(ends_ms)]
            calls.append(call(rank, k, 5 * k + 4, Op.SEND, t0 + 0.5, t0 + 2.5))
    cap = Capture(scenario="q", world_size=2, warmup_steps=1, steps=3, backend=backend, calls=tuple(calls))
    run = summarize(cap)
    assert run.op_time("all_gather") == pytest.approx(40e6, rel=1e-3)  # 4 x 10 ms
    assert run.op_floor("all_gather") == pytest.approx(40e6, rel=1e-3)
    assert run.op_time("send") == 2_000_000


def test_a_runs_floor_survives_the_baseline_file() -> None:
    """The floors and how the run was measured are stored with the run (``floor_ns`` per key, ``measure``) and
    read back; a file without them loads."""
    stored, hw, _ = _three_stored_runs_and_a_failing_rule()
    doc = stored.to_json()
    bl.validate(doc)
    again = bl.Baseline.from_json(doc)
    assert again.latency[hw] == stored.latency[hw] and again.latency[hw][0].floor
    assert doc["latency"][hw][0]["measure"] == MEASURE == again.latency[hw][0].measure
    for run in doc["latency"][hw]:
        del run["measure"]
        for key in run["keys"]:
            del key["floor_ns"]
    bl.validate(doc)
    assert bl.Baseline.from_json(doc).latency[hw][0].floor == {}
    assert bl.Baseline.from_json(doc).latency[hw][0].measure == ""


@pytest.mark.parametrize(
    ("update_flag", "refresh"),
    [
        ("--commgate-update-baselines", "--commgate-update-baselines --commgate-refresh-latency"),
        ("--update-baselines", "--update-baselines --refresh-latency"),
    ],
    ids=["pytest", "commgate-run"],
)
def test_the_note_on_too_few_stored_runs_names_the_flags_of_the_entry_point(update_flag: str, refresh: str) -> None:
    """``commgate run --gate`` said "--commgate-refresh-latency adds one", which that command rejects, and
    under pytest the flag alone is refused without --commgate-update-baselines (found by a newcomer's
    walkthrough): the note names both flags, as the entry point that ran spells them."""
    from commgate.judge.gate import against_latency

    stored, hw, s = _three_stored_runs_and_a_failing_rule()
    one = replace(stored, latency={hw: stored.latency[hw][:1]})
    now = replace(stored, latency={hw: (summarize(_capture(4.0)),)})
    finding, note = against_latency(s.expectations, now, one, None, update_flag)
    assert finding is None
    assert note == f"latency not judged: 1 run(s) to compare with, 3 needed (stored runs; {refresh} adds one)"


def _edited(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = json.loads((DATA / "ddp.json").read_text())
    edit(doc)
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(doc))
    return path


def _first(d: dict[str, Any]) -> str:
    return next(iter(d))


@pytest.mark.parametrize(
    ("edit", "where", "says"),
    [
        (lambda d: d["bytes_per_step"].update({_first(d["bytes_per_step"]): "1/0"}), r"\$\.bytes_per_step\.\w+", "1/0"),
        (lambda d: d["histogram"].update({_first(d["histogram"]): "0/0"}), r"\$\.histogram\.\d+", "0/0"),
        (lambda d: d["bytes_per_step"].update({_first(d["bytes_per_step"]): 10**400}), r"\$\.bytes_per_step", "1000"),
        (lambda d: d["calls"].insert(0, d["calls"][0] | {"calls": 99}), r"\$\.calls\[1\]", "listed twice"),
    ],
    ids=["zero-denominator", "zero-over-zero", "huge", "call-twice"],
)
def test_a_hand_edited_baseline_is_a_one_line_error_not_a_crash_or_a_silent_choice(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], where: str, says: str
) -> None:
    """A baseline fraction "1/0" (the pattern allowed it) was a ZeroDivisionError in compare, ``run --gate``
    and pytest; 10**400 an OverflowError; a call listed twice was read as its last entry, and compare said
    "the same" (found by an adversarial pass)."""
    path = _edited(tmp_path, edit)
    with pytest.raises(bl.BaselineError, match=rf"ddp\.json: {where}.*{says}") as info:
        bl.load(path)
    assert "\n" not in str(info.value)


def test_runs_with_no_measured_time_are_not_a_division_by_zero() -> None:
    """A baseline whose stored runs' times are all zero (hand-edited) made compare's latency verdict divide by
    zero (found by an adversarial pass): zero is "not measured", never a ratio."""
    zero = [_run(0.0, broadcast=0.0, compute=0.0, step=0.0)] * 3
    assert _verdicts(zero, BASE) == {"all_reduce": "faster", "broadcast": "faster"}
    assert _verdicts([_run(0.0, broadcast=3.0, compute=0.0)], BASE)["broadcast"] == "faster"
    assert _verdicts(BASE, zero) == {}  # nothing stored to compare with: not judged


def test_two_runs_updating_one_baseline_at_once_both_add_their_latency_run(tmp_path: Path) -> None:
    """``--update-baselines --refresh-latency`` from two runs at once (two nightly jobs, or xdist workers, sharing
    ``baselines/``): each read the history, added its run and wrote it back, and the second write lost the
    first's run while both said they had added theirs (found by an adversarial pass). The second now waits for
    the first, then reads what it wrote. Here the first holds, after its read, until the second has read too
    (or 3 s have passed): without the lock both read the same history."""
    import threading

    from commgate.judge.gate import judge
    from commgate.judge.reconcile import reconcile
    from commgate.judge.store import BaselineStore
    from commgate.model.loader import load_text
    from commgate.model.predict import predict

    (s,) = load_text(
        "schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
        "expectations: {model: {check: false}}\n"
    )
    cap = _capture(4.0)
    rec = reconcile(predict(s), cap)
    read = {"a": threading.Event(), "b": threading.Event()}

    class Store(BaselineStore):
        def load(self, backend: str, scenario_id: str) -> bl.Baseline | None:
            got = super().load(backend, scenario_id)
            me = threading.current_thread().name
            if me in read:
                read[me].set()
                read["b" if me == "a" else "a"].wait(timeout=3)
            return got

    store = Store(tmp_path / "baselines")

    def gated(refresh: bool) -> object:
        return judge(s.expectations, [], cap, rec, store, update=True, refresh_latency=refresh)

    assert gated(refresh=False).written.endswith("written")  # type: ignore[attr-defined]
    said: list[object] = []
    runs = [threading.Thread(target=lambda: said.append(gated(refresh=True)), name=n) for n in read]
    runs[0].start()
    assert read["a"].wait(timeout=60)
    runs[1].start()
    for t in runs:
        t.join(timeout=120)
    added = "this run added to the latency history"
    assert [j.written.endswith(added) for j in said] == [True, True]  # type: ignore[attr-defined]
    (history,) = store.load("gloo", "s").latency.values()  # type: ignore[union-attr]
    assert len(history) == 3


def test_a_baseline_of_another_world_size_says_so_and_its_latency_is_not_judged() -> None:
    """A scenario's ``dp`` edited under the same name: the finding named the baseline's date and versions, not
    that it was taken at another world size, and this run's latency was judged against the other job's
    history and called slower (found by an adversarial pass)."""
    from commgate.judge.gate import evaluate
    from commgate.judge.reconcile import reconcile
    from commgate.model.predict import predict

    stored, hw, s = _three_stored_runs_and_a_failing_rule()
    cap = replace(_capture(12.0), stack={"hardware": hw})  # x3 slower than the stored runs
    rec = reconcile(predict(s), cap)
    fewer = dict(list(stored.calls.items())[1:])
    now = replace(stored, calls=fewer, latency={hw: (summarize(cap),)})
    for size, says in ((4, ""), (8, "; at world size 4, this run 8")):
        now = replace(now, provenance=stored.provenance | {"world_size": size})
        v = evaluate(s.expectations, predict(s).comparison(), cap, rec, now, stored, rerun=lambda: cap)
        (base,) = [f for f in v.findings if f.kind == "baseline"]
        assert base.title.endswith(f"deepspeed {stored.provenance.get('deepspeed') or 'none'}{says})")
        latency = [f for f in v.findings if f.kind == "latency"]
        if says:
            assert not latency
            assert v.latency_note == "latency not judged: the baseline's runs were of world size 4, this run's is 8"
        else:
            assert latency and latency[0].fail  # the same job's history: judged, and slower
