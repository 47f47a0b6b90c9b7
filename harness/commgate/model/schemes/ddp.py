"""torch ``DistributedDataParallel`` as it runs on torch 2.x (read from ``torch/nn/parallel/distributed.py``
and measured): Eq. 2 with DDP's buckets, its construction-time checks, and its bucket rebuild.

* Construction: an all-gather of one int64 per rank and a broadcast of every parameter's sizes and
  strides (int64, 2 x the number of dimensions) verify the parameters match across ranks; then the
  module state is broadcast from rank 0 in coalesced chunks of at most 250 MiB.
* First iteration: with ``find_unused_parameters=False`` DDP starts with a single bucket, so the
  gradients go in one all-reduce.
* Second iteration: the reducer rebuilds its buckets in the order gradients became ready (reverse
  registration order for the built-in decoder; a user's module's as measured on the meta device) and
  broadcasts the new assignment from rank 0: one int32 per parameter plus the bucket count, then one
  int32 per bucket (their sizes). A bucket closes once it holds at least its cap: 1 MiB for the first
  bucket and 25 MiB after, when ``bucket_cap_mb`` is left at its default; the given cap throughout
  otherwise.
* From then on every step all-reduces each rebuilt bucket once.

With ``find_unused_parameters`` (a knob of the component: Hugging Face's Trainer turns it on, commgate's
own workloads do not) the reducer never rebuilds: its buckets are the initial assignment by size, in
registration order, 1 MiB first and 25 MiB after unless ``bucket_cap_mb`` is given, from the first
iteration on; and every synchronised backward all-reduces the map of the parameters used (one int32 per
parameter with a gradient) before the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, Phase
from commgate.model.schemes.data_parallel import TERM, DataParallel
from commgate.model.transformer import WIRE_ITEMSIZE, ParamTensor

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25
BROADCAST_BUCKET_BYTES = 250 * MIB  # DistributedDataParallel.broadcast_bucket_size


def bucket_assignment(
    tensors: Sequence[tuple[str, int]], limits: Sequence[int], *, ordered: bool = False
) -> list[tuple[str, list[int]]]:
    """torch's ``compute_bucket_assignment_by_size`` (``torch.distributed._compute_bucket_assignment_by_size``)
    for tensors given as (dtype, bytes): one open bucket per dtype, closed once it reaches its limit
    (``limits`` in turn, per dtype, the last repeated), the open ones closed at the end; then sorted by
    the smallest tensor index each holds, unless the tensors are ``ordered`` (the reducer's gradient-ready
    order). Returns each bucket's dtype and tensor indices."""
    open_: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    closed: dict[str, int] = {}
    out: list[tuple[str, list[int]]] = []
    for i, (dtype, nbytes) in enumerate(tensors):
        open_.setdefault(dtype, []).append(i)
        filled[dtype] = filled.get(dtype, 0) + nbytes
        if filled[dtype] >= limits[min(closed.get(dtype, 0), len(limits) - 1)]:
            out.append((dtype, open_.pop(dtype)))
            filled[dtype], closed[dtype] = 0, closed.get(dtype, 0) + 1
    out += list(open_.items())
    return out if ordered else sorted(out, key=lambda bucket: min(bucket[1]))


def buckets_by_size(sizes: list[int], limits: list[int]) -> list[int]:
    """Bucket sizes (bytes) as the reducer assigns them to gradients of one dtype in ready order."""
    return [sum(sizes[i] for i in idx) for _, idx in bucket_assignment([("", n) for n in sizes], limits, ordered=True)]


def coalesced_chunks(tensors: Sequence[tuple[str, int]], limit: int) -> list[tuple[str, int]]:
    """(dtype, bytes) of each broadcast ``_broadcast_coalesced`` issues for tensors given as (dtype,
    bytes): one flat tensor per bucket of ``bucket_assignment``."""
    return [(dtype, sum(tensors[i][1] for i in idx)) for dtype, idx in bucket_assignment(tensors, [limit])]


