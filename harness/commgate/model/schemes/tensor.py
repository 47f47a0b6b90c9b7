"""Megatron-style tensor parallelism: per layer, the row-parallel attention and MLP outputs are
all-reduced in the forward and the column-parallel inputs' gradients in the backward; activation
checkpointing repeats the forward ones; the vocab-parallel embedding all-reduces once in the forward
and the vocab-parallel output layer its input gradient once in the backward. Paper: Eq. 5 (L -> L/p in 3D).
With sequence parallelism each all-reduce becomes an all-gather and a reduce-scatter of the same message
(``_sequence_parallel``): Eq. 5's volume, in twice the calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.paper import eq5_tensor
from commgate.model.schemes._common import micro_batches, rank0_term
from commgate.model.schemes.fsdp import built_on_meta
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.transformer import WIRE_ITEMSIZE, Shard

TERM = "Eq. 5"


@dataclass(frozen=True, slots=True)
class TensorParallel:
    fsdp: bool = False
    """The data-parallel side is torch FSDP2, which resolves a replicated parameter's Partial gradient once a
    step, when it reduces (else DDP or the optimizer resolves it: ``_sequence_parallel``)."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        if par.tp == 1:  # where tensor parallelism is optional (FSDP2)
            return []
        per_stage = m.L // par.pp
        mb = par.micro_batches
        # inside DeepSpeed's pipeline engine (3D) everything outside autograd is the engine's phase
        forward = Phase.PIPELINE if par.pp > 1 else Phase.FORWARD
        rows: list[ExpectedCollective] = []
        for stage in range(par.pp):
            groups = ctx.layout.tp_groups(stage)
            where = f", stage {stage}" if par.pp > 1 else ""
            base = ExpectedCollective(
                op=Op.ALL_REDUCE,
                axis="tp",
                groups=groups,
                dtype=m.dtype,
                elements=ctx.bsh,
                calls=0,
                phase=Phase.FORWARD,
                source="",
                paper_term=TERM,
            )
            if not (self.fsdp and built_on_meta(ctx.scenario)):  # the parameters, in their dtype
                rows += _distribute(ctx, base, stage)
            act = activation_dtype(ctx)
            base = replace(base, dtype=act)

            def row(
                calls: int,
                phase: Phase,
                source: str,
                term: str | None = TERM,
                elements: int = ctx.bsh,
                dtype: str = act,
                *,
                _b: ExpectedCollective = base,
                _w: str = where,
                _rows: list[ExpectedCollective] = rows,
            ) -> None:
                _rows.append(
                    replace(
                        _b,
                        calls=calls * mb,
                        phase=phase,
                        source=source + _w,
                        paper_term=term,
                        elements=elements,
                        dtype=dtype,
                    )
                )

            if stage == 0:
                row(1, forward, "TP vocab-parallel embedding all-reduce")
            if par.sequence_parallel:
                rows += _sequence_parallel(ctx, base, per_stage, fsdp=self.fsdp)
            else:
                row(2 * per_stage, forward, "TP forward all-reduce (row-parallel attention and MLP outputs)")
                if par.activation_checkpointing:
                    recompute = "TP recompute all-reduce " + _RECOMPUTE[_recomputed(ctx) == 2]
                    row(per_stage * _recomputed(ctx), Phase.BACKWARD, recompute)
                row(2 * per_stage, Phase.BACKWARD, "TP backward all-reduce (column-parallel input gradients)")
                if stage == par.pp - 1:
                    row(1, Phase.BACKWARD, "TP output-layer input-gradient all-reduce", None)
            if stage == par.pp - 1:
                row(
                    3,
                    forward,
                    "TP vocab-parallel cross-entropy all-reduce (max, sum of exp, target logit; in fp32)",
                    None,
                    par.micro_batch * ctx.seq,
                    "fp32",  # the loss upcasts the logits
                )
        return rows

    def _eq5(self, ctx: Context, recompute: bool = True) -> Fraction:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return eq5_tensor(L=Fraction(m.L, par.pp), b=par.micro_batch, s=ctx.seq, h=m.h, t=par.tp, recompute=recompute)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        if par.tp == 1:
            return []
        L = f"L/p={m.L}/{par.pp}" if par.pp > 1 else f"L={m.L}"
        seq = f"s/c={m.s}/{par.cp}" if par.cp > 1 else f"s={m.s}"
        return [
            rank0_term(
                ctx,
                equation=TERM,
                formula=f"(12L+2)*b*s*h*(t-1)/t, {L}, b={par.micro_batch}, {seq}, h={m.h}, t={par.tp}",
                elements=self._eq5(ctx),
            )
        ]

    def _per_micro_batch(self, ctx: Context) -> Fraction:
        """Rank 0's TP volume for one micro-batch, in elements: (8L/p + 2) all-reduce units (an
        all-gather and a reduce-scatter of the same message under sequence parallelism), plus the
        recomputed ones with checkpointing (``_recompute_units`` per layer)."""
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        unit = Fraction(ctx.bsh * (par.tp - 1), par.tp)  # an all-gather's or reduce-scatter's; half an all-reduce's
        recomputed = _recompute_units(ctx) * (m.L // par.pp) if par.activation_checkpointing else 0
        return self._eq5(ctx, recompute=False) + unit * recomputed

    def residuals(self, ctx: Context) -> list[Residual]:
        par, isz = ctx.scenario.parallelism, ctx.scenario.model.itemsize
        if par.tp == 1:
            return []
        model = self._per_micro_batch(ctx)
        out = []
        if not par.activation_checkpointing:
            name, detail = (
                "no activation checkpointing",
                "4 all-reduces per layer without recomputation; Eq. 5 assumes 6",
            )
        elif par.sequence_parallel:
            name = "recomputation stops early"
            detail = (
                "torch.utils.checkpoint re-runs each layer only up to its attention output: 2 all-gathers and 1 "
                "reduce-scatter per layer, Eq. 5 assumes 2 all-reduces (as 4 of them)"
            )
        elif _recomputed(ctx) == 1:
            name = "recomputation stops early"
            detail = (
                "torch.utils.checkpoint re-runs each layer only up to its attention output: 1 all-reduce per layer, "
                "Eq. 5 assumes 2"
            )
        else:
            name = detail = ""  # DeepSpeed's engine re-runs whole layers: Eq. 5 exactly
        if name:
            out.append(Residual(term=TERM, name=name, bytes=(model - self._eq5(ctx)) * isz, detail=detail))
        if par.micro_batches > 1:
            out.append(micro_batches(TERM, model * isz, par.micro_batches))
        act = activation_dtype(ctx)
        if (act_isz := WIRE_ITEMSIZE[act]) != isz:
            out.append(
                Residual(
                    term=TERM,
                    name="activations in a lower precision",
                    bytes=model * par.micro_batches * (act_isz - isz),
                    detail=f"FSDP2's param_dtype {act}: the layers compute, and TP moves, {act} activations; "
                    f"Eq. 5 counts {ctx.scenario.model.dtype}",
                )
            )
        return out


_RECOMPUTE = {
    False: "(attention output; torch.utils.checkpoint stops recomputing early)",
    True: "(the pipeline engine's checkpoint re-runs whole layers)",
}


def _recomputed(ctx: Context) -> int:
    """Forward all-reduces each layer repeats in the backward when checkpointed: torch.utils.checkpoint
    (non-reentrant; torch.distributed.pipelining's stages use it too) stops once the saved tensors are
    rebuilt, before the MLP's all-reduce (1); DeepSpeed's pipeline engine checkpoints with its own reentrant
    function, which re-runs the layer whole (2)."""
    par = ctx.scenario.parallelism
    return 2 if par.pp > 1 and par.pipeline.engine == "deepspeed" else 1


def activation_dtype(ctx: Context) -> str:
    """The dtype the layers compute in, so the activations TP moves: the parameters', or under FSDP2 its
    mixed-precision policy's ``param_dtype`` (the gathered parameters are cast to it; only an FSDP2 scheme
    may set one, ``commgate.model.rules.option_blocks``)."""
    return ctx.scenario.parallelism.fsdp.compute_dtype(ctx.scenario.model.dtype)


def _recompute_units(ctx: Context) -> int:
    """All-gather-sized units (half an all-reduce) each checkpointed layer re-sends in the backward."""
    return 3 if ctx.scenario.parallelism.sequence_parallel else 2 * _recomputed(ctx)


def _sequence_parallel(
    ctx: Context, base: ExpectedCollective, per_stage: int, *, fsdp: bool
) -> list[ExpectedCollective]:
    """Megatron-style sequence parallelism on DTensor (schemes tp and fsdp, one stage): every layer all-gathers
    its sequence shards before the attention and the MLP and reduce-scatters their row-parallel outputs,
    and the backward mirrors both: the volume of TP's all-reduces, in twice the calls. Besides: the first
    layer's split of the embedding output gathers its gradient in the backward; the output layer gathers
    its input and reduce-scatters that gradient; each norm parameter, replicated while its gradient comes
    out of sequence shards as a DTensor Partial, is all-reduced: by DDP's local-shard hand-over in the
    backward of every micro-batch with dp > 1, by FSDP2 once a step before its reduce-scatter (in the
    compute dtype, or in reduce_dtype where micro-batches accumulated it so), or, alone, whenever AdamW
    reads the gradient (3 times a step on torch 2.13: ``lerp_`` and ``addcmul_``'s two operands)."""
    par, mb = ctx.scenario.parallelism, ctx.scenario.parallelism.micro_batches
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    ag, rs = Op.ALL_GATHER, Op.REDUCE_SCATTER

    def r(op: Op, calls: int, phase: Phase, source: str, term: str | None = TERM) -> ExpectedCollective:
        return replace(base, op=op, calls=calls * mb, phase=phase, source=source, paper_term=term)

    rows = [
        r(ag, 2 * per_stage, fwd, "SP all-gather of the sequence shards (attention and MLP inputs)"),
        r(rs, 2 * per_stage, fwd, "SP reduce-scatter of the row-parallel attention and MLP outputs"),
        r(ag, 2 * per_stage, bwd, "SP backward all-gather (gradients of the outputs' reduce-scatter)"),
        r(rs, 2 * per_stage, bwd, "SP backward reduce-scatter (gradients of the inputs' all-gather)"),
        r(ag, 1, bwd, "SP: the first layer's sequence split, its gradient gathered", None),
        r(ag, 1, fwd, "SP all-gather of the sequence shards before the output layer", None),
        r(rs, 1, bwd, "SP output-layer input-gradient reduce-scatter", None),
    ]
    if par.activation_checkpointing:
        rows += [
            r(ag, 2 * per_stage, bwd, "SP recompute all-gathers (torch.utils.checkpoint)"),
            r(rs, per_stage, bwd, "SP recompute reduce-scatter (attention output; recomputing stops early)"),
        ]
    norms = [p for p in ctx.stage_params(0) if p.shard is Shard.REPLICATED and "norm" in p.name]
    for numel in sorted({p.numel for p in norms}):
        n = sum(1 for p in norms if p.numel == numel)
        resolve = replace(base, elements=numel, paper_term=None)
        if fsdp:  # FSDP2 resolves the gradient once a step, when it reduces
            f = par.fsdp
            computed = f.compute_dtype(ctx.scenario.model.dtype)
            # micro-batches without sync accumulate it cast to reduce_dtype (``to_accumulated_grad_if_needed``)
            accumulated = f.reduce_dtype if mb > 1 and f.reduce_dtype not in (None, computed) else None
            rows.append(
                replace(
                    resolve,
                    calls=n,
                    phase=bwd,
                    dtype=accumulated or computed,
                    source="SP norm-parameter gradient all-reduce (Partial -> Replicate, before FSDP2 reduces)",
                )
            )
        elif par.dp > 1:
            rows.append(
                replace(
                    resolve,
                    calls=n * mb,
                    phase=bwd,
                    source="SP norm-parameter gradient all-reduce (Partial -> Replicate, for the data-parallel engine)",
                )
            )
        else:
            rows.append(
                replace(
                    resolve,
                    calls=3 * n,
                    phase=Phase.OPTIMIZER,
                    source="SP norm-parameter gradient all-reduce (Partial, resolved at each of AdamW's 3 reads)",
                )
            )
    return rows


def _distribute(ctx: Context, base: ExpectedCollective, stage: int) -> list[ExpectedCollective]:
    """DTensor's ``distribute_tensor`` of the parallelised modules' parameters at construction: sharded
    ones are scattered from the group's first rank, the row-parallel biases broadcast."""
    init = replace(base, calls=1, phase=Phase.INIT, once=True, paper_term=None)
    out = []
    for p in ctx.stage_params(stage):
        if p.shard is not Shard.REPLICATED:
            op, source = Op.SCATTER, "TP parameter scatter (DTensor distribute)"
        elif p.name.endswith(("attention.dense.bias", "mlp.fc_out.bias")):
            op, source = Op.BROADCAST, "TP row-parallel bias broadcast (DTensor distribute)"
        else:
            continue
        out.append(replace(init, op=op, elements=p.numel, source=source))
    return out


P = "parallelism"


def tensor_shapes(c: Check) -> None:
    """What tensor parallelism over ``tp`` ranks splits: whole heads, key/value heads, the MLP's width and
    the vocabulary (Megatron's vocab-parallel embedding) on each rank."""
    m, tp = c.model, c.par.tp
    if tp == 1 or m.module is not None:
        return
    if m.a % tp:
        c.bad([P, "tp"], f"{tp}: heads a={m.a} are not divisible by tp")
    if m.llama and m.kv % tp:
        c.bad([P, "tp"], f"{tp}: key/value heads kv_heads={m.kv} are not divisible by tp (each rank holds whole heads)")
    if m.ffn_hidden is not None and m.ffn % tp:  # x*h divides when the heads do
        c.bad([P, "tp"], f"{tp}: the MLP width ffn={m.ffn} is not divisible by tp")
    if m.V % tp:
        c.bad([P, "tp"], f"{tp}: vocabulary V={m.V} is not divisible by tp (vocab-parallel embedding)")


def sequence_parallelism(c: Check) -> None:
    """Sequence parallelism runs inside tensor parallelism, and not (yet) across pipeline stages."""
    par, rule = c.par, c.scheme
    if not par.sequence_parallel:
        return
    if not (rule.tensor or (rule.optional_tensor and par.tp > 1)):
        c.bad(
            [P, "sequence_parallel"],
            f"true: sequence parallelism runs inside tensor parallelism, not scheme {rule.name!r}",
        )
    elif par.pp > 1 and par.pipeline.engine == "deepspeed" and rule.pipeline:
        alone = c.names(lambda r: r.tensor and not r.pipeline)
        c.bad(
            [P, "sequence_parallel"],
            f"true: not modelled under DeepSpeed's pipeline engine yet (scheme {rule.name}); use {alone}",
        )
    elif par.pp > 1 and par.pipeline.engine != "megatron" and not c.splits_stages:
        # (Megatron's stages, and a trainer's own split, torchtitan's, are their own models')
        c.bad([P, "sequence_parallel"], "true: not modelled in pipeline stages yet")


RULES: tuple[Rule, ...] = (tensor_shapes, sequence_parallelism)
