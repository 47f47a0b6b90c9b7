"""Capture every collective and point-to-point call, whoever issues it, by interposing a process group.

``install()`` registers a torch.distributed backend named ``commgate``. Its process groups are a
Python subclass of ``ProcessGroup`` holding the *real* backend (gloo, or NCCL/RCCL): every op records
a ``CapturedCall`` and then runs on that real backend. Everything goes through it: DDP's C++ reducer,
``deepspeed.comm``, DTensor's functional collectives, pipeline send/recv, subgroups made by ``new_group``.

Method names are those the pybind11 trampoline of ``ProcessGroup`` calls (``all_gather_single`` is
C++ ``_allgather_base`` ...); each records the call, then runs it on the real backend's own binding.

Timing: a call's duration runs from its issue to the first moment its completion is observed: when the
caller waits on the returned work (exact for blocking calls and ``work.wait()``), asks whether it has
completed, or when the recorder polls its in-flight works (at every later call and phase change; an
upper bound for callers that only chain futures, such as DDP's reducer). No Python code ever runs on the
backend's own threads.
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


class Recorder:
    """The calls of this process, with the step and phase the runner is in."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = INIT_STEP
        self.phase = "init"
        self._seq = itertools.count()
        self._t0: int | None = None
        self._lock = threading.Lock()
        self._open: dict[int, dict[str, Any]] = {}
        self._works: dict[int, Any] = {}
        self.calls: list[CapturedCall] = []
        self._done: list[dict[str, Any]] = []
        self.windows: list[StepWindow] = []
        """Step boundaries (``commgate.run.rank`` stamps them around each step)."""
        self.on_issue: Callable[[str], None] | None = None
        """Called with a description of each call as it is issued (the launcher's hang report)."""
        self.delay_first_recv_s = 0.0
        """A planted fault (``commgate.run.inject``): the first recv of step 0 waits this long."""
        self.slow: dict[str, float] = {}
        """A planted fault: op -> factor; a call of that op waits, once issued and before it is posted,
        factor - 1 times what this rank's earlier calls of the same op and size took without the wait."""
        self._unslowed: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
        self._injected: dict[int, tuple[tuple[str, tuple[int, ...], int], int]] = {}

    def now(self) -> int:
        t = time.perf_counter_ns()
        if self._t0 is None:
            self._t0 = t
        return t - self._t0

    def issue(
        self,
        *,
        op: Op,
        group: Sequence[int],
        tensors: Sequence[torch.Tensor],
        peer: int | None,
        root: int | None = None,
    ) -> int:
        elements = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtype = dtype_name(tensors[0].dtype) if tensors else "none"
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        self.poll()
        seq = next(self._seq)
        rec = dict(
            rank=self.rank,
            seq=seq,
            step=self.step,
            phase=phase,
            op=op,
            group=tuple(group),
            peer=peer,
            dtype=dtype,
            elements=elements,
            bytes=nbytes,
            tensors=len(tensors),
            start_ns=self.now(),
            root=root,
        )
        with self._lock:
            self._open[seq] = rec
        if self.on_issue is not None:
            where = f"peer {peer}" if peer is not None else f"group {list(group)}"
            self.on_issue(f"{op} ({where}, {nbytes} B, step {self.step}, {phase})")
        if self.slow and str(op) in self.slow:
            self._slow_down(seq, (str(op), tuple(group), nbytes), self.slow[str(op)])
        return seq

    def _slow_down(self, seq: int, key: tuple[str, tuple[int, ...], int], factor: float) -> None:
        """The planted ``slow`` fault: wait (factor - 1) x the median of this key's earlier unslowed
        times (nothing on its first call), counted in this call's latency."""
        earlier = sorted(self._unslowed.get(key, ()))
        wait = int((factor - 1) * earlier[len(earlier) // 2]) if earlier else 0
        self._injected[seq] = (key, wait)
        if wait:
            time.sleep(wait / 1e9)

    def complete(self, seq: int) -> None:
        end = self.now()
        with self._lock:
            rec = self._open.pop(seq, None)
            self._works.pop(seq, None)
            if rec is not None:  # the record is made at drain: this runs on every call's critical path
                rec["duration_ns"] = end - rec["start_ns"]
                self._done.append(rec)
                if self._injected and seq in self._injected:
                    key, wait = self._injected.pop(seq)
                    self._unslowed.setdefault(key, []).append(rec["duration_ns"] - wait)

    def watch(self, seq: int, work: Any) -> None:
        """Keep ``work`` to stamp its completion when it is next seen completed (see ``poll``)."""
        with self._lock:
            if seq in self._open:
                self._works[seq] = work

    def poll(self) -> None:
        """Stamp the calls whose work has completed since the last look (an upper bound on their end)."""
        with self._lock:
            done = [seq for seq, work in self._works.items() if work.is_completed()]
        for seq in done:
            self.complete(seq)

    def _completed(self) -> list[CapturedCall]:
        """``calls`` with the records of the calls completed since the last look (hold the lock)."""
        self.calls += [CapturedCall(**rec) for rec in self._done]
        self._done.clear()
        return self.calls

    def take(self) -> list[CapturedCall]:
        """The completed calls so far, forgotten here (the microbenchmarks read them point by point)."""
        with self._lock:
            done = sorted(self._completed(), key=lambda c: c.seq)
            self.calls = []
            return done

    def drain(self) -> list[CapturedCall]:
        """All calls, the never-completed ones with ``duration_ns=None``, in issue order."""
        with self._lock:
            pending = [CapturedCall(**rec, duration_ns=None) for rec in self._open.values()]
            return sorted(self._completed() + pending, key=lambda c: c.seq)

    def progress(self) -> tuple[int, int, int]:
        """(issued, completed, open) calls so far: the launcher's stall watchdog reads them."""
        with self._lock:
            done = len(self.calls) + len(self._done)
            return done + len(self._open), done, len(self._open)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every call issued so far, in issue order, as plain records (``open``: not completed): what the
        launcher aligns across ranks when they stall."""
        keys = ("seq", "step", "phase", "op", "group", "peer", "bytes")
        with self._lock:
            done = [{k: getattr(c, k) for k in keys} | {"open": False} for c in self.calls]
            done += [{k: r[k] for k in keys} | {"open": False} for r in self._done]
            pending = [{k: r[k] for k in keys} | {"open": True} for r in self._open.values()]
        return sorted(done + pending, key=lambda r: r["seq"])


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
    """The backend's work, passed through, stamping the call's completion when it is observed.

    No Python runs on the backend's threads (a ``future.then`` callback would, and can deadlock against
    the GIL); completion is stamped when the caller waits, asks ``is_completed``, or the recorder polls.
    """

    def __init__(self, inner: dist.Work, done: Callable[[], None]) -> None:
        super().__init__()
        self._inner, self._done = inner, done

    def wait(self, timeout: Any = None) -> bool:
        ok: bool = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._done()
        return ok

    def is_completed(self) -> bool:
        completed = bool(self._inner.is_completed())
        if completed:
            self._done()
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
    return [t for item in x for t in _flat(item)]


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

    def _record(
        self, op: Op, tensors: list[torch.Tensor], peer: int | None = None, root: int | None = None
    ) -> tuple[Recorder, int] | None:
        rec = RECORDER
        if rec is None:
            return None
        return rec, rec.issue(op=op, group=self.global_ranks, tensors=tensors, peer=peer, root=root)

    @staticmethod
    def _timed(token: tuple[Recorder, int] | None, work: Any) -> Any:
        if token is None:
            return work
        rec, seq = token
        rec.watch(seq, work)
        return _TimedWork(work, lambda: rec.complete(seq))

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
        token = self._record(Op.SEND, tensors, self.global_ranks[dst])
        return self._timed(token, self._real.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        token = self._record(Op.RECV, tensors, self.global_ranks[src])
        if token is not None and token[0].delay_first_recv_s and token[0].step == 0:
            time.sleep(token[0].delay_first_recv_s)  # planted fault: once, counted in this recv's latency
            token[0].delay_first_recv_s = 0.0
        return self._timed(token, self._real.recv(tensors, src, tag))

    def barrier(self, opts: Any = None) -> Any:
        token = self._record(Op.BARRIER, [])
        return self._timed(token, self._real.barrier() if opts is None else self._real.barrier(opts))


def _make_collective(name: str, op: Op, arg: int, method: str) -> Callable[..., Any]:
    """An override recording the tensors of argument ``arg``. Off the root of a scatter or gather that
    list is empty; the rank's own shard times the group size is recorded, so that every participant
    reports the same message size."""

    rooted = OPS[op].rooted

    def collective(self: CapturingProcessGroup, *args: Any) -> Any:
        tensors = _flat(args[arg])
        if not tensors:  # scatter/gather off the root: this rank's shard, standing for 1/n of the message
            tensors = _flat(args[1 - arg]) * self.size()
        root = self.global_ranks[args[-1].rootRank] if rooted else None  # the options come last
        token = self._record(op, tensors, root=root)
        return self._timed(token, self._run(method, args))

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
