"""When the capture says a call ended, and what the training thread waited for: the poller's stamps of
calls nobody waits on, the exact stamps of waited ones, and the blocked time of a step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from commgate.run import interpose, stamps  # noqa: E402
from commgate.run.threadclock import ThreadClock  # noqa: E402


@pytest.fixture(params=["stamps", "poller"])
def world(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[interpose.Recorder]:
    """A one-rank job on commgate's capturing group over gloo, in this process: with gloo's completions
    stamped in C++ (``commgate.run.stamps``, built here once per environment), and without (the poller
    stamps every call, as it does NCCL's and gloo's point-to-point)."""
    if request.param == "stamps":
        assert stamps.build() is not None, "the completion-stamps extension did not build (stderr says why)"
    else:
        monkeypatch.setenv(stamps.OFF, "0")
    rec = interpose.install("gloo", 0)
    assert (rec._stamps is not None) == (request.param == "stamps")
    dist.init_process_group(interpose.BACKEND_NAME, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield rec
    finally:
        interpose.RECORDER = None
        dist.destroy_process_group()
        interpose.release_backends()


def test_a_call_nobody_waits_on_is_stamped_when_it_completes_not_at_the_next_look(
    world: interpose.Recorder,
) -> None:
    """An async all-reduce left in flight while the thread computes: its end is stamped (in C++, or by the
    poller) while the thread still computes, before any look of the thread's own; the next look, 200 ms of
    computing later, takes that stamp, not its own time. Waited for as an event (bounded, not timed: on a
    loaded machine the poller runs late, and a stamp is then later, never wrong; it failed once at a 20 ms
    bound under load)."""
    for _ in range(3):
        dist.all_reduce(torch.ones(1024), async_op=True)  # never waited on, as DDP's buckets
        assert world.last is not None
        seq = world.last[0]
        bound = time.monotonic() + 120
        while not _stamped(world, seq) and time.monotonic() < bound:
            pass  # the training thread busy, holding the GIL for most of it; no look of its own
        seen = world.now()
        assert _stamped(world, seq), "not stamped within 120 s while the thread computed"
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            pass  # computing on: the next look is 200 ms past the stamp
        (call,) = world.take()
        assert call.duration_ns is not None
        assert call.start_ns + call.duration_ns <= seen, "stamped at the next look, not when it completed"


def _stamped(world: interpose.Recorder, seq: int) -> bool:
    """Whether call ``seq``'s end is stamped, read as the recorder keeps it, without a look (which would stamp
    it): its C++ stamp is in, or the poller completed it."""
    entry = world._stamped.get(seq)
    if entry is None:
        return seq not in world._open
    return bool(world._stamps.stamp(entry[0]) >= 0)  # type: ignore[union-attr]


def test_a_waited_call_is_stamped_when_the_wait_returns(world: interpose.Recorder) -> None:
    before = world.now()
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    after = world.now()
    (call,) = world.take()
    assert call.duration_ns is not None
    assert before <= call.start_ns and call.start_ns + call.duration_ns <= after


def test_every_call_is_stamped_once_whoever_sees_it_first(world: interpose.Recorder) -> None:
    """Waits, completion queries and the poller race for the same calls; each is recorded once."""
    works = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(200)]
    for k, w in enumerate(works):
        if k % 3 == 0:
            w.wait()
        elif k % 3 == 1:
            while not w.is_completed():
                pass
    time.sleep(0.05)
    world.poll()
    calls = world.drain()
    assert [c.seq for c in calls] == list(range(200))
    assert all(c.duration_ns is not None and c.duration_ns >= 0 for c in calls)


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_gloo_s_collectives_are_stamped_in_cpp_and_wake_no_thread(world: interpose.Recorder) -> None:
    """With the extension, a gloo collective's end is stamped by gloo's own thread: the call's record ends
    between its issue and the wait's return, and the poller thread is never started."""
    for _ in range(20):
        before = world.now()
        work = dist.all_reduce(torch.ones(16), async_op=True)
        work.wait()
        after = world.now()
        (call,) = world.take()
        assert call.duration_ns is not None and before <= call.start_ns <= call.start_ns + call.duration_ns <= after
    assert world.poller._thread is None, "a stamped call woke the poller"


def two_gloo_groups() -> list[Any]:
    """Ranks 0 and 1 of one gloo group, both in this process (each set up on a thread of its own)."""
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def make(r: int) -> None:
        groups[r] = dist.ProcessGroupGloo(store, r, 2, dist.default_pg_timeout)

    makers = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(120)
    assert all(groups), "the two gloo groups did not connect"
    return groups


