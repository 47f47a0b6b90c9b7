"""Pipeline parallelism on DeepSpeed's pipeline engine (``deepspeed.pipe``, 1F1B ``train_batch``).

Per micro-batch every stage boundary carries the activations forward and their gradients backward,
b*s*h elements each way: the paper's Eq. 4, times m micro-batches per step. What the engine sends
besides (DeepSpeed 0.19, measured through the capture and read from ``deepspeed/runtime/pipe/``):

* construction: an all-reduce of two int64 parameter counters over each pipeline, and one 1-element
  send across each stage boundary (the point-to-point warm-up);
* the first step: a 256-element int32 buffer of tensor metadata sent across each boundary, once;
* every step: the loss broadcast from the last stage to the pipeline (2 fp32) and the gradient-norm
  all-reduce over the pipeline (1 fp32).

The data-parallel side of the engine is ``PipelineDataParallel``. With tied embeddings the first and
last stages all-reduce the shared embedding's gradient. All of the engine's calls happen inside
``train_batch``: phase ``pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.dsconfig import grad_accum_dtype
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.paper import eq4_pipeline
from commgate.model.scenario import TORCH_SCHEDULES
from commgate.model.schemes._common import init_broadcast, micro_batches, padded
from commgate.model.schemes.data_parallel import DataParallel
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.schemes.tensor import activation_dtype
from commgate.model.transformer import WIRE_ITEMSIZE

TERM = "Eq. 4"
META_ELEMENTS = 256  # the engine's int32 tensor-metadata buffer


@dataclass(frozen=True, slots=True)
class PipelineParallel:
    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        m, par, lay = ctx.scenario.model, ctx.scenario.parallelism, ctx.layout
        if par.pp == 1:  # where pipelining is optional (FSDP2)
            return []
        if par.pipeline.engine == "torch":
            return _torch_pipelining(ctx)
        pipes = lay.pp_groups()
        base = ExpectedCollective(
            op=Op.ALL_REDUCE,
            axis="pp",
            groups=pipes,
            dtype="int64",
            elements=2,
            calls=1,
            phase=Phase.INIT,
            once=True,
            source="",
        )
        counters = "PP parameter counters (all-reduce, int64, over the model-parallel group: stages x tp)"
        rows = [replace(base, axis="mp", groups=lay.mp_groups(), source=counters)]
        for k in range(par.pp - 1):
            for op, pairs in ((Op.SEND, lay.stage_pairs(k, k + 1)), (Op.RECV, lay.stage_pairs(k + 1, k))):
                rows.append(
                    replace(
                        base,
                        op=op,
                        groups=pairs,
                        dtype="fp32",  # the engine's loss tensor, fp32 whatever the parameters' dtype
                        elements=1,
                        source=f"PP point-to-point warm-up {op} (stage {k} -> {k + 1})",
                    )
                )
                rows.append(
                    replace(
                        base,
                        op=op,
                        groups=pairs,
                        dtype="int32",
                        elements=META_ELEMENTS,
                        phase=Phase.PIPELINE,
                        at_step=0,
                        source=f"PP tensor-metadata {op} (stage {k} -> {k + 1}, first step)",
                    )
                )
        step = replace(base, once=False, phase=Phase.PIPELINE, dtype=m.dtype)
        for k in range(par.pp - 1):
            for src, dst, what in ((k, k + 1, "activation"), (k + 1, k, "gradient")):
                for op, pairs in ((Op.SEND, lay.stage_pairs(src, dst)), (Op.RECV, lay.stage_pairs(dst, src))):
                    rows.append(
                        replace(
                            step,
                            op=op,
                            groups=pairs,
                            elements=ctx.bsh,
                            calls=par.micro_batches,
                            paper_term=TERM,
                            source=f"PP {what} {op} (stage {src} -> {dst})",
                        )
                    )
        last_first = tuple((g[-1], *g[:-1]) for g in pipes)  # a rooted op lists its root first
        rows.append(
            replace(
                step,
                op=Op.BROADCAST,
                groups=last_first,
                dtype="fp32",  # the engine stacks the losses as fp32
                elements=2,
                source="PP loss broadcast from the last stage",
            )
        )
        norm = replace(
            step,
            axis="mp",
            groups=lay.mp_groups(),
            dtype="fp32",  # every optimizer computes the norm in fp32
            elements=1,
            source="PP gradient-norm all-reduce over the model-parallel group (stages x tp)",
        )
        rows.append(norm)
        if ctx.optimizer in ("ZeRO", "FP16_Optimizer") and m.dtype != "fp32":
            rows.append(replace(norm, dtype="uint8", source="PP gradient overflow check over the model-parallel group"))
        if m.tied_embeddings:
            ends = tuple((g[0], g[-1]) for g in pipes)
            rows.append(  # _synchronize_tied_weights: the first stage's copy, whole (DTensor shards it after)
                replace(
                    step,
                    op=Op.BROADCAST,
                    groups=ends,
                    dtype=m.dtype,
                    elements=m.V * m.h,
                    phase=Phase.INIT,
                    once=True,
                    source="PP tied-embedding broadcast from the first stage (construction; the whole weight, "
                    "tensor parallelism shards the stages after)",
                )
            )
            rows.append(
                replace(
                    step,
                    groups=ends,
                    # BF16_Optimizer reduces the weight's gradient in its accumulation buffer
                    dtype=grad_accum_dtype(ctx.scenario.deepspeed_config, m.dtype)
                    if ctx.optimizer == "BF16_Optimizer"
                    else m.dtype,
                    elements=m.V * m.h // par.tp,
                    source="PP tied-embedding gradient all-reduce (first <-> last stage)",
                )
            )
        return rows

    def activation_dtype(self, ctx: Context) -> str:
        """The dtype the stages compute in, so send: FSDP2's ``param_dtype`` when set, else the model's."""
        return activation_dtype(ctx)

    def _eq4(self, ctx: Context) -> Fraction:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return eq4_pipeline(b=par.micro_batch, s=m.s, h=m.h, p=par.pp)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        if par.pp == 1:
            return []
        return [
            PaperTerm(
                equation=TERM,
                formula=f"2*b*s*h*(p-1), b={par.micro_batch}, s={m.s}, h={m.h}, p={par.pp}",
                elements=self._eq4(ctx),
                itemsize=m.itemsize,
                ranks=frozenset(ctx.layout.pp_groups()[0]),
                scope="one pipeline, summed over stages",
            )
        ]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, isz = ctx.scenario.parallelism, ctx.scenario.model.itemsize
        mb, v = par.micro_batches, par.pipeline.virtual_stages
        if par.pp == 1:
            return []
        out = [micro_batches(TERM, self._eq4(ctx) * isz, mb)] if mb > 1 else []
        if v > 1:
            extra = 2 * ctx.bsh * par.pp * (v - 1) * mb * isz
            out.append(
                Residual(
                    term=TERM,
                    name="interleaved virtual stages",
                    bytes=Fraction(extra),
                    detail=f"{par.pp}x{v} stages have {par.pp * v - 1} boundaries, Eq. 4 counts p-1 = {par.pp - 1}",
                )
            )
        act = self.activation_dtype(ctx)
        if WIRE_ITEMSIZE[act] != isz:  # every boundary's bytes so far, in the dtype the stages compute in
            sent = self._eq4(ctx) * isz * mb + sum((r.bytes for r in out if r.name != "micro-batches"), Fraction(0))
            out.append(
                Residual(
                    term=TERM,
                    name="activations in a lower precision",
                    bytes=sent * (WIRE_ITEMSIZE[act] - isz) / isz,
                    detail=f"FSDP2's param_dtype {act}: the stages compute, and send, {act} activations and "
                    f"gradients; Eq. 4 counts {ctx.scenario.model.dtype}",
                )
            )
        return out


def _torch_pipelining(ctx: Context) -> list[ExpectedCollective]:
    """``torch.distributed.pipelining`` (torch 2.13, ``stage.py`` and ``schedules.py``), every stage given
    its shapes (no shape inference): per micro-batch, each boundary between consecutive stages k, k+1
    (on ranks k mod p and k+1 mod p; p x v stages with v virtual stages per rank) carries the activation
    forward and its gradient back, b*s*h elements each, as a send and a recv. Every schedule (GPipe,
    1F1B, interleaved 1F1B, zero-bubble) moves the same; they differ in order and bubble, not in bytes.
    Nothing at construction, no loss broadcast, no norm: the schedule returns the losses to the last
    stage's caller only."""
    par = ctx.scenario.parallelism
    p, n = par.pp, par.pp * par.pipeline.virtual_stages
    base = ExpectedCollective(
        op=Op.SEND,
        axis="pp",
        groups=(),
        dtype=activation_dtype(ctx),  # FSDP2's param_dtype when set: the stages compute in it
        elements=ctx.bsh,
        calls=par.micro_batches,
        phase=Phase.PIPELINE,
        source="",
        paper_term=TERM,
    )
    rows = []
    lay = ctx.layout
    for k in range(n - 1):
        a, b = k % p, (k + 1) % p
        forward = lay.stage_pairs(a, b)  # (sender, receiver), one pair per pipeline (per data-parallel rank)
        backward = tuple((y, x) for x, y in forward)
        for pairs, what in ((forward, "activation"), (backward, "gradient")):
            for op, groups in ((Op.SEND, pairs), (Op.RECV, tuple((y, x) for x, y in pairs))):
                stages = f"stage {k} -> {k + 1}" if what == "activation" else f"stage {k + 1} -> {k}"
                rows.append(replace(base, op=op, groups=groups, source=f"torch PP {what} {op} ({stages})"))
    return rows


