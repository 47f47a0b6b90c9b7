"""One table entry per communication op: its volume by the paper's definition and its bus factor.

``message bytes`` m of a call is the largest buffer it moves on one rank: all_reduce in = out;
all_gather the gathered output; reduce_scatter the input; all_to_all the input; broadcast, reduce,
send, recv the buffer. This is nccl-tests' "size" convention.

* paper volume (Anthony et al., Section III-A): all_reduce 2m(n-1)/n; all_gather, reduce_scatter, reduce
  m(n-1)/n; all_to_all m(n-1)/n; broadcast m(n-1)/n; send m (Eq. 4 counts a transfer once, at the
  sender); recv 0.
* bus factor (nccl-tests ``doc/PERFORMANCE.md``): all_reduce 2(n-1)/n; all_gather, reduce_scatter,
  all_to_all, gather, scatter (n-1)/n; broadcast, reduce, send 1 (recv 0: its bytes are counted on the
  matching send).
  ``wire bytes = m * bus factor``, with n the size of the group that ran the call; a size-1 group
  sends nothing.
* traffic: who sends how much to whom, assuming ring algorithms (rank i of the group sends to rank
  i+1; NCCL's and gloo's default for large messages), pairwise exchange for all_to_all, and a
  pipelined chain from/to the root for broadcast/reduce. A rooted op's group lists its root first
  (predicted rows so, and captured calls by their recorded ``root``).
* sweep: the microbenchmark that measures the op's cost in the effective-bandwidth curve (reduce,
  gather, scatter and barrier are not swept; they move at most what their all-* counterpart moves, so
  the curve is an upper bound for them; send and recv are measured as a ring of send/recv pairs).
* bindings: the c10d ``ProcessGroup`` methods that issue the op, which the capturing process group
  overrides (``commgate.run.interpose``).

This table and ``Op`` are the one description of the ops: the model, the capture, the reconciliation,
the bandwidth curve and the microbenchmarks all read them.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

from commgate.model.layout import Group


class Op(str, enum.Enum):
    """A communication op; equal to (and hashed as) its name, which is how captures and reports store it."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SEND = "send"
    RECV = "recv"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"

    def __str__(self) -> str:
        return self.value


Traffic = Iterator[tuple[int, int, Fraction]]


def _ring(group: Group, nbytes: Fraction) -> Traffic:
    n = len(group)
    if n > 1:
        for i, src in enumerate(group):
            yield src, group[(i + 1) % n], nbytes


def _pairwise(group: Group, nbytes: Fraction) -> Traffic:
    n = len(group)
    for src in group:
        for dst in group:
            if src != dst:
                yield src, dst, nbytes / (n - 1)


def _chain_from_root(group: Group, nbytes: Fraction) -> Traffic:
    for a, b in itertools.pairwise(group):
        yield a, b, nbytes


def _chain_to_root(group: Group, nbytes: Fraction) -> Traffic:
    for a, b in itertools.pairwise(group):
        yield b, a, nbytes


def _first_to_second(group: Group, nbytes: Fraction) -> Traffic:
    yield group[0], group[1], nbytes


def _root_to_each(group: Group, nbytes: Fraction) -> Traffic:
    for dst in group[1:]:
        yield group[0], dst, nbytes / (len(group) - 1)


def _each_to_root(group: Group, nbytes: Fraction) -> Traffic:
    for src in group[1:]:
        yield src, group[0], nbytes / (len(group) - 1)


def _nothing(group: Group, nbytes: Fraction) -> Traffic:
    return iter(())


@dataclass(frozen=True, slots=True)
class Binding:
    """A c10d ``ProcessGroup`` method that issues an op."""

    name: str
    """The method the capturing process group overrides."""
    buffer_arg: int
    """Which argument holds the message buffer (the output of gathers, the input of scatters)."""
    real: str
    """The real backend's method that runs it."""


@dataclass(frozen=True, slots=True)
class OpSpec:
    op: Op
    paper: Callable[[int], Fraction]
    """Paper volume per message byte, for a group of n ranks."""
    bus: Callable[[int], Fraction]
    """nccl-tests bus-bandwidth factor (wire bytes per message byte) for a group of n ranks."""
    traffic: Callable[[Group, Fraction], Traffic]
    """(src, dst, bytes) given the group and the call's wire bytes per rank."""
    senders: Callable[[int], int]
    """How many ranks of a group of n send the wire bytes (n for rings and all-to-all, n-1 for chains)."""
    sweep: str
    """The microbenchmark whose latency stands for this op in the bandwidth curve."""
    p2p: bool = False
    rooted: bool = False
    """The call names a root rank (broadcast, reduce, gather, scatter)."""
    bindings: tuple[Binding, ...] = ()


