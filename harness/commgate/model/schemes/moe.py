"""DeepSpeed MoE expert parallelism: each MoE layer dispatches tokens to experts and combines them
back with an all-to-all over the expert-parallel group, twice in the forward and twice in the
backward (and again when activations are recomputed). With ``drop_tokens`` (DeepSpeed's default) the
dispatched tensor is [experts, capacity, h] with capacity = max(ceil(k * tokens / experts *
capacity_factor), min_capacity), tokens = b*s per rank, as in ``deepspeed.moe.sharded_moe``.
The paper has no MoE equation: this traffic is reported as not in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.schemes.data_parallel import DataParallel


def capacity(ctx: Context) -> int:
    par, m = ctx.scenario.parallelism, ctx.scenario.model
    assert par.moe is not None
    tokens = par.micro_batch * m.s
    return max(math.ceil(tokens / par.moe.experts * par.moe.capacity_factor * par.moe.top_k), par.moe.min_capacity)


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        assert par.moe is not None
        layers = m.L // par.moe.every
        elements = par.moe.experts * capacity(ctx) * m.h
        per_pass = 2 * layers * par.micro_batches
        groups = ctx.layout.ep_groups()
        phases = [(Phase.FORWARD, "forward")]
        if par.activation_checkpointing:
            phases.append((Phase.BACKWARD, "recompute"))
        phases.append((Phase.BACKWARD, "backward"))
        return [
            ExpectedCollective(
                op=Op.ALL_TO_ALL,
                axis="ep",
                groups=groups,
                dtype=m.dtype,
                elements=elements,
                calls=per_pass,
                phase=phase,
                source=f"MoE dispatch/combine all-to-all ({what})",
            )
            for phase, what in phases
        ]

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return []

    def residuals(self, ctx: Context) -> list[Residual]:
        return []


@dataclass(frozen=True, slots=True)
class MoEDataParallel(DataParallel):
    """DeepSpeed's engine (ZeRO stage 0) around an MoE model: every parameter broadcast as bytes at
    construction — dense ones over the data-parallel group, a rank's own experts over its expert-data-
    parallel group —, then every step one all-reduce of the dense gradients over data parallel, one of
    the expert gradients over expert data parallel (buckets of ``reduce_bucket_size``), and the gradient
    norm's all-reduce over data parallel. Paper: Eq. 2 (named terms for the experts)."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        from commgate.model.schemes._common import init_broadcast
        from commgate.model.schemes.ddp import coalesced_chunks
        from commgate.model.schemes.deepspeed_zero import _init_broadcasts

        par = ctx.scenario.parallelism
        assert par.moe is not None
        local = par.moe.experts // par.moe.ep
        dense = tuple(p for p in ctx.params if not p.expert)
        mine = tuple(p for p in ctx.params if p.expert and int(p.name.split("experts.")[1].split(".")[0]) < local)
        rows: list[ExpectedCollective] = []
        for what, axis, groups, params in (
            ("", "dp", ctx.layout.dp_groups(), dense),
            ("expert ", "edp", ctx.layout.edp_groups(), mine),
        ):
            base = init_broadcast(ctx, elements=0, groups=groups, axis=axis, what=what)  # type: ignore[arg-type]
            rows += _init_broadcasts(ctx, base, 1, params=params)
            step = replace(base, op=Op.ALL_REDUCE, once=False, phase=Phase.BACKWARD, paper_term="Eq. 2")
            buckets = coalesced_chunks([p.numel for p in reversed(params)], par.zero.bucket_elements)
            rows += [
                replace(step, elements=b, source=f"DeepSpeed {what}gradient all-reduce, bucket {i} of {len(buckets)}")
                for i, b in enumerate(buckets)
            ]
        norm = replace(
            rows[-1],
            axis="dp",
            groups=ctx.layout.dp_groups(),
            elements=1,
            phase=Phase.OPTIMIZER,
            paper_term=None,
            source="DeepSpeed gradient-norm all-reduce",
        )
        return [*rows, norm]
