"""DeepSpeed ZeRO stages 1-3 as DeepSpeed 0.19 runs them on torch 2.x (measured through the capture and
read from ``deepspeed/runtime/engine.py`` and ``deepspeed/runtime/zero/``), with the workload's config
(``commgate.run.workloads.zero``): client AdamW, ``reduce_bucket_size = allgather_bucket_size =
bucket_elements``, ZeRO-3 releasing parameters after use and prefetching nothing.

ZeRO-1/2 (``stage_1_and_2.py``)
* Construction: ``_broadcast_model`` broadcasts every parameter from rank 0, as bytes (a uint8 view).
* Backward: gradients are reduced with **all-reduce** (not the reduce-scatter Eq. 2 assumes), in
  buckets filled in gradient-ready order (reverse registration) and flushed before one would pass
  ``reduce_bucket_size`` elements.
* Optimizer: the gradient norm is all-reduced (one fp32), then the updated fp32 partitions are
  all-gathered into the flat parameter buffer (one call).

ZeRO-3 (``stage3.py``, ``partitioned_param_coordinator.py``)
* Construction: every parameter is broadcast twice as bytes and all-gathered once; three barriers.
* Each step: every module's own parameters are all-gathered before its forward and again before its
  backward (one call per module, its parameters coalesced); the gradients are reduce-scattered in
  buckets as above; the gradient norm is all-reduced (one float64).
* Steps 0 and 1 also carry the coordinator's trace broadcasts (int64): step 0 one of 1 element and one
  empty; step 1 three of 1 element, one of 3 x (modules with parameters), two of 2 x (parameters).

ZeRO++ (the same engine with ``zero_hpz_partition_size``): hpZ keeps a secondary copy of the
parameters partitioned within groups of hpz ranks, and the backward all-gathers come from it, over those
groups; everything else is ZeRO-3's. Its quantized weights and gradients (qwZ, qgZ) run on GPUs only
(DeepSpeed's quantizer has no CPU kernel); for them the paper-level ZeRO++ model stands.

Partition padding: ZeRO-1/2 pad their flat buffer to a multiple of 2 x d elements, ZeRO-3 each
parameter to a multiple of d; the padded sizes are what is gathered and reduce-scattered, and the
difference to Eq. 2/3 is the named term "partition padding".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, Phase, Residual
from commgate.model.schemes._common import padded
from commgate.model.schemes.data_parallel import DataParallel
from commgate.model.schemes.ddp import coalesced_chunks
from commgate.model.schemes.zero3 import Zero3
from commgate.model.transformer import ParamTensor


def modules(params: tuple[ParamTensor, ...], over: int = 1) -> list[int]:
    """Parameters per module that owns parameters, in registration order (``a.b.weight`` -> ``a.b``),
    each parameter padded to a multiple of ``over`` (its ZeRO-3 partitioning)."""
    sizes: dict[str, int] = {}
    for p in params:
        owner = p.name.rsplit(".", 1)[0]
        sizes[owner] = sizes.get(owner, 0) + padded(p.numel, over)
    return list(sizes.values())


def _padding(
    ctx: Context, term: str, rows: list[ExpectedCollective], unpadded: list[ExpectedCollective]
) -> list[Residual]:
    """The named term for partition padding: rank 0's paper-weighted bytes of the padded rows minus
    those of the same rows unpadded (none when nothing is padded)."""

    def volume(rs: list[ExpectedCollective]) -> Fraction:
        return sum(
            (r.paper_bytes_per_step for r in rs if r.paper_term == term and not r.once and 0 in r.participants()),
            Fraction(0),
        )

    extra = volume(rows) - volume(unpadded)
    if not extra:
        return []
    d = ctx.scenario.parallelism.dp
    detail = f"DeepSpeed pads partitioned parameters so that each of the d={d} ranks holds an equal share"
    return [Residual(term=term, name="partition padding", bytes=extra, detail=detail)]


def _init_broadcasts(
    ctx: Context, base: ExpectedCollective, times: int, params: tuple[ParamTensor, ...] | None = None
) -> list[ExpectedCollective]:
    """The engine's broadcast of each parameter (a rank's tensor-parallel shard of it) at construction."""
    isz, tp = ctx.scenario.model.itemsize, ctx.scenario.parallelism.tp
    return [
        replace(
            base,
            op=Op.BROADCAST,
            dtype="uint8",
            elements=p.numel_per_tp_rank(tp) * isz,
            calls=times,
            source="DeepSpeed initial parameter broadcast (per parameter, as bytes)",
        )
        for p in (ctx.params if params is None else params)
    ]


def _init_row(ctx: Context, op: Op) -> ExpectedCollective:
    """A once-per-run row over the data-parallel groups, in the model's dtype, to derive the others from."""
    return ExpectedCollective(
        op=op,
        axis="dp",
        groups=ctx.layout.dp_groups(),
        dtype=ctx.scenario.model.dtype,
        elements=0,
        calls=1,
        phase=Phase.INIT,
        source="",
        once=True,
    )


def _gradient_buckets(ctx: Context, over: int = 1) -> list[int]:
    z = ctx.scenario.parallelism.zero
    return coalesced_chunks([padded(p.numel, over) for p in reversed(ctx.params)], z.bucket_elements)


