"""Megatron-style tensor parallelism: per layer, the row-parallel attention and MLP outputs are
all-reduced in the forward and the column-parallel inputs' gradients in the backward; activation
checkpointing repeats the forward ones; the vocab-parallel embedding all-reduces once in the forward
and the vocab-parallel output layer its input gradient once in the backward. Paper: Eq. 5 (L -> L/p in 3D).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from harness.collectives import Op
from harness.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from harness.layout import Group
from harness.paper import eq5_tensor
from harness.schemes._common import micro_batches, rank0_term

TERM = "Eq. 5"


@dataclass(frozen=True, slots=True)
class TensorParallel:
    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par = ctx.scenario.parallelism
        per_stage = ctx.scenario.model.L // par.pp
        mb = par.micro_batches
        rows: list[ExpectedCollective] = []
        for stage in range(par.pp):
            groups = ctx.layout.tp_groups(stage)

            where = f", stage {stage}" if par.pp > 1 else ""

            def row(
                calls: int,
                phase: Phase,
                source: str,
                term: str | None = TERM,
                _g: tuple[Group, ...] = groups,
                _w: str = where,
            ) -> None:
                rows.append(
                    ExpectedCollective(
                        op=Op.ALL_REDUCE,
                        axis="tp",
                        groups=_g,
                        dtype=ctx.scenario.model.dtype,
                        elements=ctx.bsh,
                        calls=calls * mb,
                        phase=phase,
                        source=source + _w,
                        paper_term=term,
                    )
                )

            if stage == 0:
                row(1, Phase.FORWARD, "TP vocab-parallel embedding all-reduce")
            row(2 * per_stage, Phase.FORWARD, "TP forward all-reduce (row-parallel attention and MLP outputs)")
            if par.activation_checkpointing:
                row(2 * per_stage, Phase.BACKWARD, "TP recompute all-reduce (activation checkpointing)")
            row(2 * per_stage, Phase.BACKWARD, "TP backward all-reduce (column-parallel input gradients)")
            if stage == par.pp - 1:
                row(1, Phase.BACKWARD, "TP output-layer input-gradient all-reduce", None)
        return rows

    def _eq5(self, ctx: Context, recompute: bool = True) -> Fraction:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return eq5_tensor(L=Fraction(m.L, par.pp), b=par.micro_batch, s=m.s, h=m.h, t=par.tp, recompute=recompute)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        L = f"L/p={m.L}/{par.pp}" if par.pp > 1 else f"L={m.L}"
        return [
            rank0_term(
                ctx,
                equation=TERM,
                formula=f"(12L+2)*b*s*h*(t-1)/t, {L}, b={par.micro_batch}, s={m.s}, h={m.h}, t={par.tp}",
                elements=self._eq5(ctx),
            )
        ]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, isz = ctx.scenario.parallelism, ctx.scenario.model.itemsize
        out = []
        if not par.activation_checkpointing:
            out.append(
                Residual(
                    term=TERM,
                    name="no activation checkpointing",
                    bytes=(self._eq5(ctx, recompute=False) - self._eq5(ctx)) * isz,
                    detail="4 all-reduces per layer without recomputation; Eq. 5 assumes 6",
                )
            )
        if par.micro_batches > 1:
            out.append(micro_batches(TERM, self._eq5(ctx, par.activation_checkpointing) * isz, par.micro_batches))
        return out
