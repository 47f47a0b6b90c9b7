"""The emulating inner backend: one process plays one rank of a job of any world size (with pipeline stages,
one process per stage and tensor shard, ``started_ranks``, talking over gloo among themselves).

``commgate.run.interpose`` records every call and hands it to an inner backend; with ``emulated`` that
backend completes each call at once, in this process, with the right shapes, dtypes and completion
semantics (a finished ``Work`` whose future holds the output tensors, as DDP's communication hooks and
DeepSpeed's async handles expect), and exchanges no data. The peers are taken to hold what this rank holds
(data-parallel replicas of it): an all-reduce leaves the buffer as it is, an all-gather fills every slot
with this rank's input, a reduce-scatter keeps this rank's slice, a broadcast, reduce or barrier does
nothing, an all-to-all returns its input, a receive leaves its buffer. The calls the frameworks issue, and
so what the capture records, are those of the real job: their sizes, groups and counts do not depend on
the values. What does depend on values (an MoE router's choices, a loss-scale overflow) follows this rank's
data (a limit the README states).

torch's own ``FakeProcessGroup`` stands behind the process group for what torch asks of a backend object
(its device, its options); its works cannot be used, since their futures hold no tensors (DDP's reducer
stops on "expected the hook result is either a Tensor or a TensorList found None").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commgate.model.layout import Layout
from commgate.model.scenario import Scenario

if TYPE_CHECKING:
    import torch

BACKEND_TYPE = "emulated"


def started_ranks(scenario: Scenario) -> tuple[int, ...]:
    """The ranks a local run starts as processes: every rank; or, emulated, data-parallel index 0 of every
    pipeline stage and tensor shard (the asymmetric axes stay real, talking over gloo among themselves),
    rank 0 alone without pipeline stages. Every other rank is emulated: a group with one of them in it runs
    emulated."""
    par = scenario.parallelism
    if not scenario.emulate:
        return tuple(range(scenario.world_size))
    if par.pp == 1:
        return (0,)
    lay = Layout(dp=par.data_ranks, tp=par.tp, pp=par.pp)
    return tuple(lay.rank(pipe=p, data=0, model=m) for p in range(par.pp) for m in range(par.tp))


def _done(result: list[Any]) -> Any:
    import torch

    future: torch.futures.Future[list[Any]] = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]


class EmulatedBackend:
    """Rank ``rank`` of ``size``: the methods of a c10d backend's Python binding that the capturing process
    group calls (``commgate.model.collectives.OPS`` bindings' ``real`` names), each completed at once."""

    def __init__(self, rank: int, size: int, wire: Any = None, started: dict[int, int] | None = None) -> None:
        """``wire``: a real (gloo) backend over the ranks of this group that were started, whose group ranks
        ``started`` maps to their rank in it: a send or receive between two of them (DeepSpeed's pipeline
        engine sends between stages over the default group) goes over it for real."""
        self.rank, self.size = rank, size
        self.wire, self.started = wire, started or {}

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for slots, x in zip(outputs, inputs, strict=True):
            mine = x.clone()  # the input is often one of the slots (an in-place all-gather)
            for slot in slots:
                slot.copy_(mine)
        return _done(outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Any:
        output.view(self.size, -1).copy_(x.reshape(1, -1).clone())  # x is often a slice of output
        return _done([output])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for out, slots in zip(outputs, inputs, strict=True):
            out.copy_(slots[self.rank].clone())
        return _done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Any:
        output.copy_(x.reshape(self.size, -1)[self.rank].view_as(output).clone())  # output may be a slice of x
        return _done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for out, x in zip(outputs, inputs, strict=True):
            out.copy_(x.clone())
        return _done(outputs)

    def alltoall_base(
        self, output: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> Any:
        if output.numel() == x.numel():  # uneven splits: what the peers would send is unknown; left as is
            output.copy_(x.view_as(output).clone())
        return _done([output])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for slots in outputs:  # empty off the root
            mine = inputs[0].clone()
            for slot in slots:
                slot.copy_(mine)
        return _done(outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        if inputs:  # the root: its own slice
            outputs[0].copy_(inputs[0][self.rank].clone())
        return _done(outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        if self.wire is not None and dst in self.started:
            return self.wire.send(tensors, self.started[dst], tag)
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        if self.wire is not None and src in self.started:
            return self.wire.recv(tensors, self.started[src], tag)
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _done([])


REUSE_MIN_BYTES = 1 << 20
"""The smallest CPU allocation an emulated rank keeps for reuse once freed (``reuse_memory``)."""


def reuse_memory() -> bool:
    """From now on, this process's CPU tensors of at least ``REUSE_MIN_BYTES`` come from commgate's extension
    (``commgate.run.stamps``), which keeps a freed one for the next of its size instead of giving it back to the
    kernel, never holding more than the most they held live at once. An emulated rank stands for a rank of the
    full-size job: DeepSpeed makes a new full-size tensor for every parameter it gathers and frees it after use,
    and glibc maps every allocation over 32 MB afresh, so the kernel zeroed every gathered byte again at its
    first touch (over half the 13B ZeRO-3 run's time, docs/speed.md). What the frameworks run and the calls
    they issue are unchanged: only where the memory comes from. False where the extension is not built."""
    from commgate.run import stamps

    module = stamps.loaded()
    if module is None:
        return False
    module.reuse_memory(REUSE_MIN_BYTES)
    return True


def stand_in(rank: int, size: int) -> Any:
    """torch's fake backend, registered for the device so that torch's own queries find a backend."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(rank, size)
