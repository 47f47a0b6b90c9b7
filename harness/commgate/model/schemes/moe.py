"""DeepSpeed MoE expert parallelism: each MoE layer dispatches tokens to experts and combines them
back with an all-to-all over the expert-parallel group, twice in the forward and twice in the
backward (and again when activations are recomputed); with ep = 1 every expert is local and there is
none. With ``drop_tokens`` (DeepSpeed's default) the
dispatched tensor is [experts, capacity, h] with capacity = max(ceil(k * tokens / experts *
capacity_factor), min_capacity), tokens = b*s per rank, as in ``deepspeed.moe.sharded_moe``.
The paper has no MoE equation: this traffic is reported as not in the paper.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.schemes.data_parallel import DataParallel
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.transformer import ParamTensor


def capacity(ctx: Context) -> int:
    par, m = ctx.scenario.parallelism, ctx.scenario.model
    assert par.moe is not None
    tokens = par.micro_batch * m.s
    return max(math.ceil(tokens / par.moe.experts * par.moe.capacity_factor * par.moe.top_k), par.moe.min_capacity)


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        assert par.moe is not None
        if par.moe.ep == 1:  # every expert is local: DeepSpeed's MoE layer skips the all-to-all
            return []
        layers = m.L // par.moe.every
        elements = par.moe.experts * capacity(ctx) * m.h
        per_pass = 2 * layers * par.micro_batches
        groups = ctx.layout.ep_groups()
        phases = [(Phase.FORWARD, "forward", per_pass)]
        if par.activation_checkpointing:  # the recompute dispatches and combines again
            phases.append((Phase.BACKWARD, "recompute", per_pass))
        phases.append((Phase.BACKWARD, "backward", per_pass))
        return [
            ExpectedCollective(
                op=Op.ALL_TO_ALL,
                axis="ep",
                groups=groups,
                dtype=m.dtype,
                elements=elements,
                calls=calls,
                phase=phase,
                source=f"MoE dispatch/combine all-to-all ({what})",
            )
            for phase, what, calls in phases
        ]

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return []

    def residuals(self, ctx: Context) -> list[Residual]:
        return []


@dataclass(frozen=True, slots=True)
class MoEDataParallel(DataParallel):
    """DeepSpeed's engine around an MoE model (ZeRO stage 0, 1 or 2). At construction every parameter is
    broadcast as bytes — dense ones over the data-parallel group, a rank's own experts over its
    expert-data-parallel group. Then, per parameter group (dense over dp, experts over edp), the gradients
    are all-reduced in buckets of ``reduce_bucket_size``: once per step at stage 0 and 1 (at the
    gradient-accumulation boundary), once per micro-batch at stage 2. Stage 0 all-reduces the gradient
    norm once over dp. ZeRO-1/2 all-reduce it twice over dp and once over each edp group, then all-gather
    each group's updated flat partitions (padded to a multiple of 2 x the group size; skipped in a group
    of one rank). Paper: Eq. 2 (named terms for the experts, ZeRO's all-gather and accumulation)."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        from commgate.model.schemes._common import init_broadcast, padded
        from commgate.model.schemes.deepspeed_zero import _init_broadcasts, grad_dtype, reduction_buckets

        par = ctx.scenario.parallelism
        assert par.moe is not None
        zs = par.zero.stage
        local = par.moe.experts // par.moe.ep
        dense = tuple(p for p in ctx.params if not p.expert)
        mine = tuple(p for p in ctx.params if p.expert and int(p.name.split("experts.")[1].split(".")[0]) < local)
        engine = f"ZeRO-{zs}" if zs else "DeepSpeed"
        rows: list[ExpectedCollective] = []
        gathers: list[ExpectedCollective] = []
        for what, axis, groups, params in (
            ("", "dp", ctx.layout.dp_groups(), dense),
            ("expert ", "edp", ctx.layout.edp_groups(), mine),
        ):
            base = init_broadcast(ctx, elements=0, groups=groups, axis=axis, what=what)  # type: ignore[arg-type]
            rows += _init_broadcasts(ctx, base, 1, params=params)
            step = replace(base, op=Op.ALL_REDUCE, once=False, phase=Phase.BACKWARD, paper_term="Eq. 2")
            if zs:
                buckets = _zero_buckets(
                    dense, mine, expert=bool(what), stage=zs, limit=par.zero.bucket_elements, ctx=ctx
                )
            else:
                buckets = reduction_buckets([p.numel for p in params], zs, par.zero.bucket_elements, len(groups[0]))
            rows += [
                replace(
                    step,
                    elements=b,
                    calls=par.micro_batches if zs >= 2 else 1,
                    dtype=grad_dtype(ctx),
                    source=f"{engine} {what}gradient all-reduce, bucket {i} of {len(buckets)}",
                )
                for i, b in enumerate(buckets)
            ]
            size = len(groups[0])
            if zs and size > 1:
                gathers.append(
                    replace(
                        step,
                        op=Op.ALL_GATHER,
                        elements=padded(sum(p.numel for p in params), 2 * size),
                        phase=Phase.OPTIMIZER,
                        source=f"ZeRO-{zs} all-gather of the updated {what}partitions",
                    )
                )
        norm = replace(
            rows[-1],
            axis="dp",
            groups=ctx.layout.dp_groups(),
            dtype=ctx.scenario.model.dtype,
            elements=1,
            calls=2 if zs else 1,
            phase=Phase.OPTIMIZER,
            paper_term=None,
            source=f"{engine} gradient-norm all-reduce",
        )
        norms = [norm]
        if ctx.optimizer == "FP16_Optimizer":  # 16-bit without ZeRO: only its overflow flag, over the experts
            norms = [
                replace(
                    norm,
                    axis="ep",
                    groups=ctx.layout.ep_groups(),
                    dtype="uint8",
                    source="FP16_Optimizer gradient overflow check over expert parallel (uint8)",
                )
            ]
        elif zs:
            norm = replace(norm, dtype="fp32")  # ZeRO computes the norm in fp32 whatever the parameters' dtype
            norms = [
                norm,
                replace(
                    norm,
                    axis="edp",
                    groups=ctx.layout.edp_groups(),
                    calls=1,
                    source=f"ZeRO-{zs} expert gradient-norm all-reduce",
                ),
            ]
            if ctx.scenario.model.dtype != "fp32":
                norms.append(replace(norm, dtype="uint8", calls=1, source=f"ZeRO-{zs} gradient overflow check (uint8)"))
        return [*rows, *norms, *gathers]

    def residuals(self, ctx: Context) -> list[Residual]:
        """Eq. 2's terms at stage 0 and one micro-batch, then what ZeRO's all-gathers and accumulation add
        (the model's own rows at those settings, differenced)."""
        par = ctx.scenario.parallelism

        def at(stage: int, m: int) -> Context:
            scenario = replace(
                ctx.scenario, parallelism=replace(par, zero=replace(par.zero, stage=stage), micro_batches=m)
            )
            if stage == 0 and "data_types" in scenario.deepspeed_config:  # fp32 accumulation needs ZeRO
                kept = {k: v for k, v in scenario.deepspeed_config.items() if k != "data_types"}
                scenario = replace(scenario, deepspeed=json.dumps(kept))
            return Context(scenario=scenario)

        from commgate.model.schemes.deepspeed_zero import _volume, comm_dtype_residual

        plain = at(0, 1)
        out = DataParallel.residuals(self, plain)
        out += comm_dtype_residual(plain, "Eq. 2", lambda c: _volume(self.collectives(c), "Eq. 2"))
        steps = [
            (
                at(par.zero.stage, 1),
                plain,
                f"ZeRO-{par.zero.stage} all-gather of the updated partitions",
                "the optimizer all-gathers each parameter group's updated partitions after the all-reduce",
            ),
            (
                ctx,
                at(par.zero.stage, 1),
                "gradient accumulation",
                f"stage {par.zero.stage} reduces the gradients of each of the m={par.micro_batches} micro-batches",
            ),
        ]
        for now, before, name, detail in steps:
            extra = _volume(self.collectives(now), "Eq. 2") - _volume(self.collectives(before), "Eq. 2")
            if extra:
                out.append(Residual(term="Eq. 2", name=name, bytes=extra, detail=detail))
        return out


def _zero_buckets(
    dense: tuple[ParamTensor, ...], mine: tuple[ParamTensor, ...], *, expert: bool, stage: int, limit: int, ctx: Context
) -> list[int]:
    """ZeRO-1/2's gradient all-reduces of one parameter group (dense or expert) of an MoE model. Both
    groups' gradients go into one bucket — ZeRO-1 at the boundary, the dense group's parameters and then
    the experts', each in registration order; ZeRO-2 as they become ready (reverse registration order,
    interleaved). The bucket is reduced before a gradient would take it past ``reduce_bucket_size``, one
    all-reduce per group present in it, over that group's ranks; a gradient larger than the bucket size
    is reduced alone, in slices (``deepspeed_zero.oversized``)."""
    from commgate.model.schemes.deepspeed_zero import in_hooks, oversized, sliced

    held = [p for p in ctx.params if p in dense or p in mine]  # this rank's parameters, registration order
    group = [p for p in held if p.expert == expert]
    order = held[::-1] if in_hooks(ctx) else [p for p in held if not p.expert] + [p for p in held if p.expert]
    d = len((ctx.layout.edp_groups() if expert else ctx.layout.dp_groups())[0])
    out: list[int] = []
    bucket: list[ParamTensor] = []

    def flush() -> None:
        mine_here = [p for p in bucket if p.expert == expert]
        if sliced(ctx) and len(bucket) == 1 and mine_here and bucket[0].numel > limit:
            out.extend(oversized([p.numel for p in group], group.index(bucket[0]), limit, d))
        elif mine_here:
            out.append(sum(p.numel for p in mine_here))

    for p in order:
        if bucket and sum(q.numel for q in bucket) + p.numel > limit:
            flush()
            bucket = []
        bucket.append(p)
    flush()
    return out


P = "parallelism"


def experts(c: Check) -> None:
    """How the experts split over the expert-parallel group, and the ZeRO stages DeepSpeed's MoE runs."""
    par, moe, m = c.par, c.par.moe, c.model
    if not c.scheme.moe or moe is None:
        return
    if par.dp % moe.ep:
        c.bad([P, "moe", "ep"], f"{moe.ep}: dp={par.dp} is not divisible by the expert-parallel size")
    if moe.experts % moe.ep:
        c.bad([P, "moe", "ep"], f"{moe.ep}: experts={moe.experts} are not divisible by the expert-parallel size")
    if moe.every > m.L:
        c.bad([P, "moe", "every"], f"{moe.every}: greater than layers L={m.L}, so no layer would be MoE")
    if par.zero.stage >= 3:
        c.bad([P, "zero", "stage"], f"{par.zero.stage}: DeepSpeed MoE supports ZeRO stage 0-2 only")


def moe_deepspeed_keys(c: Check) -> None:
    """The ZeRO switches DeepSpeed's MoE asserts, and the one it runs that the model does not follow."""
    zo, stage = c.ds.get("zero_optimization", {}), c.par.zero.stage
    if c.par.moe is None or not isinstance(zo, Mapping):
        return
    where: list[str | int] = ["deepspeed", "zero_optimization"]
    if zo.get("reduce_scatter", True) is False:
        c.bad(
            [*where, "reduce_scatter"],
            "false: DeepSpeed's MoE needs reduce_scatter (it asserts 'Reduce Scatter ... must be set to True for MoE')",
        )
    if stage not in (1, 2) or zo.get("contiguous_gradients", True) is not False:
        return
    if stage == 2:
        c.bad(
            [*where, "contiguous_gradients"],
            "false: DeepSpeed's MoE at ZeRO-2 needs contiguous gradients (it asserts 'Contiguous Gradients in "
            "ZeRO Stage 2 must be set to True for MoE')",
        )
    elif c.checked:
        c.bad(
            [*where, "contiguous_gradients"],
            "false: MoE at ZeRO-1 without contiguous gradients (DeepSpeed's experimental path) is not modelled "
            "yet; expectations: {model: {check: false}} runs it as a baseline-only gate",
        )


RULES: tuple[Rule, ...] = (experts, moe_deepspeed_keys)
