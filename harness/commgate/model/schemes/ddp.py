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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, Phase
from commgate.model.schemes.data_parallel import TERM, DataParallel
from commgate.model.transformer import ParamTensor

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25
BROADCAST_BUCKET_BYTES = 250 * MIB  # DistributedDataParallel.broadcast_bucket_size


def buckets_by_size(sizes: list[int], limits: list[int]) -> list[int]:
    """Bucket sizes (bytes) as the reducer assigns them: a bucket closes once it reaches its limit."""
    out, current, i = [], 0, 0
    for n in sizes:
        current += n
        if current >= limits[min(i, len(limits) - 1)]:
            out.append(current)
            current, i = 0, i + 1
    if current:
        out.append(current)
    return out


def coalesced_chunks(sizes: list[int], limit: int) -> list[int]:
    """Chunks of ``_broadcast_coalesced``: tensors are added until the next would pass ``limit``."""
    out, current = [], 0
    for n in sizes:
        if current and current + n > limit:
            out.append(current)
            current = 0
        current += n
    if current:
        out.append(current)
    return out


def rebuilt_buckets(ready: tuple[ParamTensor, ...], itemsize: int, bucket_mb: float | None, tp: int = 1) -> list[int]:
    """Elements per bucket after DDP's rebuild, in the order they are all-reduced, from the parameters
    in the order their gradients became ready (a rank's tensor-parallel shards with ``tp`` > 1)."""
    cap = int((bucket_mb if bucket_mb is not None else DEFAULT_BUCKET_MB) * MIB)
    limits = [FIRST_BUCKET_BYTES, cap] if bucket_mb is None else [cap]
    sizes = [p.numel_per_tp_rank(tp) * itemsize for p in ready]
    return [b // itemsize for b in buckets_by_size(sizes, limits)]


@dataclass(frozen=True, slots=True)
class DistributedDataParallel(DataParallel):
    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s, m = ctx.scenario, ctx.scenario.model
        par, params, isz = s.parallelism, ctx.params, m.itemsize
        if par.dp == 1:  # tensor parallelism alone: no DDP
            return []
        groups = ctx.layout.dp_groups()  # one per tensor-parallel rank with tp > 1
        n = ctx.rank_params(0)  # with tp > 1 the rank's shards
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
            replace(init, op=Op.ALL_GATHER, elements=par.dp, source="DDP parameter check: count (all_gather, int64)"),
            replace(
                init,
                elements=2 * sum(len(p.shape) for p in params),
                source="DDP parameter check: sizes and strides (broadcast, int64)",
            ),
        ]
        for chunk in coalesced_chunks([p.numel_per_tp_rank(par.tp) * isz for p in params], BROADCAST_BUCKET_BYTES):
            rows.append(
                replace(init, dtype=m.dtype, elements=chunk // isz, source="DDP initial module-state broadcast")
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
                )
            )
        return rows
