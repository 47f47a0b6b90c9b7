"""Capture every collective and point-to-point call, whoever issues it, by interposing a process group.

``install()`` registers a torch.distributed backend named ``commgate``. Its process groups are a
Python subclass of ``ProcessGroup`` holding the *real* backend (gloo, or NCCL/RCCL): every op records
a ``CapturedCall`` and then runs on that real backend. Everything goes through it: DDP's C++ reducer,
``deepspeed.comm``, DTensor's functional collectives, pipeline send/recv, subgroups made by ``new_group``.

Method names are those the pybind11 trampoline of ``ProcessGroup`` calls (``all_gather_single`` is
C++ ``_allgather_base`` ...); each records the call, then runs it on the real backend's own binding.

Timing: a call's duration runs from its issue to its completion, stamped by whoever sees it first: the
caller's ``wait()`` (exact for blocking calls), a completion query, or the ``Poller`` thread, which
checks the works in flight at a tick of a tenth of their age (20 us to 1 ms), so a call nobody waits on
(DDP's buckets, ZeRO's and FSDP's overlapped calls) ends within that bound of its true end, not at the
next call. No Python code ever runs on the backend's own threads. The issue path costs about 10 us a
call (``benchmarks/capture_cost.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from commgate.model.collectives import OPS, Op
from commgate.model.transformer import dtype_name
from commgate.run.capture import INIT_STEP, CapturedCall, StepWindow

BACKEND_NAME = "commgate"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


_FIELDS = ("seq", "step", "phase", "op", "group", "peer", "dtype", "elements", "bytes", "tensors", "start_ns", "root")
"""The order of a call's open record (a tuple: the cheapest record to make on the issue path)."""
_SEQ, _STEP, _PHASE, _OP, _GROUP, _PEER, _DTYPE, _ELEMENTS, _BYTES, _TENSORS, _START, _ROOT = range(len(_FIELDS))

_graph_task_id = torch._C._current_graph_task_id