def test_gloo_completes_a_work_s_future_when_the_call_ends() -> None:
    """What the stamps rest on (torch 2.13): gloo marks a collective's future complete when the call has
    run, not when it is enqueued (NCCL's is). Two gloo groups of one process, one per thread: rank 1 joins
    the all-reduce 0.2 s after rank 0 issued it, so rank 0's stamp is at least that late."""
    ext = stamps.build()
    assert ext is not None, "the completion-stamps extension did not build (stderr says why)"
    groups = two_gloo_groups()
    late = threading.Timer(0.2, lambda: groups[1].allreduce([torch.ones(4)]).wait())  # type: ignore[attr-defined]
    issued = time.perf_counter_ns()
    work = groups[0].allreduce([torch.ones(4)])  # type: ignore[attr-defined]
    late.start()
    token = next(stamps.TOKENS)
    assert ext.watch(work, token)
    work.wait()
    late.join(120)
    assert ext.stamp(token) - issued >= 0.2e9, "gloo completed the future before the call ended"


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_a_work_without_a_future_is_timed_at_its_wait_and_wakes_no_thread(
    world: interpose.Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo's reduce-scatter work has no future (torch 2.13): the extension's ``watch`` says so, and the call is still
    recorded once, ended by its wait; it is not handed to the poller (which cost a reduce-scatter x1.6-2.0
    of its bare host time, and could never see it complete before the wait)."""
    bare = dist.new_group([0], backend="gloo")
    out, inp = torch.empty(4), torch.ones(4)
    work = dist.reduce_scatter_single(out, inp, group=bare, async_op=True)
    assert not world._stamps.watch(work, next(stamps.TOKENS))
    work.wait()
    done = dist.all_reduce(torch.ones(4), group=bare, async_op=True)
    token = next(stamps.TOKENS)
    assert world._stamps.watch(done, token)
    done.wait()
    assert world._stamps.stamp(token) > 0
    captured = dist.reduce_scatter_single(out, inp, async_op=True)  # through the capture
    assert not world._works and not world.poller.awake.is_set()
    # handed back in the extension's C++ wrapper, whose wait stamps it (no Python subclass, no Python in the wait)
    assert type(captured) is dist.Work
    ((token, _),) = world._stamped.values()
    assert world._stamps.stamp(token) == stamps.RUNNING
    captured.wait()
    assert world._stamps.stamp(token) > 0
    (call,) = world.take()
    assert call.op == "reduce_scatter" and call.duration_ns is not None
    assert world.poller._thread is None, "the poller thread was started for a call it could not stamp"
    # the extension is not asked again for that method's works (it learns "no future" from an exception, 7 us)
    assert world._futureless == {"_reduce_scatter_base"}
    asked: list[object] = []
    ask = world._stamps.watch
    monkeypatch.setattr(world._stamps, "watch", lambda work, token: asked.append(work) or ask(work, token))
    dist.reduce_scatter_single(out, inp, async_op=True).wait()
    dist.all_reduce(torch.ones(4))
    assert len(asked) == 1 and [c.op for c in world.take()] == ["reduce_scatter", "all_reduce"]


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_a_work_without_a_future_never_waited_on_stays_open_when_its_stamp_s_slot_goes_to_a_later_call(
    world: interpose.Recorder,
) -> None:
    """A call whose work has a future has completed by the time its stamp's slot goes to a call 65,536 later; one
    whose work has none completes in its wait alone, and one never waited on is listed as never completed, not
    as ended when its slot was reused."""
    dist.reduce_scatter_single(torch.empty(4), torch.ones(4), async_op=True)  # never waited on
    ((token, _),) = world._stamped.values()
    later: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    world._stamps.watch(torch._C._distributed_c10d._create_work_from_future(later), token + (1 << 16))  # kSlots
    assert world._stamps.stamp(token) == stamps.REUSED
    (call,) = world.drain()
    assert call.op == "reduce_scatter" and call.duration_ns is None


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_a_python_work_without_a_future_is_not_put_in_the_cpp_wrapper(world: interpose.Recorder) -> None:
    """The wrapper holds a work's C++ half alone: a ``Work`` subclass made in Python would lose its overrides with
    its Python half (its wait would then be c10d's own, which waits forever). Such a work is timed at its wait in
    Python (None: the caller wraps it)."""
    from commgate.model.collectives import Op

    class Silent(dist.Work):
        def wait(self, timeout: object = None) -> bool:
            return True

    seq = world.issue(Op.REDUCE_SCATTER, (0,), [torch.ones(4)], None, None)
    assert world.watch(seq, Silent(), future=True, method="silent") is None
    gloo = dist.new_group([0], backend="gloo")
    seq = world.issue(Op.REDUCE_SCATTER, (0,), [torch.ones(4)], None, None)
    made_in_cpp = dist.reduce_scatter_single(torch.empty(4), torch.ones(4), group=gloo, async_op=True)
    handed = world.watch(seq, made_in_cpp, future=True, method="_reduce_scatter_base")
    assert handed is not None and handed is not made_in_cpp
    handed.wait()


def test_the_wrapper_of_a_work_without_a_future_stamps_its_first_successful_end_only() -> None:
    """The extension's wrapper (``stamped``) stamps its token when the wait returns, or when the work says it
    completed, once: a later wait does not move the stamp. A wait that raises (the call failed, its peer gone)
    stamps nothing, so the call stays open and is listed as never completed; everything else is the inner
    work's."""
    ext = stamps.build()
    assert ext is not None, "the completion-stamps extension did not build (stderr says why)"
    ok: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    token = next(stamps.TOKENS)
    work = ext.stamped(torch._C._distributed_c10d._create_work_from_future(ok), token)  # type: ignore[attr-defined]
    assert not work.is_completed() and ext.stamp(token) == stamps.RUNNING
    ok.set_result([torch.ones(2)])
    assert work.is_completed() and work.is_success()
    first = ext.stamp(token)
    assert first > 0
    work.wait()
    assert ext.stamp(token) == first and work.get_future().value()[0].tolist() == [1.0, 1.0]

    class Failing(dist.Work):
        def wait(self, timeout: object = None) -> bool:
            raise RuntimeError("peer gone")

    failing, token = Failing(), next(stamps.TOKENS)  # held: its Python override is looked up on the object
    work = ext.stamped(failing, token)
    with pytest.raises(RuntimeError, match="peer gone"):
        work.wait()
    assert ext.stamp(token) == stamps.RUNNING


def test_gloo_completes_point_to_point_and_reduce_scatter_works_only_in_their_wait() -> None:
    """What timing those calls at the caller's wait rests on (torch 2.13): gloo's send, recv and reduce-scatter
    works have no future and do not say they completed before ``wait()``, however long the call has been
    over. Should a torch release complete them earlier, this fails, and the poller (or a future) is worth
    having for them again. Two gloo groups of one process, one per thread."""
    groups = two_gloo_groups()
    received = torch.zeros(4)
    recv = groups[1].recv([received], 0, 0)
    send = groups[0].send([torch.ones(4)], 1, 0)
    outs = [torch.empty(2), torch.empty(2)]
    scatter = [threading.Thread(target=lambda r=r: outs.__setitem__(r, groups[r]._reduce_scatter_base(
        outs[r], torch.ones(4), dist.ReduceScatterOptions()))) for r in (0, 1)]  # fmt: skip
    for t in scatter:
        t.start()
    for t in scatter:
        t.join(120)
    works = {"send": send, "recv": recv, "reduce_scatter (rank 0)": outs[0], "reduce_scatter (rank 1)": outs[1]}
    deadline = time.monotonic() + 0.5  # long past the calls' end: 16 bytes each
    while time.monotonic() < deadline:
        assert not [name for name, w in works.items() if w.is_completed()], "gloo completed a work before its wait"
        time.sleep(0.01)
    for name, w in works.items():
        with pytest.raises(RuntimeError, match="not implemented"):
            w.get_future()
        w.wait()
        # point-to-point works say so once waited on; a reduce-scatter's never does, even then
        assert w.is_completed() == name.startswith(("send", "recv")), name
    assert received.tolist() == [1.0] * 4


class _Synchronous:
    """A backend whose all_reduce runs to the end and hands back no work, as NCCL's does for
    ``async_op=False`` (torch 2.11 with NCCL 2.28, seen by ``tests/test_capture_nccl.py`` on a GPU)."""

    def __init__(self, real: object) -> None:
        self._real = real

    def allreduce(self, *args: object) -> None:
        self._real.allreduce(*args).wait()  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", ["poller"], indirect=True)
def test_a_synchronous_call_that_hands_back_no_work_is_recorded_and_ended(world: interpose.Recorder) -> None:
    """The caller gets the backend's None back (torch then waits on nothing), and the call is recorded once,
    ended, not left open for the drain to call never-completed."""
    group = dist.group.WORLD
    real = group._real
    group._real = _Synchronous(real)
    try:
        t = torch.ones(4)
        assert dist.all_reduce(t) is None
        assert t.tolist() == [1.0] * 4
    finally:
        group._real = real
    assert world._open == {}
    (call,) = world.take()
    assert call.op == "all_reduce" and call.bytes == 16 and call.duration_ns is not None


def test_the_poller_sleeps_when_nothing_is_in_flight(world: interpose.Recorder) -> None:
    dist.all_reduce(torch.ones(4))
    deadline = time.monotonic() + 60  # bounded, not timed: a loaded machine runs the poller late
    while world.poller.awake.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not world.poller.awake.is_set()


def test_blocked_time_counts_waiting_not_computing() -> None:
    clock = ThreadClock()
    if clock.busy_ns() is None:
        pytest.skip("no per-thread scheduler statistics here (not Linux)")
    t0, b0 = time.perf_counter_ns(), clock.busy_ns()
    time.sleep(0.1)
    t1, b1 = time.perf_counter_ns(), clock.busy_ns()
    while time.perf_counter_ns() - t1 < 100e6:
        pass
    t2, b2 = time.perf_counter_ns(), clock.busy_ns()
    assert b0 is not None and b1 is not None and b2 is not None
    slept, spun = (t1 - t0) - (b1 - b0), (t2 - t1) - (b2 - b1)
    assert slept > 80e6, "a sleeping thread is blocked"
    assert spun < 20e6, "a computing thread is not, even when it waits for a core"
    clock.close()


def test_a_completed_call_the_poller_had_not_looked_at_is_not_left_open_by_the_drain() -> None:
    """The drain listed a watched call as never completed (``duration_ns`` None) when its work had completed
    but the poller, starved of a core, had not polled it yet: it failed once under load
    (``test_run.py::test_capture_sees_every_path``). The drain looks at the watched works once more."""
    from commgate.model.collectives import Op
    from commgate.run.recorder import Recorder

    class Done:
        def is_completed(self) -> bool:
            return True

    rec = Recorder(0)
    rec.poller._stopped = True  # a poller that never gets to look: the thread it starts ends at once
    seq = rec.issue(Op.ALL_REDUCE, (0, 1), [torch.ones(4)], None, None)
    rec.watch(seq, Done())
    (call,) = rec.drain()
    assert call.seq == seq and call.duration_ns is not None and call.duration_ns >= 0


def test_the_call_issued_last_names_a_large_group_by_its_ends() -> None:
    """The status line the launcher's deadline report quotes is cut at ``STATUS_WIDTH``: an emulated run's
    64-rank group was listed rank by rank and cut mid-list ("..., 56, 57,, had completed")."""
    from commgate.model.collectives import Op
    from commgate.run.rank import STATUS_WIDTH
    from commgate.run.recorder import Recorder

    rec = Recorder(0)
    rec.poller._stopped = True
    assert rec.describe_last() == ""
    rec.issue(Op.BROADCAST, tuple(range(1024)), [torch.ones(4)], None, 0)
    line = rec.describe_last()
    assert line == "broadcast (group [0, 1, ..., 1023] (1024 ranks), 16 B, step -1, init)"
    assert len(line) < STATUS_WIDTH
    rec.issue(Op.SEND, (0, 1), [torch.ones(2)], 1, None)
    assert rec.describe_last() == "send (peer 1, 8 B, step -1, init)"


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_a_call_whose_future_completed_is_drained_once_and_ended(world: interpose.Recorder) -> None:
    """Whoever waits on a work's future (DDP's reducer waits on its buckets') returns once the future is marked
    completed, before the completing thread has run the future's callbacks, commgate's stamp among them. A
    capture gathered then listed the call as never completed and, once the stamp landed, completed as well:
    on a loaded machine a DDP bucket's all-reduce was counted 7 times where 6 were issued. Here a callback
    ahead of the stamp holds the completing thread for 0.3 s while the capture is gathered."""
    from commgate.model.collectives import Op

    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    held = threading.Event()

    def ahead(_: object) -> None:  # runs on the completing thread, before the stamp's callback
        held.set()
        time.sleep(0.3)

    future.add_done_callback(ahead)
    work = torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]
    seq = world.issue(Op.ALL_REDUCE, (0,), [torch.ones(4)], None, None)
    assert world.watch(seq, work, future=True), "not stamped in C++"
    threading.Thread(target=future.set_result, args=([torch.ones(4)],)).start()
    future.wait()
    assert held.wait(60)  # the completing thread is in the callback ahead of the stamp
    calls = [c for c in world.drain() if c.seq == seq]
    assert len(calls) == 1 and calls[0].duration_ns is not None, calls