@dataclass(frozen=True, slots=True)
class DeepSpeedZero12(DataParallel):
    def collectives(self, ctx: Context, *, pad: bool = True) -> list[ExpectedCollective]:
        zs, d = ctx.scenario.parallelism.zero.stage, ctx.scenario.parallelism.dp
        base = _init_row(ctx, Op.ALL_REDUCE)
        rows = _init_broadcasts(ctx, base, 1)
        step = replace(base, once=False, phase=Phase.BACKWARD, paper_term="Eq. 2")
        for i, b in enumerate(buckets := _gradient_buckets(ctx)):
            rows.append(
                replace(step, elements=b, source=f"ZeRO-{zs} gradient all-reduce, bucket {i} of {len(buckets)}")
            )
        rows.append(
            replace(
                step,
                op=Op.ALL_REDUCE,
                elements=1,
                phase=Phase.OPTIMIZER,
                paper_term=None,
                source=f"ZeRO-{zs} gradient-norm all-reduce",
            )
        )
        rows.append(
            replace(
                step,
                op=Op.ALL_GATHER,
                # the flat buffer is padded to a multiple of 2 x d elements (nccl_start_alignment_factor)
                elements=padded(ctx.param_count, 2 * d) if pad else ctx.param_count,
                phase=Phase.OPTIMIZER,
                source=f"ZeRO-{zs} all-gather of the updated fp32 partitions",
            )
        )
        return rows

    def residuals(self, ctx: Context) -> list[Residual]:
        d = ctx.scenario.parallelism.dp
        extra = Residual(
            term="Eq. 2",
            name="gradients all-reduced, not reduce-scattered",
            bytes=Fraction(d - 1, d) * ctx.param_count * ctx.scenario.model.itemsize,
            detail="DeepSpeed reduces ZeRO-1/2 gradients with all_reduce (2N(d-1)/d); Eq. 2 assumes "
            "reduce_scatter (N(d-1)/d) + all_gather",
        )
        padding = _padding(ctx, "Eq. 2", self.collectives(ctx), self.collectives(ctx, pad=False))
        return [*DataParallel.residuals(self, ctx), extra, *padding]


@dataclass(frozen=True, slots=True)
class DeepSpeedZero3(Zero3):
    def collectives(self, ctx: Context, *, pad: bool = True) -> list[ExpectedCollective]:
        z, d = ctx.scenario.parallelism.zero, ctx.scenario.parallelism.dp
        if z.qwz or z.qgz:  # quantized collectives: DeepSpeed runs them on GPUs only; the plain model
            return Zero3.collectives(self, ctx)
        over = d if pad else 1  # each parameter is partitioned (padded) on its own
        base = _init_row(ctx, Op.ALL_GATHER)
        rows = _init_broadcasts(ctx, base, 2)
        rows += [
            replace(base, elements=padded(p.numel, over), source="ZeRO-3 initial all-gather (per parameter)")
            for p in ctx.params
        ]
        rows.append(replace(base, op=Op.BARRIER, dtype="none", calls=3, source="ZeRO-3 construction barriers"))
        trace = replace(base, op=Op.BROADCAST, dtype="int64", phase=Phase.FORWARD, source="ZeRO-3 trace broadcast")
        n_modules = len(modules(ctx.params))
        rows += [
            replace(trace, elements=1, at_step=0),
            replace(trace, elements=0, at_step=0),
            replace(trace, elements=1, calls=3, at_step=1),
            replace(trace, elements=3 * n_modules, at_step=1),
            replace(trace, elements=2 * len(ctx.params), calls=2, at_step=1),
        ]
        step = replace(base, once=False, phase=Phase.FORWARD, paper_term="Eq. 3")
        # ZeRO++ hpZ: the backward gathers from the secondary partition, within hpz ranks
        hpz = {"axis": "hpz", "groups": ctx.layout.hpz_groups()} if z.hpz > 1 else {}
        for phase, where, groups in ((Phase.FORWARD, "", {}), (Phase.BACKWARD, ", hpZ" if hpz else "", hpz)):
            for size in modules(ctx.params, over):
                rows.append(
                    replace(
                        step,
                        phase=phase,
                        elements=size,
                        source=f"ZeRO-3 module parameter all-gather ({phase}{where})",
                        **groups,  # type: ignore[arg-type]
                    )
                )
        for i, b in enumerate(buckets := _gradient_buckets(ctx, over)):
            rows.append(
                replace(
                    step,
                    op=Op.REDUCE_SCATTER,
                    phase=Phase.BACKWARD,
                    elements=b,
                    source=f"ZeRO-3 gradient reduce-scatter, bucket {i} of {len(buckets)}",
                )
            )
        rows.append(
            replace(
                step,
                op=Op.ALL_REDUCE,
                dtype="float64",
                elements=1,
                phase=Phase.OPTIMIZER,
                paper_term=None,
                source="ZeRO-3 gradient-norm all-reduce (float64)",
            )
        )
        return rows

    def residuals(self, ctx: Context) -> list[Residual]:
        padding = _padding(ctx, "Eq. 3", self.collectives(ctx), self.collectives(ctx, pad=False))
        return [*Zero3.residuals(self, ctx), *padding]