def _call(rank: int, rec: tuple[Any, ...], duration_ns: int | None) -> CapturedCall:
    return CapturedCall(rank=rank, duration_ns=duration_ns, **dict(zip(_FIELDS, rec, strict=True)))


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
        self._t0 = time.perf_counter_ns()
        self._open: dict[int, tuple[Any, ...]] = {}
        self._works: dict[int, tuple[Any, int]] = {}
        """seq -> (the backend's work, its issue time): what the poller watches."""
        self._done: list[tuple[tuple[Any, ...], int]] = []
        self.calls: list[CapturedCall] = []
        self.last: tuple[Any, ...] | None = None
        """The open record of the call issued last (the launcher's hang report reads it)."""
        self.windows: list[StepWindow] = []
        """Step boundaries (``commgate.run.rank`` stamps them around each step)."""
        self.delay_first_recv_s = 0.0
        """A planted fault (``commgate.run.inject``): the first recv of step 0 waits this long."""
        self.slow: dict[str, float] = {}
        """A planted fault: op -> factor; a call of that op waits, once issued and before it is posted,
        factor - 1 times what this rank's earlier calls of the same op and size took without the wait."""
        self._unslowed: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
        self._injected: dict[int, tuple[tuple[str, tuple[int, ...], int], int]] = {}
        self.poller = Poller(self)

    def now(self) -> int:
        return time.perf_counter_ns() - self._t0

    def issue(
        self, op: Op, group: tuple[int, ...], tensors: Sequence[torch.Tensor], peer: int | None, root: int | None
    ) -> int:
        start = time.perf_counter_ns() - self._t0
        if len(tensors) == 1:
            t = tensors[0]
            elements = t.numel()
            nbytes = elements * t.element_size()
            dtype = _dtype(t.dtype)
        else:
            elements = sum(t.numel() for t in tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dtype = _dtype(tensors[0].dtype) if tensors else "none"
        phase = "backward" if _graph_task_id() != -1 else self.phase
        seq = next(self._seq)
        self._open[seq] = self.last = (
            seq, self.step, phase, op, group, peer, dtype, elements, nbytes, len(tensors), start, root,
        )  # fmt: skip
        if self.slow and str(op) in self.slow:
            self._slow_down(seq, (str(op), group, nbytes), self.slow[str(op)])
        return seq

    def describe_last(self) -> str:
        """The call issued last, in a line ("" before the first)."""
        r = self.last
        if r is None:
            return ""
        where = f"peer {r[_PEER]}" if r[_PEER] is not None else f"group {list(r[_GROUP])}"
        return f"{r[_OP]} ({where}, {r[_BYTES]} B, step {r[_STEP]}, {r[_PHASE]})"

    def _slow_down(self, seq: int, key: tuple[str, tuple[int, ...], int], factor: float) -> None:
        """The planted ``slow`` fault: wait (factor - 1) x the median of this key's earlier unslowed
        times (nothing on its first call), counted in this call's latency."""
        earlier = sorted(self._unslowed.get(key, ()))
        wait = int((factor - 1) * earlier[len(earlier) // 2]) if earlier else 0
        self._injected[seq] = (key, wait)
        if wait:
            time.sleep(wait / 1e9)

    def complete(self, seq: int, end: int | None = None) -> None:
        """Stamp ``seq`` completed at ``end`` (now by default), unless it already was."""
        rec = self._open.pop(seq, None)
        self._works.pop(seq, None)
        if rec is None:
            return
        if end is None:
            end = time.perf_counter_ns() - self._t0
        self._done.append((rec, end))
        if self._injected and seq in self._injected:
            key, wait = self._injected.pop(seq)
            self._unslowed.setdefault(key, []).append(end - rec[_START] - wait)

    def watch(self, seq: int, work: Any) -> None:
        """Have the poller stamp ``work``'s completion, unless the caller's wait does it first."""
        rec = self._open.get(seq)
        if rec is not None:
            self._works[seq] = (work, rec[_START])
            if not self.poller.awake.is_set():
                self.poller.wake()

    def poll(self) -> int:
        """Stamp the watched calls whose work has completed (the poller does this on its own; the runner
        calls it at step boundaries so that a step's window holds its completions). Returns the issue
        time of the youngest call still in flight, -1 when none is."""
        youngest = -1
        for seq, (work, start) in list(self._works.items()):
            if work.is_completed():
                self.complete(seq)
            elif start > youngest:
                youngest = start
        return youngest

    def _completed(self) -> list[CapturedCall]:
        """``calls`` with the records of the calls completed since the last look."""
        done, self._done = self._done, []
        self.calls += [_call(self.rank, rec, end - rec[_START]) for rec, end in done]
        return self.calls

    def take(self) -> list[CapturedCall]:
        """The completed calls so far, forgotten here (the microbenchmarks read them point by point)."""
        done = sorted(self._completed(), key=lambda c: c.seq)
        self.calls = []
        return done

    def drain(self) -> list[CapturedCall]:
        """All calls, the never-completed ones with ``duration_ns=None``, in issue order."""
        self.poller.stop()
        pending = [_call(self.rank, rec, None) for rec in list(self._open.values())]
        return sorted(self._completed() + pending, key=lambda c: c.seq)

    def progress(self) -> tuple[int, int, int]:
        """(issued, completed, open) calls so far: the launcher's stall watchdog reads them."""
        open_ = len(self._open)
        done = len(self.calls) + len(self._done)
        return done + open_, done, open_

    def snapshot(self) -> list[dict[str, Any]]:
        """Every call issued so far, in issue order, as plain records (``open``: not completed): what the
        launcher aligns across ranks when they stall."""
        keys = ("seq", "step", "phase", "op", "group", "peer", "bytes")
        index = [_FIELDS.index(k) for k in keys]

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


RECORDER: Recorder | None = None
INSTALLED: Recorder | None = None
"""The recorder ``install`` made last, kept after a run's teardown unsets ``RECORDER`` (the heartbeat
still reports on it)."""


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the calls issued inside (a no-op when nothing is recorded). Calls issued while autograd
    runs a graph are labelled ``backward`` anyway; this is for what engines do around it, e.g.
    ``engine.backward()`` reducing gradients after autograd returns, or the optimizer step."""
    rec = RECORDER
    if rec is None:
        yield
        return
    before, rec.phase = rec.phase, name
    rec.poll()
    try:
        yield
    finally:
        rec.poll()
        rec.phase = before


def optimizer_phase() -> contextlib.AbstractContextManager[None]:
    return phase("optimizer")


class _TimedWork(dist.Work):
    """The backend's work, passed through, stamping the call's completion when the caller waits on it
    or asks whether it completed (the poller stamps it otherwise). No Python runs on the backend's
    threads (a ``future.then`` callback would, and would hold a gloo worker until it has the GIL)."""

    def __init__(self, inner: dist.Work, rec: Recorder, seq: int) -> None:
        super().__init__()
        self._inner, self._rec, self._seq = inner, rec, seq

    def wait(self, timeout: Any = None) -> bool:
        ok: bool = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._rec.complete(self._seq)
        return ok

    def is_completed(self) -> bool:
        completed = bool(self._inner.is_completed())
        if completed:
            self._rec.complete(self._seq)
        return completed

    def get_future(self) -> Any:
        return self._inner.get_future()

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[torch.Tensor] = []
    for item in x:
        if isinstance(item, torch.Tensor):
            out.append(item)
        else:
            out += _flat(item)
    return out


# Coalesced forms the gloo binding lacks: one call per tensor, joined into one work.
_PER_TENSOR = {
    "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}


class CapturingProcessGroup(ProcessGroup):
    """A process group whose every op is recorded, then run by the real backend it holds.

    Each op calls the real backend's own Python binding, which releases the GIL. (Calling
    ``super().<op>`` would run the C++ base implementation with the GIL held by pybind11's override
    machinery, and deadlock against gloo's worker thread, which takes the GIL to free finished works.)
    """

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], name: str, real: Any) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is the Python-subclass form
        self.global_ranks = tuple(global_ranks) or tuple(range(size))
        self._name = name
        self._real = real

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _recorded(
        self,
        op: Op,
        tensors: list[torch.Tensor],
        post: Callable[[], Any],
        peer: int | None = None,
        root: int | None = None,
    ) -> Any:
        """Record the call, post it on the real backend (``post``), and hand back its work, timed."""
        rec = RECORDER
        if rec is None:
            return post()
        seq = rec.issue(op, self.global_ranks, tensors, peer, root)
        work = post()
        rec.watch(seq, work)
        return _TimedWork(work, rec, seq)

    def _run(self, method: str, args: tuple[Any, ...]) -> Any:
        real = getattr(self._real, method, None)
        if real is not None:
            return real(*args)
        outputs, inputs, opts = args
        works = [getattr(self._real, _PER_TENSOR[method])(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        try:
            future = torch.futures.collect_all([w.get_future() for w in works])
        except RuntimeError:  # gloo's reduce-scatter works have no future (DTensor's sequence-parallel path)
            for w in works:
                w.wait()
            future = torch.futures.Future()
            future.set_result(outputs)
        return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._recorded(Op.SEND, tensors, lambda: self._real.send(tensors, dst, tag), self.global_ranks[dst])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        def post() -> Any:
            rec = RECORDER
            if rec is not None and rec.delay_first_recv_s and rec.step == 0:
                time.sleep(rec.delay_first_recv_s)  # planted fault: once, counted in this recv's latency
                rec.delay_first_recv_s = 0.0
            return self._real.recv(tensors, src, tag)

        return self._recorded(Op.RECV, tensors, post, self.global_ranks[src])

    def barrier(self, opts: Any = None) -> Any:
        return self._recorded(
            Op.BARRIER, [], lambda: self._real.barrier() if opts is None else self._real.barrier(opts)
        )


def _make_collective(name: str, op: Op, arg: int, method: str) -> Callable[..., Any]:
    """An override recording the tensors of argument ``arg``. Off the root of a scatter or gather that
    list is empty; the rank's own shard times the group size is recorded, so that every participant
    reports the same message size."""

    rooted = OPS[op].rooted

    def collective(self: CapturingProcessGroup, *args: Any) -> Any:
        if RECORDER is None:
            return self._run(method, args)
        tensors = _flat(args[arg])
        if not tensors:  # scatter/gather off the root: this rank's shard, standing for 1/n of the message
            tensors = _flat(args[1 - arg]) * self.size()
        root = self.global_ranks[args[-1].rootRank] if rooted else None  # the options come last
        return self._recorded(op, tensors, lambda: self._run(method, args), root=root)

    collective.__name__ = collective.__qualname__ = name
    return collective


for _spec in OPS.values():
    for _b in _spec.bindings:
        setattr(CapturingProcessGroup, _b.name, _make_collective(_b.name, _spec.op, _b.buffer_arg, _b.real))


def _group_name(self: CapturingProcessGroup) -> str:
    return self._name


CapturingProcessGroup.group_name = property(_group_name)  # type: ignore[method-assign,assignment]

_INNER = {
    "gloo": ("cpu", ProcessGroup.BackendType.GLOO),
    "nccl": ("cuda", ProcessGroup.BackendType.NCCL),
    "emulated": ("cpu", ProcessGroup.BackendType.CUSTOM),  # commgate.run.emulate
}


def _creator(inner: str) -> Callable[[Any, Any], CapturingProcessGroup]:
    device, kind = _INNER[inner]

    def create(opts: Any, backend_options: Any) -> CapturingProcessGroup:
        real: Any
        registered: Any = None
        kind_here = kind
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        if inner == "gloo" or (inner == "emulated" and len(ranks) > 1 and REAL_RANKS.issuperset(ranks)):
            # an emulated run's groups of started ranks alone (pipeline stages, tensor shards) are real
            real = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
            kind_here = ProcessGroup.BackendType.GLOO
        elif inner == "emulated":
            from torch.distributed.distributed_c10d import PrefixStore

            from commgate.run.emulate import EmulatedBackend, stand_in

            started = {i: n for n, i in enumerate(i for i, r in enumerate(ranks) if r in REAL_RANKS)}
            wire = None
            if len(started) > 1 and opts.group_rank in started:  # point-to-point among them is real
                store = PrefixStore(f"commgate-started/{opts.group_id}", opts.store)
                wire = dist.ProcessGroupGloo(store, started[opts.group_rank], len(started), opts.timeout)
                _LIVE_BACKENDS.append(wire)
            real = EmulatedBackend(opts.group_rank, opts.group_size, wire, started)
            registered = stand_in(opts.group_rank, opts.group_size)
        else:
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = opts.timeout
            real = dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_opts)
        pg = CapturingProcessGroup(
            opts.group_rank, opts.group_size, list(opts.global_ranks_in_group), opts.group_id, real
        )
        pg._register_backend(torch.device(device), kind_here, registered or real)
        _LIVE_BACKENDS.append(real)
        return pg

    return create


_LIVE_BACKENDS: list[Any] = []
"""Python references to every real backend made since ``install``; see ``release_backends``."""


def release_backends() -> None:
    """Destroy the real backends now, from Python, where the binding releases the GIL while the backend
    joins its threads.

    Without this, the last reference to a gloo backend can be dropped by C++ with the GIL held (a DDP
    ``Reducer`` freed with its model), while a gloo worker thread is still freeing the last finished
    work, whose tensors need the GIL to be freed: each waits for the other for ever. Call after the
    process group is destroyed and the workload (the engine, the wrapped model) is unreferenced.
    """
    import gc

    gc.collect()  # engines and modules are in reference cycles; free them while the backends still live
    _LIVE_BACKENDS.clear()


REAL_RANKS: frozenset[int] = frozenset()
"""The ranks the run started (``commgate.run.emulate.started_ranks``): emulated, a group of them alone runs on
gloo."""


def install(inner: str, rank: int, real: Sequence[int] = ()) -> Recorder:
    """Register the ``commgate`` backend over ``inner`` (gloo, nccl, or emulated with the ``real`` ranks
    started) and start recording."""
    global RECORDER, REAL_RANKS
    REAL_RANKS = frozenset(real)
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _creator(inner), extended_api=True, devices=[_INNER[inner][0]])
    global INSTALLED
    RECORDER = INSTALLED = Recorder(rank)
    return RECORDER