def _frac(k: int) -> Callable[[int], Fraction]:
    return lambda n: Fraction(k * (n - 1), n)


def _const(k: int) -> Callable[[int], Fraction]:
    return lambda n: Fraction(k) if n > 1 else Fraction(0)


def _all(n: int) -> int:
    return n


def _all_but_one(n: int) -> int:
    return n - 1


def _one(n: int) -> int:
    return 1


def _b(name: str, arg: int = 0, real: str | None = None) -> Binding:
    return Binding(name, arg, real or name)


OPS: dict[Op, OpSpec] = {
    s.op: s
    for s in (
        OpSpec(
            Op.ALL_REDUCE,
            _frac(2),
            _frac(2),
            _ring,
            _all,
            "all_reduce",
            bindings=(_b("allreduce"), _b("allreduce_coalesced")),
        ),
        OpSpec(
            Op.ALL_GATHER,
            _frac(1),
            _frac(1),
            _ring,
            _all,
            "all_gather",
            bindings=(
                _b("allgather"),
                _b("all_gather_single", real="_allgather_base"),
                _b("_allgather_base"),  # all_gather_into_tensor's call before torch 2.13 renamed it
                _b("allgather_coalesced"),
                _b("allgather_into_tensor_coalesced"),
                _b("all_gather_single_coalesced", real="allgather_into_tensor_coalesced"),  # the coalescing manager
            ),
        ),
        OpSpec(
            Op.REDUCE_SCATTER,
            _frac(1),
            _frac(1),
            _ring,
            _all,
            "reduce_scatter",
            bindings=(
                _b("reduce_scatter", 1),
                _b("reduce_scatter_single", 1, "_reduce_scatter_base"),
                _b("_reduce_scatter_base", 1),  # reduce_scatter_tensor's call before torch 2.13
                _b("reduce_scatter_tensor_coalesced", 1),
                _b("reduce_scatter_single_coalesced", 1, "reduce_scatter_tensor_coalesced"),
            ),
        ),
        OpSpec(
            Op.ALL_TO_ALL,
            _frac(1),
            _frac(1),
            _pairwise,
            _all,
            "all_to_all",
            bindings=(_b("alltoall", 1), _b("all_to_all_single", 1, "alltoall_base"), _b("alltoall_base", 1)),
        ),
        OpSpec(
            Op.BROADCAST,
            _frac(1),
            _const(1),
            _chain_from_root,
            _all_but_one,
            "broadcast",
            rooted=True,
            bindings=(_b("broadcast"),),
        ),
        OpSpec(
            Op.REDUCE,
            _frac(1),
            _const(1),
            _chain_to_root,
            _all_but_one,
            "all_reduce",
            rooted=True,
            bindings=(_b("reduce"),),
        ),
        OpSpec(Op.SEND, _const(1), _const(1), _first_to_second, _one, "send_recv", p2p=True),
        OpSpec(Op.RECV, _const(0), _const(0), _nothing, _one, "send_recv", p2p=True),
        OpSpec(
            Op.GATHER,
            _frac(1),
            _frac(1),
            _each_to_root,
            _one,
            "all_gather",
            rooted=True,
            bindings=(_b("gather"),),
        ),
        OpSpec(
            Op.SCATTER,
            _frac(1),
            _frac(1),
            _root_to_each,
            _one,
            "reduce_scatter",
            rooted=True,
            bindings=(_b("scatter", 1),),
        ),
        OpSpec(Op.BARRIER, _const(0), _const(0), _nothing, _one, "all_reduce"),
    )
}

SWEEPS: dict[str, Op] = {
    "all_reduce": Op.ALL_REDUCE,
    "all_gather": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "all_to_all": Op.ALL_TO_ALL,
    "broadcast": Op.BROADCAST,
    "send_recv": Op.SEND,
}
"""The microbenchmarks (nccl-tests' set), each by the op whose bus factor converts its algbw: every
``OpSpec.sweep`` names one of them."""


def bus_factor(sweep: str, n: int) -> float:
    """busbw / algbw of microbenchmark ``sweep`` in a group of ``n`` ranks (nccl-tests)."""
    return float(OPS[SWEEPS[sweep]].bus(n))


def add_traffic(op: Op | str, group: Group, wire: Fraction, into: dict[tuple[int, int], Fraction]) -> None:
    """Add one call's (src, dst, bytes) to the sparse traffic matrix ``into``."""
    for src, dst, nbytes in OPS[Op(op)].traffic(group, wire):
        into[(src, dst)] = into.get((src, dst), Fraction(0)) + nbytes
