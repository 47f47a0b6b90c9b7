"""DeepSpeed MoE expert parallelism: each MoE layer dispatches tokens to experts and combines them
back with an all-to-all over the expert-parallel group, twice in the forward and twice in the
backward (and again when activations are recomputed). With ``drop_tokens`` (DeepSpeed's default) the
dispatched tensor is [experts, capacity, h] with capacity = max(ceil(k * tokens / experts *
capacity_factor), min_capacity), tokens = b*s per rank, as in ``deepspeed.moe.sharded_moe``.
The paper has no MoE equation: this traffic is reported as not in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.collectives import Op
from harness.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual


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
