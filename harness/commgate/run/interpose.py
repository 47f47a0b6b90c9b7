"""Capture every collective and point-to-point call, whoever issues it, by interposing a process group.

``install()`` registers a torch.distributed backend named ``commgate``. Its process groups are a
Python subclass of ``ProcessGroup`` holding the *real* backend (gloo, or NCCL/RCCL): every op records
a ``CapturedCall`` and then runs on that real backend. Everything goes through it: DDP's C++ reducer,
``deepspeed.comm``, DTensor's functional collectives, pipeline send/recv, subgroups made by ``new_group``.

Method names are those the pybind11 trampoline of ``ProcessGroup`` calls (``all_gather_single`` is
C++ ``_allgather_base`` ...); each records the call, then runs it on the real backend's own binding.

Timing: each call is recorded by this process's ``Recorder`` (``commgate.run.recorder``). A gloo
collective's completion is stamped in C++ on gloo's own thread (``commgate.run.stamps``); other calls'
by the caller's wait or the recorder's poller. No Python code ever runs on the backend's own threads.
What the capture costs a call: ``benchmarks/capture_cost.py`` (docs/speed.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from commgate.model.collectives import OPS, Op
from commgate.run.recorder import Recorder

BACKEND_NAME = "commgate"

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
    threads (a ``future.then`` callback would, and would hold a gloo worker until it has the GIL).
    Made by ``_timed`` where the completion-stamps extension does not stamp the call (``Recorder.watch``: the
    poller's form, and gloo's futureless works when the extension is not loaded; an ``__init__`` of its own,
    calling ``dist.Work``'s, cost 0.3 us more a call). With the extension, gloo's send, recv and reduce-scatter
    go back in its C++ wrapper instead, whose wait stamps them with no Python (``commgate.run.stamps``)."""

    __slots__ = ("_inner", "_rec", "_seq")
    _inner: dist.Work
    _rec: Recorder
    _seq: int

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


def _timed(inner: dist.Work, rec: Recorder, seq: int) -> _TimedWork:
    work = _TimedWork()
    work._inner, work._rec, work._seq = inner, rec, seq
    return work


class _Joined(dist.Work):
    """One call posted as several works (a coalesced form the backend lacks, one work per tensor), joined:
    its future completes when theirs all have, and waiting on it waits on each of them.

    A work made from the joined future (``_create_work_from_future``) would not do: ``Future.wait`` returns
    as soon as the future is marked completed, before the completing thread has run the future's callbacks,
    the C++ stamp of the call's end (``commgate.run.stamps``) among them, so a call the caller had waited on
    could still read as running when the capture is gathered (1 run in 3 to 9 of ``test_capture_sees_every_path``:
    DTensor's all-gather). A gloo work's own ``wait`` returns only after its future's callbacks have run, and
    the joined future's, chained on the last of them, run inside those."""

    def __init__(self, works: list[Any], future: Any) -> None:
        super().__init__()
        self._works, self._future = works, future

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> Any:
        return self._future

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> Any:
        return next((e for work in self._works if (e := work.exception()) is not None), None)

    def result(self) -> Any:
        return [t for work in self._works for t in work.result()]

    def synchronize(self) -> None:
        for work in self._works:
            work.synchronize()


