"""Data-parallel gradient reduction against Eq. 2: the paper's term and the residuals every data-parallel
engine shares (parameters beyond Eq. 1, sharding, frozen parameters, MoE's expert parameters over the
expert-data-parallel group). The engines' own collectives are their components': torch DDP
(``ddp``), DeepSpeed ZeRO-1/2 (``deepspeed_zero``), its pipeline engine (``pipeline``), MoE (``moe``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from commgate.model.expectation import Context, PaperTerm, Residual
from commgate.model.paper import eq2_data_parallel
from commgate.model.schemes._common import beyond_eq1, data_ranks, frozen, rank0_term, sharding
from commgate.model.schemes.scheme import Rule

TERM = "Eq. 2"


@dataclass(frozen=True, slots=True)
class DataParallel:
    """Eq. 2's side of every data-parallel engine: its paper term and the named residuals between the two;
    each engine's component (torch DDP, DeepSpeed ZeRO-1/2, its pipeline engine, MoE) adds the collectives
    it issues."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """None of its own: the engines built on it bring theirs."""
        return ()

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        d = ctx.scenario.parallelism.data_ranks
        if d == 1:
            return []
        return [
            rank0_term(
                ctx,
                equation=TERM,
                formula=f"2*N*(d-1)/d, N={ctx.eq1:,} ({ctx.eq1_name}), d={d}{data_ranks(ctx)}",
                elements=eq2_data_parallel(ctx.eq1, d),
            )
        ]

    def residuals(self, ctx: Context) -> list[Residual]:
        par = ctx.scenario.parallelism
        d = par.data_ranks
        if d == 1:
            return []
        factor = Fraction(2 * (d - 1), d)
        dense = ctx.param_count - ctx.expert_param_count
        expert = None if par.moe is None else False
        out = [
            beyond_eq1(ctx, term=TERM, factor=factor, counted=dense),
            sharding(ctx, term=TERM, factor=factor, full=dense, rank0=ctx.rank_params(0, expert=expert)),
            *frozen(ctx, TERM, factor),
        ]
        if par.moe:
            e = d // par.moe.ep
            n = ctx.rank_params(0, expert=True)
            out.append(
                Residual(
                    term=TERM,
                    name="expert parameters",
                    bytes=Fraction(2 * (e - 1), e) * n * ctx.scenario.model.itemsize,
                    detail=(
                        f"each rank holds {par.moe.experts // par.moe.ep} of {par.moe.experts} experts per MoE layer "
                        f"({n:,} parameters), all-reduced over the expert-data-parallel group of dp/ep = {e} "
                        "rank(s); Eq. 1 has no experts"
                    ),
                )
            )
        return out
