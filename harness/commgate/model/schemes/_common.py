"""Pieces shared by the scheme components."""

from __future__ import annotations

from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.layout import Axis, Group


def init_broadcast(
    ctx: Context, *, elements: int, groups: tuple[Group, ...], axis: Axis, what: str, where: str = ""
) -> ExpectedCollective:
    """The engine's broadcast of initial parameters from the group's first rank (DDP and DeepSpeed both do it)."""
    return ExpectedCollective(
        op=Op.BROADCAST,
        axis=axis,
        groups=groups,
        dtype=ctx.scenario.model.dtype,
        elements=elements,
        calls=1,
        phase=Phase.INIT,
        once=True,
        source=f"initial {what}parameter broadcast{where}",
    )


def data_ranks(ctx: Context) -> str:
    """How a formula's d is made with context parallelism, whose ranks reduce (or shard) gradients too."""
    par = ctx.scenario.parallelism
    return f" (dp*cp = {par.dp}*{par.cp})" if par.cp > 1 else ""


def beyond_eq1(ctx: Context, *, term: str, factor: Fraction, counted: int) -> Residual:
    """Parameters of the model as built (``counted`` of them are reduced in ``term``) vs Eq. 1 (or its
    Llama counterpart, exact for a dense model)."""
    m = ctx.scenario.model
    moe = (
        " MoE layers swap the MLP for a gate and experts (experts are counted separately)."
        if ctx.expert_param_count
        else ""
    )
    if m.llama and m.qkv_bias:
        bias = m.h + 2 * m.kv * (m.h // m.a)
        why = f" each layer's Q, K and V biases (Qwen2) are h + 2*kv_heads*h/a = {bias:,}, the counterpart has none."
    elif m.llama:
        why = ""
    else:
        why = (
            f" each layer's attention/MLP biases and two LayerNorms are 9h+ffn = {9 * m.h + m.ffn:,}, "
            f"Eq. 1 counts 8h = {8 * m.h:,}."
        )
    return Residual(
        term=term,
        name=f"parameters beyond {ctx.eq1_name}",
        bytes=factor * (counted - ctx.eq1) * m.itemsize,
        detail=f"the model has {counted:,} such parameters, {ctx.eq1_name} gives {ctx.eq1:,}:{why}{moe}",
    )


def sharding(ctx: Context, *, term: str, factor: Fraction, full: int, rank0: int) -> Residual:
    par = ctx.scenario.parallelism
    return Residual(
        term=term,
        name="tensor/pipeline sharding",
        bytes=factor * (rank0 - full) * ctx.scenario.model.itemsize,
        detail=(
            f"rank 0 (pipeline stage 0, tensor shard 0 of tp={par.tp}, pp={par.pp}) holds and reduces "
            f"{rank0:,} of the {full:,} parameters"
        ),
    )


def micro_batches(term: str, per_micro_batch: Fraction, m: int) -> Residual:
    return Residual(
        term=term,
        name="micro-batches",
        bytes=per_micro_batch * (m - 1),
        detail=f"{term} counts one micro-batch; a step runs m={m}",
    )


def rank0_term(ctx: Context, *, equation: str, formula: str, elements: Fraction) -> PaperTerm:
    """A paper equation that gives the volume of one rank (Eqs. 2, 3, 5): compared on rank 0."""
    return PaperTerm(
        equation=equation,
        formula=formula,
        elements=elements,
        itemsize=ctx.scenario.model.itemsize,
        ranks=frozenset({0}),
        scope="per rank",
    )


def padded(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n``: a tensor partitioned over n ranks, gathered whole."""
    return -(-numel // n) * n


def frozen(ctx: Context, term: str, factor: Fraction, *, unused: int = 0, why: str = "") -> list[Residual]:
    """The named term for a user's module's frozen parameters: N counts them, but they have no gradient,
    so nothing reduces (or, under ZeRO-3, reduce-scatters) them; ``unused`` more elements of N are left
    out of another pass (``why`` says which)."""
    n = ctx.param_count - ctx.trainable_count
    if not n:
        return []
    detail = f"{n:,} parameters have requires_grad off: counted in N, never reduced"
    return [
        Residual(
            term=term,
            name="frozen parameters",
            bytes=-factor * (n + unused) * ctx.scenario.model.itemsize,
            detail=detail + (f"; {why}" if unused else ""),
        )
    ]