class _StreamDone:
    """A synchronous call's end, where the backend hands back no work (NCCL with ``async_op=False``: the call
    runs on the caller's current stream, and torch's ``dist.all_reduce`` then has nothing to wait on): an event
    recorded on that stream after the call, which the poller asks as it asks a work. Recording it adds
    nothing the stream waits for. Seen on torch 2.11 with NCCL 2.28 (``tests/test_capture_nccl.py``)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(tensors[0].device))

    def is_completed(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if type(x) is list and len(x) == 1 and type(x[0]) is torch.Tensor:  # the usual argument: one plain tensor
        return x  # read, never changed, by the caller
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

    def __init__(
        self,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        name: str,
        real: Any,
        *,
        futures: bool = False,
        cpu: Any = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is the Python-subclass form
        self.global_ranks = tuple(global_ranks) or tuple(range(size))
        self._name = name
        self._real = real
        self._futures = futures
        """Whether the real backend completes a work's future when the call ends (gloo: stamped in C++)."""
        self._cpu = cpu
        """The gloo backend of an NCCL group's CPU tensors, where the job asked for both (``cpu:gloo,cuda:nccl``,
        or no backend on a CUDA machine, which torch reads so); None otherwise."""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _recorded(
        self,
        op: Op,
        tensors: list[torch.Tensor],
        method: str,
        args: tuple[Any, ...],
        peer: int | None = None,
        root: int | None = None,
    ) -> Any:
        """Record the call, post it on its real backend (``method(*args)``), and hand back its work: as it is
        where its end is stamped in C++ (``commgate.run.stamps``), else timed at the caller's wait. The
        issue path of every captured call: kept to what it must do (``benchmarks/capture_cost.py``)."""
        cpu = self._cpu
        real = cpu if cpu is not None and tensors and not tensors[0].is_cuda else self._real
        post = getattr(real, method, None) or functools.partial(self._per_tensor, real, method)
        rec = RECORDER
        if rec is None:
            return post(*args)
        seq = rec.issue(op, self.global_ranks, tensors, peer, root)
        work = post(*args)
        if work is None:  # a synchronous call: NCCL's with async_op=False posts on the caller's stream, no work
            if tensors and tensors[0].is_cuda:
                rec.watch(seq, _StreamDone(tensors))
            else:
                rec.complete(seq)
            return None
        handed = rec.watch(seq, work, self._futures or real is cpu, method)
        return handed if handed is not None else _timed(work, rec, seq)

    def _per_tensor(self, backend: Any, method: str, *args: Any) -> Any:
        """A coalesced ``method`` the backend lacks (``_PER_TENSOR``), posted one call per tensor and joined."""
        outputs, inputs, opts = args
        works = [getattr(backend, _PER_TENSOR[method])(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        try:
            future = torch.futures.collect_all([w.get_future() for w in works])
        except RuntimeError:  # gloo's reduce-scatter works have no future (DTensor's sequence-parallel path)
            for w in works:
                w.wait()
            future = torch.futures.Future()
            future.set_result(outputs)
            return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]
        return _Joined(works, future)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._recorded(Op.SEND, tensors, "send", (tensors, dst, tag), self.global_ranks[dst])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._recorded(Op.RECV, tensors, "recv", (tensors, src, tag), self.global_ranks[src])

    def barrier(self, opts: Any = None) -> Any:
        return self._recorded(Op.BARRIER, [], "barrier", () if opts is None else (opts,))


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
        return self._recorded(op, tensors, method, args, None, root)

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


def _creator(inner: str, cpu_too: bool) -> Callable[[Any, Any], CapturingProcessGroup]:
    device, kind = _INNER[inner]

    def create(opts: Any, backend_options: Any) -> CapturingProcessGroup:
        real: Any
        registered: Any = None
        cpu: Any = None
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
            # the options torch's own _new_process_group_helper gives NCCL: the group's name and ranks are what
            # NCCL's Flight Recorder writes into a dump's pg_config
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts.is_high_priority_stream = False
            nccl_opts._timeout = opts.timeout
            nccl_opts.global_ranks_in_group = list(opts.global_ranks_in_group)
            nccl_opts.group_name = opts.group_id
            real = dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_opts)
            real._set_sequence_number_for_group()  # as torch does for an NCCL group it makes
            if cpu_too:  # its CPU tensors on gloo, as torch's cpu:gloo,cuda:nccl (a store prefix each, as torch's)
                from torch.distributed.distributed_c10d import PrefixStore

                store = PrefixStore("cpu/", opts.store)
                cpu = dist.ProcessGroupGloo(store, opts.group_rank, opts.group_size, opts.timeout)
                _LIVE_BACKENDS.append(cpu)
        pg = CapturingProcessGroup(
            opts.group_rank,
            opts.group_size,
            list(opts.global_ranks_in_group),
            opts.group_id,
            real,
            futures=kind_here == ProcessGroup.BackendType.GLOO,
            cpu=cpu,
        )
        pg._register_backend(torch.device(device), kind_here, registered or real)
        if cpu is not None:
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, cpu)
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


def install(
    inner: str,
    rank: int,
    real: Sequence[int] = (),
    *,
    recorder: Callable[[int], Recorder] = Recorder,
    cpu_too: bool = False,
) -> Recorder:
    """Register the ``commgate`` backend over ``inner`` (gloo, nccl, or emulated with the ``real`` ranks
    started) and start recording with ``recorder(rank)`` (a rank with planted faults on its calls hands in
    ``commgate.run.planted.recorder``'s). ``cpu_too``: an NCCL group's CPU tensors go to gloo, as torch does
    for ``cpu:gloo,cuda:nccl``."""
    global RECORDER, REAL_RANKS
    REAL_RANKS = frozenset(real)
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        cpu_too = cpu_too and inner == "nccl"
        devices = [_INNER[inner][0], *(["cpu"] if cpu_too else [])]
        dist.Backend.register_backend(BACKEND_NAME, _creator(inner, cpu_too), extended_api=True, devices=devices)
    global INSTALLED
    RECORDER = INSTALLED = recorder(rank)
    return RECORDER
