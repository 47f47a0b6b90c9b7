"""Data-parallel gradient reduction: torch DDP / DeepSpeed ZeRO stage 0 (all-reduce) and ZeRO-1/2
(reduce-scatter of gradients, all-gather of updated parameters), per pipeline stage and, with MoE,
separately for expert parameters over the expert-data-parallel group. Paper: Eq. 2.

Plain model: one call per step for the whole gradient. The frameworks bucket it (DDP bucket_cap_mb,
DeepSpeed reduce_bucket_size); the bucket refinement comes with the real runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.layout import Axis, Group
from commgate.model.paper import eq2_data_parallel
from commgate.model.schemes._common import beyond_eq1, data_ranks, frozen, init_broadcast, rank0_term, sharding

TERM = "Eq. 2"


def _groups(ctx: Context, stage: int) -> list[tuple[bool | None, Axis, tuple[Group, ...]]]:
    lay = ctx.layout
    if ctx.scenario.parallelism.moe:
        return [(False, "dp", lay.dp_groups(stage)), (True, "edp", lay.edp_groups(stage))]
    return [(None, "dp", lay.dp_groups(stage))]


@dataclass(frozen=True, slots=True)
class DataParallel:
    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par = ctx.scenario.parallelism
        if par.data_ranks == 1:
            return []
        zs = par.zero.stage
        dtype = ctx.scenario.model.dtype
        rows: list[ExpectedCollective] = []
        for stage in range(par.pp):
            for expert, axis, groups in _groups(ctx, stage):
                n = ctx.rank_params(stage, expert=expert)
                what = "expert " if expert else ""
                where = f" (stage {stage})" if par.pp > 1 else ""
                base = ExpectedCollective(
                    op=Op.ALL_REDUCE,
                    axis=axis,
                    groups=groups,
                    dtype=dtype,
                    elements=n,
                    calls=1,
                    phase=Phase.BACKWARD,
                    source="",
                    paper_term=TERM,
                )
                rows.append(init_broadcast(ctx, elements=n, groups=groups, axis=axis, what=what, where=where))
                if zs == 0:
                    engine = "DDP" if par.scheme == "ddp" else "DeepSpeed"
                    rows.append(replace(base, source=f"{engine} {what}gradient all-reduce{where}"))
                else:
                    rows.append(
                        replace(base, op=Op.REDUCE_SCATTER, source=f"ZeRO-{zs} {what}gradient reduce-scatter{where}")
                    )
                    rows.append(
                        replace(
                            base,
                            op=Op.ALL_GATHER,
                            phase=Phase.OPTIMIZER,
                            source=f"ZeRO-{zs} {what}parameter all-gather{where}",
                        )
                    )
        return rows

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
