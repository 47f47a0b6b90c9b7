"""DeepSpeed ZeRO-3 and ZeRO++: parameters are partitioned, so every step all-gathers them for the
forward and again for the backward, and reduce-scatters the gradients. Paper: Eq. 3.

ZeRO++ (Wang et al.): qwZ all-gathers int8 weights in the forward; hpZ keeps a secondary partition
within ``hpz`` ranks so the backward all-gather stays inside that group; qgZ replaces the gradient
reduce-scatter by an int4 all-to-all. Quantization scales are refined with the real runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.paper import eq3_zero3
from commgate.model.schemes._common import beyond_eq1, data_ranks, init_broadcast, rank0_term
from commgate.model.schemes.scheme import Rule

TERM = "Eq. 3"


def eq3_term(ctx: Context) -> PaperTerm:
    """Eq. 3 on rank 0: 3N(d-1)/d, ZeRO-3's volume, and FSDP's counterpart."""
    d = ctx.scenario.parallelism.data_ranks
    return rank0_term(
        ctx,
        equation=TERM,
        formula=f"3*N*(d-1)/d, N={ctx.eq1:,} ({ctx.eq1_name}), d={d}{data_ranks(ctx)}",
        elements=eq3_zero3(ctx.eq1, d),
    )


@dataclass(frozen=True, slots=True)
class Zero3:
    @property
    def rules(self) -> tuple[Rule, ...]:
        """None of its own: the engines built on it bring theirs."""
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        lay, z = ctx.layout, ctx.scenario.parallelism.zero
        n, dtype = ctx.param_count, ctx.scenario.model.dtype
        dp = lay.dp_groups()
        base = ExpectedCollective(
            op=Op.ALL_GATHER,
            axis="dp",
            groups=dp,
            dtype=dtype,
            elements=n,
            calls=1,
            phase=Phase.FORWARD,
            source="ZeRO-3 parameter all-gather (forward)",
            paper_term=TERM,
        )
        forward = (
            replace(base, dtype="int8", source="ZeRO-3 parameter all-gather (forward, qwZ int8)") if z.qwz else base
        )
        backward = replace(base, phase=Phase.BACKWARD, source="ZeRO-3 parameter all-gather (backward)")
        if z.hpz > 1:
            backward = replace(
                backward, axis="hpz", groups=lay.hpz_groups(), source="ZeRO-3 parameter all-gather (backward, hpZ)"
            )
        grads = replace(base, op=Op.REDUCE_SCATTER, phase=Phase.BACKWARD, source="ZeRO-3 gradient reduce-scatter")
        if z.qgz:
            grads = replace(grads, op=Op.ALL_TO_ALL, dtype="int4", source="ZeRO++ qgZ gradient all-to-all (int4)")
        return [init_broadcast(ctx, elements=n, groups=dp, axis="dp", what=""), forward, backward, grads]

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return [eq3_term(ctx)]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, z = ctx.scenario.parallelism, ctx.scenario.parallelism.zero
        d, n, isz = par.dp, ctx.param_count, ctx.scenario.model.itemsize
        share = Fraction(d - 1, d)
        out = [beyond_eq1(ctx, term=TERM, factor=3 * share, counted=n)]
        if z.qwz:
            out.append(
                Residual(
                    term=TERM,
                    name="qwZ int8 weights",
                    bytes=share * n * (1 - isz),
                    detail=f"forward all-gather sends 1 byte per parameter instead of {isz}",
                )
            )
        if z.hpz > 1:
            out.append(
                Residual(
                    term=TERM,
                    name="hpZ secondary partition",
                    bytes=n * isz * (Fraction(z.hpz - 1, z.hpz) - share),
                    detail=f"backward all-gather runs within hpz={z.hpz} ranks instead of d={d}",
                )
            )
        if z.qgz:
            out.append(
                Residual(
                    term=TERM,
                    name="qgZ int4 gradients",
                    bytes=share * (math.ceil(n / 2) - n * isz),
                    detail="gradients travel as int4 in an all-to-all instead of a reduce-scatter",
                )
            )
        return out