@dataclass(frozen=True, slots=True)
class PipelineDataParallel(DataParallel):
    """The pipeline engine's data-parallel side, per stage: the parameters broadcast as bytes at
    construction, then every step the all-reduce of the stage's gradients (buckets as
    ``deepspeed_zero.reduction_buckets``: the engine's own at stage 0, ZeRO-1's ``reduce_bucket_size``)
    and one of its gradient norm, and on the last stage, when dp > 1, one of the loss. The engine issues
    these even when the data-parallel group has a single rank (they then move nothing). With ZeRO-1
    each stage's updated partitions are all-gathered after the step (not in a group of one rank)."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        from commgate.model.schemes.deepspeed_zero import _init_broadcasts, grad_dtype, reduction_buckets, sliced

        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.pipeline.engine == "torch":  # dp = 1: no data-parallel side
            return []
        rows: list[ExpectedCollective] = []
        term = "Eq. 2" if par.dp > 1 else None
        bf16 = ctx.optimizer == "BF16_Optimizer"
        for stage in range(par.pp):
            groups = ctx.layout.dp_groups(stage)
            base = init_broadcast(ctx, elements=0, groups=groups, axis="dp", what="")
            stage_params = ctx.stage_params(stage)
            rows += [
                replace(r, groups=groups, source=r.source + f" (stage {stage})")
                for r in _init_broadcasts(ctx, base, 1, params=stage_params)
            ]
            step = replace(base, op=Op.ALL_REDUCE, once=False, phase=Phase.PIPELINE, paper_term=term)
            shards = [p.numel_per_tp_rank(par.tp) for p in stage_params]
            step = replace(step, dtype=grad_dtype(ctx))  # the engine's (or ZeRO-1's) communication dtype
            if bf16:  # the engine all-reduces the optimizer's flat gradient buffer, padded, in one call
                buckets = [padded(sum(shards), 2 * par.dp)]
            else:
                buckets = reduction_buckets(
                    shards, par.zero.stage, par.zero.bucket_elements, par.dp, slices=sliced(ctx)
                )
            for i, b in enumerate(buckets):
                rows.append(
                    replace(
                        step,
                        elements=b,
                        source=f"PP data-parallel gradient all-reduce (stage {stage}, bucket {i} of {len(buckets)})",
                    )
                )
            step = replace(step, dtype=m.dtype)
            if not bf16:  # BF16_Optimizer's norm goes over the model-parallel group only
                norm = replace(
                    step,
                    elements=1,
                    paper_term=None,
                    dtype="fp32" if ctx.optimizer == "ZeRO" else m.dtype,
                    source=f"PP gradient-norm all-reduce over data parallel (stage {stage})",
                )
                rows.append(norm)
                if ctx.optimizer == "ZeRO" and m.dtype != "fp32":
                    rows.append(
                        replace(
                            norm, dtype="uint8", source=f"PP gradient overflow check over data parallel (stage {stage})"
                        )
                    )
            if stage == par.pp - 1 and par.dp > 1:
                rows.append(
                    replace(
                        step,
                        elements=1,
                        dtype="fp32",  # the workload's loss (cross-entropy in fp32)
                        paper_term=None,
                        source="PP loss all-reduce over data parallel (last stage)",
                    )
                )
            if (bf16 or par.zero.stage == 1) and par.dp > 1:
                # the optimizer (BF16_Optimizer or ZeRO-1) gathers the updated partitions back, in the
                # parameters' dtype (DeepSpeed skips the all-gather in a data-parallel group of one rank)
                who = "BF16_Optimizer" if bf16 else "ZeRO-1"
                rows.append(
                    replace(
                        step,
                        op=Op.ALL_GATHER,
                        elements=padded(sum(shards), 2 * par.dp),
                        source=f"PP {who} all-gather of the updated partitions (stage {stage})",
                    )
                )
        return rows

    def residuals(self, ctx: Context) -> list[Residual]:
        from commgate.model.schemes.deepspeed_zero import _volume, comm_dtype_residual

        par, isz = ctx.scenario.parallelism, ctx.scenario.model.itemsize
        out = DataParallel.residuals(self, ctx)
        out += comm_dtype_residual(ctx, "Eq. 2", lambda c: _volume(self.collectives(c), "Eq. 2"))
        bf16 = ctx.optimizer == "BF16_Optimizer"
        if (par.zero.stage == 1 or bf16) and par.dp > 1:
            d, n = par.dp, ctx.rank_params(0)
            share = Fraction(d - 1, d)
            who = "BF16_Optimizer" if bf16 else "ZeRO-1"
            out.append(
                Residual(
                    term="Eq. 2",
                    name="gradients all-reduced, not reduce-scattered",
                    bytes=share * n * isz,
                    detail=f"DeepSpeed's pipeline engine with {who} all-reduces gradients (2N(d-1)/d) and "
                    "all-gathers the updated partitions; Eq. 2 assumes reduce_scatter + all_gather",
                )
            )
            if pad := padded(n, 2 * d) - n:
                out.append(
                    Residual(
                        term="Eq. 2",
                        name="partition padding",
                        # BF16_Optimizer all-reduces the padded gradient buffer too
                        bytes=(3 if bf16 else 1) * share * pad * isz,
                        detail=f"the stage's flat buffer is padded to a multiple of 2 x d = {2 * d} elements",
                    )
                )
        return out


P = "parallelism"


def stage_layers(c: Check) -> None:
    m, pp = c.model, c.par.pp
    if pp > 1 and m.module is None and m.L % pp and not c.splits_stages:
        c.bad([P, "pp"], f"{pp}: layers L={m.L} are not divisible by pp")


def engine(c: Check) -> None:
    """A ``pipeline`` block needs a scheme with pipeline stages; DeepSpeed's engine runs its own 1F1B, torch's
    schedules are checked by ``torch_schedule``."""
    pl, rule = c.par.pipeline, c.scheme
    if "pipeline" in c.declared and not (rule.pipeline or (rule.optional_pipeline and c.par.pp > 1)):
        staged, optional = c.names(lambda r: r.pipeline), c.names(lambda r: r.optional_pipeline)
        c.bad(
            [P, "pipeline"],
            f"a pipeline engine needs a pipeline scheme ({staged}, or {optional} with pp > 1), not {rule.name!r}",
        )
    elif pl.engine == "deepspeed" and (pl.schedule != "1f1b" or pl.virtual_stages != 1):
        c.bad(
            [P, "pipeline", "schedule"],
            f"{pl.schedule}: DeepSpeed's engine runs its own 1F1B; engine: torch for others",
        )
    elif pl.engine == "torch":
        torch_engine(c)
        torch_schedule(c)
    elif pl.engine == "megatron" and c.doc.get("trainer") != "megatron":
        c.bad([P, "pipeline", "engine"], "megatron: Megatron's schedule runs under trainer: megatron only")
    if pl.engine == "torch" and "deepspeed" in c.doc:
        c.bad(
            ["deepspeed"],
            "DeepSpeed keys do not apply to torch.distributed.pipelining (parallelism.pipeline.engine: torch)",
        )


def torch_engine(c: Check) -> None:
    """What torch.distributed.pipelining's stages run: the schemes whose record names the engine, data
    parallelism by FSDP2 alone, no DeepSpeed options, no activation checkpointing yet."""
    par, rule = c.par, c.scheme
    own = c.trainer == "commgate" and rule.tensor and not rule.optional_pipeline  # torchtitan's pp x tp alone
    if "torch" not in rule.pipeline_engines or own:
        able = c.names(lambda r: "torch" in r.pipeline_engines and not (r.tensor and not r.optional_pipeline))
        c.bad(
            [P, "pipeline", "engine"],
            f"torch: torch.distributed.pipelining is modelled under schemes {able}, not {rule.name!r}"
            + (f" (scheme {rule.name!r} with engine torch is torchtitan's: trainer: torchtitan)" if own else ""),
        )
    if "zero" in c.declared:
        c.bad([P, "zero"], "DeepSpeed's ZeRO options do not apply to torch.distributed.pipelining (engine: torch)")
    if par.dp > 1 and not rule.optional_pipeline:
        fsdp = c.names(lambda r: r.fsdp)
        c.bad([P, "dp"], f"{par.dp}: data parallelism inside torch's stages is FSDP2's: use scheme {fsdp}")


def torch_schedule(c: Check) -> None:
    """A torch schedule's stages per rank, micro-batches and layers per stage."""
    par, pl, m = c.par, c.par.pipeline, c.model
    if not pl.looped and pl.virtual_stages != 1:
        c.bad(
            [P, "pipeline", "virtual_stages"], f"{pl.virtual_stages}: schedule {pl.schedule!r} runs one stage per rank"
        )
    if pl.schedule == "interleaved-1f1b" and pl.virtual_stages < 2:
        c.bad(
            [P, "pipeline", "virtual_stages"], f"{pl.virtual_stages}: an interleaved schedule needs virtual_stages >= 2"
        )
    rounds = max(1, par.micro_batches // par.pp)  # torch's interleaved schedules run m in rounds of p
    if pl.looped and par.micro_batches % rounds:
        c.bad(
            [P, "micro_batches"],
            f"{par.micro_batches}: torch's {TORCH_SCHEDULES[pl.schedule]} needs a multiple of its {rounds} rounds",
        )
    if pl.schedule == "1f1b" and par.micro_batches < par.pp:
        c.bad([P, "micro_batches"], f"{par.micro_batches}: torch's Schedule1F1B needs at least pp={par.pp}")
    stages = par.pp * pl.virtual_stages
    if m.module is None and m.L % stages and not c.splits_stages:
        c.bad(
            [P, "pipeline", "virtual_stages"],
            f"{pl.virtual_stages}: layers L={m.L} are not divisible by pp*virtual_stages={stages}",
        )


RULES: tuple[Rule, ...] = (stage_layers, engine)