def rebuilt_buckets(ready: tuple[ParamTensor, ...], itemsize: int, bucket_mb: float | None, tp: int = 1) -> list[int]:
    """Elements per bucket after DDP's rebuild, in the order they are all-reduced, from the parameters
    in the order their gradients became ready (a rank's tensor-parallel shards with ``tp`` > 1)."""
    cap = int((bucket_mb if bucket_mb is not None else DEFAULT_BUCKET_MB) * MIB)
    limits = [FIRST_BUCKET_BYTES, cap] if bucket_mb is None else [cap]
    sizes = [p.numel_per_tp_rank(tp) * itemsize for p in ready]
    return [b // itemsize for b in buckets_by_size(sizes, limits)]


def initial_buckets(params: tuple[ParamTensor, ...], itemsize: int, bucket_mb: float | None, tp: int = 1) -> list[int]:
    """Elements per bucket of the reducer's initial assignment with ``find_unused_parameters`` (torch's
    ``BucketCapacityConfig.compute_bucket_size_limits`` then ``_compute_bucket_assignment_by_size``): the
    parameters in registration order, 1 MiB first and ``bucket_cap_mb`` (25 MiB) after, or the given cap
    throughout."""
    cap = int((bucket_mb if bucket_mb is not None else DEFAULT_BUCKET_MB) * MIB)
    limits = [FIRST_BUCKET_BYTES, cap] if bucket_mb is None else [cap]
    sizes = [("", p.numel_per_tp_rank(tp) * itemsize) for p in params]
    return [sum(sizes[i][1] for i in idx) // itemsize for _, idx in bucket_assignment(sizes, limits)]


@dataclass(frozen=True, slots=True)
class DistributedDataParallel(DataParallel):
    find_unused_parameters: bool = False
    """DDP's ``find_unused_parameters`` (Hugging Face's Trainer turns it on for a model without activation
    checkpointing); commgate's own workloads leave it off."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s, m = ctx.scenario, ctx.scenario.model
        par, params, isz = s.parallelism, ctx.trainable, m.itemsize
        if par.data_ranks == 1:  # tensor parallelism alone: no DDP
            return []
        groups = ctx.layout.dp_groups()  # one per tensor-parallel rank with tp > 1
        # with tp > 1 the rank's shards; a user's module: its trainable parameters
        n = sum(p.numel for p in params) if m.module else ctx.rank_params(0)
        init = ExpectedCollective(
            op=Op.BROADCAST,
            axis="dp",
            groups=groups,
            dtype="int64",
            elements=0,
            calls=1,
            phase=Phase.INIT,
            source="",
            once=True,
        )
        rows = [
            replace(
                init, op=Op.ALL_GATHER, elements=par.data_ranks, source="DDP parameter check: count (all_gather, int64)"
            ),
            replace(
                init,
                elements=2 * sum(len(p.shape) for p in params),
                source="DDP parameter check: sizes and strides (broadcast, int64)",
            ),
        ]
        # the module state: every parameter (frozen ones too), then every buffer
        state = [(m.dtype, p.numel_per_tp_rank(par.tp) * isz) for p in ctx.params]
        buffers = [(b.dtype, int(b.numel * WIRE_ITEMSIZE[b.dtype])) for b in ctx.buffers]
        for dtype, chunk in coalesced_chunks(state + buffers, BROADCAST_BUCKET_BYTES):
            rows.append(
                replace(
                    init,
                    dtype=dtype,
                    elements=int(chunk / WIRE_ITEMSIZE[dtype]),
                    source="DDP initial module-state broadcast",
                )
            )
        # rank 0's buffers again before the first forward of each step: a forward under no_sync turns the
        # next one's sync off (require_forward_param_sync), the synchronised last one turns it back on
        for dtype, chunk in coalesced_chunks(buffers, BROADCAST_BUCKET_BYTES):
            rows.append(
                replace(
                    init,
                    dtype=dtype,
                    elements=int(chunk / WIRE_ITEMSIZE[dtype]),
                    once=False,
                    phase=Phase.FORWARD,
                    source="DDP buffer broadcast before the forward",
                )
            )
        grad = ExpectedCollective(
            op=Op.ALL_REDUCE,
            axis="dp",
            groups=groups,
            dtype=m.dtype,
            elements=n,
            calls=1,
            phase=Phase.BACKWARD,
            source="DDP first-iteration all-reduce (one initial bucket)",
            once=True,
            at_step=0,
        )
        if self.find_unused_parameters:
            return rows + self._unused_found(ctx, grad)
        rows.append(grad)
        buckets = rebuilt_buckets(ctx.ready_order, isz, par.ddp_bucket_mb, par.tp)
        if s.warmup_steps + s.steps > 1:
            rebuild = replace(init, dtype="int32", phase=Phase.FORWARD, at_step=1)
            rows += [
                replace(rebuild, elements=len(params) + 1, source="DDP bucket rebuild: parameter order (broadcast)"),
                replace(rebuild, elements=len(buckets), source="DDP bucket rebuild: bucket sizes (broadcast)"),
            ]
        for i, b in enumerate(buckets):
            rows.append(
                replace(
                    grad,
                    elements=b,
                    once=False,
                    at_step=None,
                    from_step=1,
                    paper_term=TERM,
                    source=f"DDP gradient all-reduce, bucket {i} of {len(buckets)}",
                    overlaps=True,
                )
            )
        return rows

    def _unused_found(self, ctx: Context, grad: ExpectedCollective) -> list[ExpectedCollective]:
        """Every step's rows with ``find_unused_parameters``: the used-parameter map, then the initial buckets
        (never rebuilt)."""
        par, params = ctx.scenario.parallelism, ctx.trainable
        used = replace(
            grad,
            dtype="int32",
            elements=len(params),
            once=False,
            at_step=None,
            source="DDP used-parameter map (find_unused_parameters)",
        )
        buckets = initial_buckets(params, ctx.scenario.model.itemsize, par.ddp_bucket_mb, par.tp)
        return [used] + [
            replace(
                used,
                dtype=grad.dtype,
                elements=b,
                paper_term=TERM,
                source=f"DDP gradient all-reduce, bucket {i} of {len(buckets)} (initial buckets, never rebuilt)",
                overlaps=True,
            )
            for i, b in enumerate(buckets)
        ]
