"""What the capture records of each call, and when the call ended.

A ``Recorder`` holds the calls of this process, with the step and phase the runner is in: the capturing
process group (``commgate.run.interpose``) hands it each call as it is issued and each work it posts. A
call's duration runs from its issue to its completion. Where gloo completes the work's future, a C++
callback stamps the completion exactly, on gloo's own thread (``commgate.run.stamps``), and the recorder
reads it when it next looks (the next call's issue, a step boundary, the heartbeat, a read of the
calls): such a call's work is the backend's own, its wait and completion queries pass through no Python.
Elsewhere (gloo's point-to-point and reduce-scatter, NCCL, or no extension) it is stamped by whoever sees
it first: the caller's ``wait()`` (exact for blocking calls), a completion query, or the
``Poller`` thread, which checks the works in flight at a tick of a tenth of their age (20 us to 1 ms), so
a call nobody waits on (DDP's buckets, ZeRO's and FSDP's overlapped calls) ends within that bound of its
true end, not at the next call.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from commgate.model.collectives import Op
from commgate.model.layout import group_text
from commgate.model.transformer import dtype_name
from commgate.run import stamps
from commgate.run.capture import INIT_STEP, CapturedCall, RankClock, StepWindow

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


FIELDS = ("seq", "step", "phase", "op", "group", "peer", "dtype", "elements", "bytes", "tensors", "start_ns", "root")
"""The order of a call's open record (a tuple: the cheapest record to make on the issue path)."""
_SEQ, _STEP, _PHASE, _OP, _GROUP, _PEER, _DTYPE, _ELEMENTS, _BYTES, _TENSORS, _START, _ROOT = range(len(FIELDS))

_graph_task_id = torch._C._current_graph_task_id
_clock = time.perf_counter_ns
_TOKENS = stamps.TOKENS
_WORK = torch._C._distributed_c10d.Work if torch.distributed.is_available() else None
"""c10d's ``Work`` as Python sees a work made in C++ (gloo's): only such a work goes into the extension's wrapper,
which holds its C++ half alone (a Python subclass's overrides would be lost with its Python half)."""


def _call(rank: int, rec: tuple[Any, ...], duration_ns: int | None) -> CapturedCall:
    return CapturedCall(rank=rank, duration_ns=duration_ns, **dict(zip(FIELDS, rec, strict=True)))


def _has_future(work: Any) -> bool:
    try:
        work.get_future()
    except RuntimeError:  # gloo's send, recv and reduce-scatter: "Work::getFuture not implemented"
        return False
    return True


