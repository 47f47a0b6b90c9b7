"""Capture every collective and point-to-point call, whoever issues it, by interposing a process group.

``install()`` registers a torch.distributed backend named ``commgate``. Its process groups are a
Python subclass of ``ProcessGroup`` with the *real* backend (gloo, or NCCL/RCCL) registered inside;
every op records a ``CapturedCall`` and then runs the C++ ``ProcessGroup`` implementation, which
dispatches to that real backend. Everything goes through it: DDP's C++ reducer, ``deepspeed.comm``,
DTensor's functional collectives, pipeline send/recv, subgroups made by ``new_group``.

Method names are those the pybind11 trampoline of ``ProcessGroup`` calls (``all_gather_single`` is
C++ ``_allgather_base`` ...). Calling ``super().<name>`` from a method of that very name reaches the
C++ base implementation (pybind11 does not re-enter an override from its own frame).

Timing: a collective's duration is issue -> completion of its future (gloo completes it on its worker
thread); send/recv works of gloo have no future, so they are wrapped in a ``Work`` that stamps the
completion when ``wait()`` returns.
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

from harness.capture import INIT_STEP, CapturedCall

BACKEND_NAME = "commgate"
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


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
        self.calls: list[CapturedCall] = []
        self.on_issue: Callable[[str], None] | None = None
        """Called with a description of each call as it is issued (the launcher's hang report)."""

    def now(self) -> int:
        t = time.perf_counter_ns()
        if self._t0 is None:
            self._t0 = t
        return t - self._t0

    def issue(self, *, op: str, group: Sequence[int], tensors: Sequence[torch.Tensor], peer: int | None) -> int:
        elements = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        seq = next(self._seq)
        rec = dict(
            rank=self.rank,
            seq=seq,
            step=self.step,
            phase=phase,
            op=op,
            group=tuple(group),
            peer=peer,
            dtype=DTYPES.get(dtype, dtype),
            elements=elements,
            bytes=nbytes,
            tensors=len(tensors),
            start_ns=self.now(),
        )
        with self._lock:
            self._open[seq] = rec
        if self.on_issue is not None:
            where = f"peer {peer}" if peer is not None else f"group {list(group)}"
            self.on_issue(f"{op} ({where}, {nbytes} B, step {self.step}, {phase})")
        return seq

    def complete(self, seq: int) -> None:
        end = self.now()
        with self._lock:
            rec = self._open.pop(seq, None)
            if rec is not None:
                self.calls.append(CapturedCall(**rec, duration_ns=end - rec["start_ns"]))

    def drain(self) -> list[CapturedCall]:
        """All calls, the never-completed ones with ``duration_ns=None``, in issue order."""
        with self._lock:
            pending = [CapturedCall(**rec, duration_ns=None) for rec in self._open.values()]
            return sorted(self.calls + pending, key=lambda c: c.seq)


RECORDER: Recorder | None = None


@contextlib.contextmanager
def optimizer_phase() -> Iterator[None]:
    """Mark the calls issued inside as the optimizer phase (a no-op when nothing is recorded)."""
    rec = RECORDER
    if rec is None:
        yield
        return
    before, rec.phase = rec.phase, "optimizer"
    try:
        yield
    finally:
        rec.phase = before


class _TimedWork(dist.Work):
    """A send/recv work that records its completion when waited on."""

    def __init__(self, inner: dist.Work, done: Callable[[], None]) -> None:
        super().__init__()
        self._inner, self._done = inner, done

    def wait(self, timeout: Any = None) -> bool:
        ok: bool = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._done()
        return ok

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)]


# name -> (op, which argument holds the message buffer)
_COLLECTIVES: dict[str, tuple[str, int]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "allgather": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 1),
}


class CapturingProcessGroup(ProcessGroup):
    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], name: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is the Python-subclass form
        self.global_ranks = tuple(global_ranks) or tuple(range(size))
        self._name = name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _record(self, op: str, tensors: list[torch.Tensor], peer: int | None = None) -> tuple[Recorder, int] | None:
        rec = RECORDER
        if rec is None:
            return None
        return rec, rec.issue(op=op, group=self.global_ranks, tensors=tensors, peer=peer)

    @staticmethod
    def _timed(token: tuple[Recorder, int] | None, work: Any) -> Any:
        if token is None:
            return work
        rec, seq = token
        try:
            work.get_future().then(lambda _f: rec.complete(seq))
        except RuntimeError:  # gloo p2p works have no future
            return _TimedWork(work, lambda: rec.complete(seq))
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        token = self._record("send", tensors, self.global_ranks[dst])
        return self._timed(token, super().send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        token = self._record("recv", tensors, self.global_ranks[src])
        return self._timed(token, super().recv(tensors, src, tag))

    def barrier(self, opts: Any = None) -> Any:
        token = self._record("barrier", [])
        work = super().barrier() if opts is None else super().barrier(opts)
        return self._timed(token, work)


def _make_collective(name: str, op: str, arg: int) -> Callable[..., Any]:
    """An override recording the tensors of argument ``arg`` (or, where that list is empty on this rank,
    as for scatter off the root, those of the other buffer argument)."""
    # The function must carry the trampoline's method name as its code name, so that its own
    # ``super()`` call reaches C++ instead of re-entering this override.
    source = (
        f"def {name}(self, *args):\n"
        f"    token = self._record({op!r}, _flat(args[{arg}]) or _flat(args[1 - {arg}]))\n"
        f"    return self._timed(token, super(CapturingProcessGroup, self).{name}(*args))\n"
    )
    namespace: dict[str, Any] = {"_flat": _flat, "CapturingProcessGroup": CapturingProcessGroup}
    exec(source, namespace)
    return namespace[name]  # type: ignore[no-any-return]


for _name, (_op, _arg) in _COLLECTIVES.items():
    setattr(CapturingProcessGroup, _name, _make_collective(_name, _op, _arg))


def _group_name(self: CapturingProcessGroup) -> str:
    return self._name


CapturingProcessGroup.group_name = property(_group_name)  # type: ignore[method-assign,assignment]

_INNER = {"gloo": ("cpu", ProcessGroup.BackendType.GLOO), "nccl": ("cuda", ProcessGroup.BackendType.NCCL)}


def _creator(inner: str) -> Callable[[Any, Any], CapturingProcessGroup]:
    device, kind = _INNER[inner]

    def create(opts: Any, backend_options: Any) -> CapturingProcessGroup:
        real: Any
        if inner == "gloo":
            real = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        else:
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = opts.timeout
            real = dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_opts)
        pg = CapturingProcessGroup(opts.group_rank, opts.group_size, list(opts.global_ranks_in_group), opts.group_id)
        pg._register_backend(torch.device(device), kind, real)
        return pg

    return create


def install(inner: str, rank: int) -> Recorder:
    """Register the ``commgate`` backend over ``inner`` (gloo or nccl) and start recording."""
    global RECORDER
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _creator(inner), extended_api=True, devices=[_INNER[inner][0]])
    RECORDER = Recorder(rank)
    return RECORDER