class Recorder:
    """The calls of this process, with the step and phase the runner is in.

    The issue path (``issue``, ``watch``, ``complete``) takes no lock: each step is one dictionary or
    list operation, atomic under the GIL, and a call's open record is popped exactly once, by whoever
    first sees it completed (the caller's ``wait``, or the ``Poller``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = INIT_STEP
        self.phase = "init"
        self._seq = itertools.count()
        self._t0 = time.perf_counter_ns()  # the host's monotonic clock (CLOCK_MONOTONIC on Linux)
        self._wall0 = time.time_ns()
        self._open: dict[int, tuple[Any, ...]] = {}
        self._works: dict[int, tuple[Any, int]] = {}
        """seq -> (the backend's work, its issue time): what the poller watches."""
        self._futureless: set[str] = set()
        """The gloo methods whose works have no future (``watch``): each method makes one kind of work."""
        self._stamps = stamps.loaded()
        self._stamped: dict[int, tuple[int, Any]] = {}
        """seq -> (its token in the C++ stamps (``commgate.run.stamps``), its work), until the recorder reads the
        stamp."""
        self._failed: set[int] = set()
        """The calls whose work completed with an error (stamped in C++): they are listed as never completed."""
        self._done: list[tuple[tuple[Any, ...], int]] = []
        self.calls: list[CapturedCall] = []
        self.last: tuple[Any, ...] | None = None
        """The open record of the call issued last (the launcher's hang report reads it)."""
        self.windows: list[StepWindow] = []
        """Step boundaries (``commgate.run.rank`` stamps them around each step)."""
        self.holding = False
        """A planted fault holds the call issued last (``commgate.run.planted``): the rank sleeps on purpose,
        it is not blocked in the call (the stall watchdog reads it from the heartbeat)."""
        self.poller = Poller(self)

    def clock(self) -> RankClock:
        """This rank's clock origin, for putting its calls and its peers' on one time line."""
        return RankClock(rank=self.rank, host=socket.gethostname(), monotonic_ns=self._t0, wall_ns=self._wall0)

    def now(self) -> int:
        return time.perf_counter_ns() - self._t0

    def issue(
        self, op: Op, group: tuple[int, ...], tensors: Sequence[torch.Tensor], peer: int | None, root: int | None
    ) -> int:
        start = _clock() - self._t0
        if self._stamped:
            self.harvest()
        if len(tensors) == 1:
            t = tensors[0]
            elements = t.numel()
            nbytes = elements * t.element_size()  # not ``nbytes``: a sparse tensor has none
            dtype = _DTYPE_NAMES.get(t.dtype) or _dtype(t.dtype)
        else:
            elements = sum(t.numel() for t in tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dtype = _dtype(tensors[0].dtype) if tensors else "none"
        phase = "backward" if _graph_task_id() != -1 else self.phase
        seq = next(self._seq)
        self._open[seq] = self.last = (
            seq, self.step, phase, op, group, peer, dtype, elements, nbytes, len(tensors), start, root,
        )  # fmt: skip
        return seq

    def describe_last(self) -> str:
        """The call issued last, in a line ("" before the first)."""
        r = self.last
        if r is None:
            return ""
        where = f"peer {r[_PEER]}" if r[_PEER] is not None else f"group {group_text(r[_GROUP])}"
        return f"{r[_OP]} ({where}, {r[_BYTES]} B, step {r[_STEP]}, {r[_PHASE]})"

    def complete(self, seq: int, end: int | None = None) -> tuple[tuple[Any, ...], int] | None:
        """Stamp ``seq`` completed at ``end`` (now by default), unless it already was. Returns (its open
        record, its end) when this stamped it, None when it already was."""
        entry = self._stamped.get(seq)  # read, not popped, first: a thread completing it beside reads the same
        if entry is not None:
            stamp = self._stamps.stamp(entry[0])  # type: ignore[union-attr]
            if stamp == stamps.FAILED:
                self._failed.add(seq)
                self._stamped.pop(seq, None)
                return None
            if end is None and stamp >= 0:
                end = stamp - self._t0
            self._stamped.pop(seq, None)
        elif seq in self._failed:  # its work completed with an error: it stays open, never completed
            return None
        return self._close(seq, _clock() - self._t0 if end is None else end)

    def _close(self, seq: int, end: int) -> tuple[tuple[Any, ...], int] | None:
        """Where every call is completed, once (``complete``, and ``harvest`` for a stamped call): its open record
        moved to the completed ones with its end. Returns (the record, its end), None when it already was."""
        rec = self._open.pop(seq, None)
        if rec is None:
            return None
        self._works.pop(seq, None)
        done = (rec, end)
        self._done.append(done)
        return done

    def watch(self, seq: int, work: Any, future: bool = False, method: str = "") -> Any:
        """Have ``work``'s completion stamped, and return the work to hand back to the caller. Where ``future``
        (the backend completes a work's future when the call ends: gloo) and the extension is loaded: stamped
        in C++ when its future completes (``work`` itself is handed back), or, for a work without a future
        (gloo's send, recv and reduce-scatter complete in their ``wait()``, never before it), when its wait
        returns, through the extension's wrapper of it (handed back instead). Else by the poller, unless the
        caller's wait does it first: None, the caller times its wait (``commgate.run.interpose._TimedWork``).
        ``method``: the backend's method that made ``work``; once one of its works had no future, the next are
        not asked (the extension learns it from an exception: 7 us a call, which made a captured gloo
        reduce-scatter cost x1.6-1.7 of the bare one)."""
        ext = self._stamps
        if future and ext is not None:  # (a call just issued: still open, whoever else looks at it)
            token = next(_TOKENS)
            if method not in self._futureless:
                if ext.watch(work, token):
                    self._stamped[seq] = (token, work)
                    return work
                if method:
                    self._futureless.add(method)
            if type(work) is not _WORK:
                return None
            work = ext.stamped(work, token)
            self._stamped[seq] = (token, work)
            return work
        rec = self._open.get(seq)
        if rec is not None:
            self._works[seq] = (work, rec[_START])
            if not self.poller.awake.is_set():
                self.poller.wake()
        return None

    def harvest(self) -> None:
        """Complete the calls whose C++ stamp is in, at that stamp (the poller's thread may harvest beside the
        issuing one: a call's record is popped once, by whichever pops it first)."""
        stamped = self._stamped
        if not stamped:
            return
        stamp_of = self._stamps.stamp  # type: ignore[union-attr]
        for seq, (token, work) in list(stamped.items()):
            stamp = stamp_of(token)
            if stamp >= 0:  # the usual case, kept short: ``complete`` with the stamp read once
                stamped.pop(seq, None)
                self._close(seq, stamp - self._t0)
            elif stamp == stamps.FAILED:
                self.complete(seq)
            elif stamp == stamps.REUSED:  # its slot went to a call 65,536 later
                if _has_future(work):  # its future has completed by now, at the latest
                    self.complete(seq, _clock() - self._t0)
                else:  # the extension's wrapper, not waited on since (its wait would have stamped it): it stays open
                    stamped.pop(seq, None)

    def poll(self) -> int:
        """Stamp the watched calls whose work has completed (the poller does this on its own; the runner
        calls it at step boundaries so that a step's window holds its completions). Returns the issue
        time of the youngest call still in flight, -1 when none is."""
        if self._stamped:
            self.harvest()
        youngest = -1
        for seq, (work, start) in list(self._works.items()):
            if work.is_completed():
                self.complete(seq)
            elif start > youngest:
                youngest = start
        return youngest

    def _completed(self) -> list[CapturedCall]:
        """``calls`` with the records of the calls completed since the last look."""
        self.harvest()
        done, self._done = self._done, []
        self.calls += [_call(self.rank, rec, end - rec[_START]) for rec, end in done]
        return self.calls

    def take(self) -> list[CapturedCall]:
        """The completed calls so far, forgotten here (the microbenchmarks read them point by point)."""
        done = sorted(self._completed(), key=lambda c: c.seq)
        self.calls = []
        return done

    def drain(self) -> list[CapturedCall]:
        """All calls, the never-completed ones with ``duration_ns=None``, in issue order, each once."""
        self.poller.stop()
        # before the open ones are listed: a call stamped in C++, or whose work has completed though the poller
        # (starved of a core on a loaded machine) had not looked at it yet, is completed, not pending
        self._settle()
        self.poll()
        done = self._completed()  # first: it moves what it completes out of the open calls
        pending = [_call(self.rank, rec, None) for rec in list(self._open.values())]
        return sorted(done + pending, key=lambda c: c.seq)

    SETTLE_S = 60.0
    """The most ``drain`` waits for the C++ stamps of calls whose future has completed."""

    def _settle(self) -> None:
        """Wait for the C++ stamp of each call whose future has completed: whoever waits on a future (DDP's
        reducer does, on its buckets') returns once it is marked completed, before the thread that marked it
        has run its callbacks, the stamp among them, which it does next. Unwaited for, such a call was listed
        as never completed, and once its stamp landed, completed as well: twice, in the capture of a run on a
        loaded machine (a DDP bucket's all-reduce counted 7 times where 6 were issued). A call whose future
        has not completed is pending, not waited for."""
        if not self._stamped or self._stamps is None:
            return
        until = time.monotonic() + self.SETTLE_S
        for token, work in list(self._stamped.values()):
            try:
                ended = work.get_future().done()
            except RuntimeError:
                continue
            while ended and self._stamps.stamp(token) == stamps.RUNNING and time.monotonic() < until:
                time.sleep(0.001)

    def progress(self) -> tuple[int, int, int]:
        """(issued, completed, open) calls so far: the launcher's stall watchdog reads them."""
        self.harvest()
        open_ = len(self._open)
        done = len(self.calls) + len(self._done)
        return done + open_, done, open_

    def snapshot(self) -> list[dict[str, Any]]:
        """Every call issued so far, in issue order, as plain records (``open``: not completed): what the
        launcher aligns across ranks when they stall."""
        self.harvest()
        keys = ("seq", "step", "phase", "op", "group", "peer", "bytes")
        index = [FIELDS.index(k) for k in keys]

        def plain(r: tuple[Any, ...], open_: bool) -> dict[str, Any]:
            return {k: r[i] for k, i in zip(keys, index, strict=True)} | {"open": open_}

        done = [{k: getattr(c, k) for k in keys} | {"open": False} for c in list(self.calls)]
        done += [plain(r, False) for r, _ in list(self._done)]
        pending = [plain(r, True) for r in list(self._open.values())]
        return sorted(done + pending, key=lambda r: r["seq"])


class Poller:
    """A thread that stamps the completion of asynchronous calls nobody waits on (DDP's buckets,
    ZeRO's overlapped reductions, FSDP's prefetches), with a bounded cost.

    While calls are in flight it checks them (``Work.is_completed``, a C++ query) every
    ``max(MIN_TICK_NS, age / RESOLUTION)`` of the youngest call's age, at most every ``MAX_TICK_NS``;
    with none in flight it sleeps on an event. So a call's end is stamped late by at most
    ``max(MIN_TICK_NS, duration / RESOLUTION)`` (plus the wait for the GIL), and a call of duration D
    costs about ``RESOLUTION x ln(D / MIN_TICK_NS)`` checks, each a few microseconds off the training
    thread. No Python runs on the backend's own threads; the thread's timer slack is cut to 1 us (Linux)
    so that its short sleeps are short.
    """

    MIN_TICK_NS = 20_000
    MAX_TICK_NS = 1_000_000
    RESOLUTION = 10

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        self.awake = self._event = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        if not self._event.is_set():
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commgate-poller", daemon=True)
                self._thread.start()
            self._event.set()

    def stop(self) -> None:
        """Stop the thread and wait for it, so that no completion is stamped after this returns."""
        self._stopped = True
        self._event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        _short_timer_slack()
        rec = self._rec
        while not self._stopped:
            if not rec._works:
                self._event.clear()
                if not rec._works:
                    self._event.wait()
                continue
            youngest = rec.poll()
            if youngest >= 0:
                age = rec.now() - youngest
                time.sleep(min(max(self.MIN_TICK_NS, age // self.RESOLUTION), self.MAX_TICK_NS) / 1e9)


def _short_timer_slack() -> None:
    """1 us of timer slack for the calling thread (Linux ``prctl(PR_SET_TIMERSLACK)``; else nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)
