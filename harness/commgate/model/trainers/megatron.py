"""Megatron-core 0.16.1 as a trainer: its own ``GPTModel`` with the local layer spec (LayerNorm, GeLU MLP,
biases, learned positions), its ``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam, with or
without the distributed optimizer) and ``get_forward_backward_func``'s schedule, under the gate
(``commgate.run.trainers.megatron`` runs it). What it sends per step, read from megatron-core 0.16.1 and
measured on CPU gloo ranks (paths under ``megatron/core/``):

* Tensor parallelism (skipped by ``tensor_parallel/mappings.py`` when t = 1): without sequence
  parallelism an all-reduce of the activations (s*b*h) at the embedding (``layers.py:300``) and after
  each layer's row-parallel ``linear_proj`` and ``linear_fc2`` in the forward (``mappings.py:31``), and
  of the input gradients of ``linear_qkv``, ``linear_fc1`` and the output layer in the backward
  (``layers.py:544``). With sequence parallelism the embedding is still all-reduced (then split: GPT
  does not reduce-scatter it); each layer all-gathers the sequence shards before ``linear_qkv`` and
  ``linear_fc1`` (``layers.py:483``) and re-gathers them in the backward for the weight gradients
  (``layers.py:522``), reduce-scatters the outputs of ``linear_proj`` and ``linear_fc2``
  (``mappings.py:182``) and the input gradients of ``linear_qkv`` and ``linear_fc1`` (``layers.py:555``),
  all-gathers the gradients of the outputs' reduce-scatters (``mappings.py:142``); the output layer
  gathers, re-gathers and reduce-scatters as a column-parallel layer does, and the embedding's split
  gathers its gradient (``mappings.py:293``). Every message is s*b*h elements in the parameters' dtype.
* The vocabulary-parallel cross-entropy (``tensor_parallel/cross_entropy.py:130,148,154``): a max and two
  sums of s*b fp32 elements over the tensor-parallel group, issued even on a one-rank group.
* ``DistributedDataParallel`` (over the data-parallel group, even a one-rank one): the gradients in one
  buffer per dtype, cut into buckets walking the parameters in reverse registration order, a bucket
  closed once it holds ``bucket_size`` elements (``distributed/param_and_grad_buffer.py:711-739``; one
  bucket without ``overlap_grad_reduce``, 4e7 elements or 1e6*d by default with it,
  ``distributed_data_parallel.py:64-68``). With the distributed optimizer each parameter starts at a
  multiple of 64 elements and each bucket ends at a multiple of lcm(d, 128) (``param_and_grad_buffer.py:
  638-665``). Each bucket is all-reduced (``:455``), or reduce-scattered (``:443``) and, after the
  optimizer's step, its parameters all-gathered (``:285``; in the next forward with
  ``overlap_param_gather``), in the gradients' dtype (fp32 with ``grad_reduce_in_fp32``) and the
  parameters' dtype.
* Pipeline parallelism (Megatron's 1F1B, ``pipeline_parallel/schedules.py``): per micro-batch each stage
  boundary carries the activations forward and their gradients back (``p2p_communication.py``), each
  stage holds its L/p layers and its own buckets (one on every stage but the first), the stages after the
  first reduce from the schedule's ``grad_sync_func`` when overlapped; with tied embeddings the embedding
  group all-reduces the word embedding at construction and its gradient every step (``MegatronPP``).
* ``finalize_model_grads``: with sequence parallelism the gradients of the parameters marked
  ``sequence_parallel`` (both norms and the row-parallel biases of each layer, the final norm) all-reduced
  as one tensor over the tensor-parallel group (``distributed/finalize_model_grads.py:376``).
* The optimizer: the gradient norm's all-reduce (one fp32, ``optimizer/clip_grads.py:130``) over the
  model-parallel group, or with the distributed optimizer over every rank, whatever ``clip_grad`` is:
  ``get_megatron_optimizer`` returns a ``ChainedOptimizer``, whose ``step`` computes the norm before it
  clips only above 0 (``optimizer/optimizer.py:1314``; with ``clip_grad`` 0 it was left out, 4 B a step
  unexplained: found by an adversarial pass).
* Construction: ``get_megatron_optimizer`` all-gathers its parameter-group keys with
  ``all_gather_object`` (``optimizer/__init__.py:181``): the pickled keys' sizes, then the keys.

Paper: Eq. 2 for the gradient buckets, Eq. 4 for the pipeline, Eq. 5 for tensor parallelism, every difference a
named term.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.layout import Group
from commgate.model.paper import eq5_tensor
from commgate.model.scenario import Scenario
from commgate.model.schemes._common import micro_batches, rank0_term
from commgate.model.schemes.data_parallel import DataParallel
from commgate.model.schemes.pipeline import PipelineParallel
from commgate.model.schemes.scheme import Check, Component, Rule, Scheme
from commgate.model.trainers.trainer import Trainer
from commgate.model.transformer import WIRE_ITEMSIZE

EQ2, EQ4, EQ5 = "Eq. 2", "Eq. 4", "Eq. 5"
PIPELINE_PHASE = Phase.FORWARD
"""The phase the schedule's sends and receives are captured in (outside autograd: ``forward``)."""
MG = "megatron"


# ------------------------------------------------------------------------------------------ the job


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A scenario's ``megatron:`` block, Megatron's defaults filled in (``DistributedDataParallelConfig`` and
    ``OptimizerConfig`` fields of the same names)."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    grad_reduce_in_fp32: bool = False
    average_in_collective: bool = False
    clip_grad: float = 1.0
    seed: int = 1234
    recompute_granularity: str = "full"
    """With ``parallelism.activation_checkpointing``: ``TransformerConfig.recompute_granularity``; "full"
    checkpoints every layer (``recompute_method`` uniform, ``recompute_num_layers`` 1), "selective" its
    core attention."""

    @classmethod
    def of(cls, scenario: Scenario) -> Job:
        return cls.from_block(scenario.trainer_config)

    @classmethod
    def from_block(cls, block: Mapping[str, Any]) -> Job:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in block.items() if k in names})

    def buckets_of(self, d: int) -> int | None:
        """The bucket size DDP uses (``distributed_data_parallel.py:64-68``): one bucket without overlap."""
        if not self.overlap_grad_reduce:
            return None
        return self.bucket_size if self.bucket_size is not None else max(40_000_000, 1_000_000 * d)


_BOOL = {"type": "boolean"}
OPTIONS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "Megatron-core's DistributedDataParallelConfig and OptimizerConfig fields that change what "
    "is sent (Megatron's names and defaults); the model, tp, sequence_parallel, micro-batches and bf16 come from "
    "the scenario's model and parallelism blocks.",
    "properties": {
        "use_distributed_optimizer": _BOOL | {"default": False},
        "overlap_grad_reduce": _BOOL | {"default": False},
        "overlap_param_gather": _BOOL
        | {"default": False, "description": "Needs use_distributed_optimizer and overlap_grad_reduce."},
        "bucket_size": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Elements per gradient bucket (with overlap_grad_reduce); null: max(4e7, 1e6*d).",
        },
        "grad_reduce_in_fp32": _BOOL | {"default": False},
        "average_in_collective": _BOOL | {"default": False},
        "clip_grad": {
            "type": "number",
            "minimum": 0,
            "default": 1.0,
            "description": "0: no clipping (the gradient norm is still computed and all-reduced).",
        },
        "seed": {"type": "integer", "minimum": 0, "default": 1234},
        "recompute_granularity": {
            "enum": ["full", "selective"],
            "default": "full",
            "description": "With parallelism.activation_checkpointing: full recomputes every layer "
            "(recompute_method uniform, recompute_num_layers 1), re-running its tensor-parallel collectives in "
            "the backward; selective recomputes the core attention, which sends nothing.",
        },
    },
}


# -------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter as a tensor-parallel rank of Megatron's GPTModel holds it, in registration order."""

    name: str
    shape: tuple[int, ...]
    sequence_parallel: bool = False
    """Marked ``sequence_parallel`` (its gradient all-reduced over TP by ``finalize_model_grads``)."""
    shared_embedding: bool = False
    """The word embedding's copy on the first or last of several pipeline stages (tied embeddings,
    ``language_module.py:204-222``): its gradient all-reduced between them, in a bucket of its own with the
    distributed optimizer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_shapes(scenario: Scenario, job: Job | None = None, stage: int = 0) -> tuple[Param, ...]:
    """The local spec's GPTModel parameters on a tensor-parallel rank of pipeline ``stage``, in
    ``named_parameters`` order: the embeddings on the first stage, L/p layers (numbered from 0 on each
    stage), the final norm and the output layer on the last; with tied embeddings the last of several
    stages holds its own copy of the word embedding as ``output_layer.weight``."""
    m, t, p = scenario.model, scenario.parallelism.tp, scenario.parallelism.pp
    sp = scenario.parallelism.sequence_parallel and t > 1
    first, last, tied = stage == 0, stage == p - 1, m.tied_embeddings and p > 1
    h, hd = m.h, m.h // m.a
    qkv = (m.a + 2 * m.kv) * hd // t
    out = []
    if first:
        out += [
            Param("embedding.word_embeddings.weight", (m.V // t, h), shared_embedding=tied),
            Param("embedding.position_embeddings.weight", (m.s, h)),
        ]
    for i in range(m.L // p):
        pre = f"decoder.layers.{i}."
        out += [
            Param(pre + "input_layernorm.weight", (h,), sp),
            Param(pre + "input_layernorm.bias", (h,), sp),
            Param(pre + "self_attention.linear_proj.weight", (h, m.a * hd // t)),
            Param(pre + "self_attention.linear_proj.bias", (h,), sp),
            Param(pre + "self_attention.linear_qkv.weight", (qkv, h)),
            Param(pre + "self_attention.linear_qkv.bias", (qkv,)),
            Param(pre + "pre_mlp_layernorm.weight", (h,), sp),
            Param(pre + "pre_mlp_layernorm.bias", (h,), sp),
            Param(pre + "mlp.linear_fc1.weight", (m.ffn // t, h)),
            Param(pre + "mlp.linear_fc1.bias", (m.ffn // t,)),
            Param(pre + "mlp.linear_fc2.weight", (h, m.ffn // t)),
            Param(pre + "mlp.linear_fc2.bias", (h,), sp),
        ]
    if last:
        out += [Param("decoder.final_layernorm.weight", (h,), sp), Param("decoder.final_layernorm.bias", (h,), sp)]
        if not m.tied_embeddings or not first:
            out.append(Param("output_layer.weight", (m.V // t, h), shared_embedding=tied))
    return tuple(out)


def _pad(n: int, k: int) -> int:
    return -(-n // k) * k


def buckets(params: tuple[Param, ...], job: Job, d: int, stage: int = 0) -> list[tuple[int, int]]:
    """(elements, of them parameters) of each gradient bucket, in the order they are reduced
    (``param_and_grad_buffer.py:638-739``): the parameters in reverse registration order, a bucket closed
    once it reaches the bucket size (one bucket on every pipeline stage but the first,
    ``distributed_data_parallel.py:101-102``); with the distributed optimizer each parameter starts at a
    multiple of 64 elements, each bucket ends at a multiple of lcm(d, 128), and a shared embedding has a
    bucket of its own (``:698-733``)."""
    size, distopt = job.buckets_of(d) if stage == 0 else None, job.use_distributed_optimizer
    out: list[tuple[int, int]] = []
    start = begun = held = 0
    end = 0

    def close(at: int) -> int:
        nonlocal begun, held
        closed = _pad(at, math.lcm(d, 128)) if distopt else at
        out.append((closed - begun, held))
        begun, held = closed, 0
        return closed

    for p in reversed(params):
        own = p.shared_embedding and distopt
        if distopt:
            start = _pad(start, 64)
        if own and held:
            start = close(start)
        end = start + p.numel
        held += p.numel
        start = end
        if (size is not None and end - begun >= size) or own:
            start = close(end)
    if held:
        close(end)
    return out


def grad_dtype(scenario: Scenario, job: Job) -> str:
    """The gradient buffer's dtype: fp32 with ``grad_reduce_in_fp32`` or fp32 parameters."""
    return "fp32" if job.grad_reduce_in_fp32 else scenario.model.dtype


GROUP_KEYS: list[tuple[Any, bool]] = [(None, False), ((("wd_mult", 0.0),), False)]
"""The parameter-group keys ``_get_param_groups`` all-gathers (``optimizer/__init__.py:181``): (override,
expert-parallel) of the default group, then of the standard override (``get_standard_config_overrides``,
``:70-96``: no weight decay for biases and one-dimensional parameters, which every GPT has)."""


def group_keys_bytes() -> int:
    """The keys' size as ``all_gather_object`` pickles them (``pickle.Pickler``, default protocol)."""
    return len(pickle.dumps(GROUP_KEYS))


# ------------------------------------------------------------------------------------------- components


def _recomputes(ctx: Context) -> bool:
    """Whether each layer's forward runs again in the backward (full recompute, every layer)."""
    par = ctx.scenario.parallelism
    return par.activation_checkpointing and Job.of(ctx.scenario).recompute_granularity == "full"


@dataclass(frozen=True, slots=True)
class MegatronTP:
    """Megatron's tensor parallelism (and its sequence parallelism) and the vocabulary-parallel
    cross-entropy; Eq. 5 with named terms."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        _s, par, m = ctx.scenario, ctx.scenario.parallelism, ctx.scenario.model
        L, mb, bsh, lay = m.L // par.pp, par.micro_batches, ctx.bsh, ctx.layout
        fwd, bwd = Phase.FORWARD, Phase.BACKWARD
        first, last = lay.tp_groups(0), lay.tp_groups(par.pp - 1)  # the embedding's, the output layer's
        base = ExpectedCollective(
            op=Op.ALL_REDUCE,
            axis="tp",
            groups=lay.tp_groups(),
            dtype=m.dtype,
            elements=bsh,
            calls=0,
            phase=fwd,
            source="",
            paper_term=EQ5,
        )

        def row(
            op: Op, calls: int, phase: Phase, source: str, term: str | None = EQ5, groups: tuple[Group, ...] = ()
        ) -> ExpectedCollective:
            return replace(
                base, op=op, calls=calls * mb, phase=phase, source=source, paper_term=term, groups=groups or base.groups
            )

        ar, ag, rs = Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER
        layers = f"{L} layers a stage" if par.pp > 1 else f"{L} layers"
        again = _recomputes(ctx)
        rows = [
            replace(
                base,
                groups=last,
                dtype="fp32",
                elements=par.micro_batch * m.s,
                calls=3 * mb,
                paper_term=None,
                source="vocab-parallel cross-entropy all-reduces: max, sum of exp, target logit (fp32; "
                "cross_entropy.py:130,148,154)" + (", last stage" if par.pp > 1 else ""),
            )
        ]
        if par.tp == 1:
            return rows
        rows.append(row(ar, 1, fwd, "TP embedding all-reduce (layers.py:300)", groups=first))
        if not par.sequence_parallel:
            return [
                *rows,
                row(ar, 2 * L, fwd, f"TP all-reduce of the row-parallel linear_proj and linear_fc2 outputs ({layers})"),
                row(ar, 2 * L, bwd, f"TP all-reduce of the linear_qkv and linear_fc1 input gradients ({layers}; "
                    "layers.py:544)"),
                row(ar, 1, bwd, "TP all-reduce of the output layer's input gradient (layers.py:544)", None, last),
                *([row(ar, 2 * L, bwd, f"full recompute: each layer's forward again, its linear_proj and linear_fc2 "
                       f"all-reduces ({layers}; tensor_parallel/random.py CheckpointFunction)")] if again else []),
            ]  # fmt: skip
        return [
            *rows,
            row(ag, 2 * L, fwd, f"SP all-gather before linear_qkv and linear_fc1 ({layers}; layers.py:483)"),
            row(rs, 2 * L, fwd, f"SP reduce-scatter of the linear_proj and linear_fc2 outputs ({layers}; "
                "mappings.py:182)"),
            row(ag, 2 * L, bwd, f"SP all-gather of the reduce-scatters' output gradients ({layers}; mappings.py:142)"),
            row(rs, 2 * L, bwd, f"SP reduce-scatter of the linear_qkv and linear_fc1 input gradients ({layers}; "
                "layers.py:555)"),
            row(ag, 2 * L, bwd, f"SP re-gather of the linear_qkv and linear_fc1 inputs for the weight gradients "
                f"({layers}; layers.py:522)"),
            row(ag, 1, fwd, "SP all-gather before the output layer (layers.py:483)", None, last),
            row(ag, 1, bwd, "SP re-gather of the output layer's input for its weight gradient (layers.py:522)", None,
                last),
            row(rs, 1, bwd, "SP reduce-scatter of the output layer's input gradient (layers.py:555)", None, last),
            row(ag, 1, bwd, "SP all-gather of the embedding split's gradient (mappings.py:293)", None, first),
            *([
                row(ag, 2 * L, bwd, f"full recompute: each layer's forward again, its all-gathers before linear_qkv "
                    f"and linear_fc1 ({layers}; tensor_parallel/random.py CheckpointFunction)"),
                row(rs, 2 * L, bwd, f"full recompute: each layer's forward again, its reduce-scatters of the "
                    f"linear_proj and linear_fc2 outputs ({layers})"),
            ] if again else []),
        ]  # fmt: skip

    def _per_micro_batch(self, ctx: Context) -> Fraction:
        """Rank 0's Eq. 5 rows for one micro-batch, in elements of the paper's volume (its stage's L/p
        layers and the embedding's all-reduce)."""
        par, L = ctx.scenario.parallelism, ctx.scenario.model.L // ctx.scenario.parallelism.pp
        unit = Fraction(ctx.bsh * (par.tp - 1), par.tp)
        return unit * (2 + (8 + 2 * par.sequence_parallel + 4 * _recomputes(ctx)) * L)

    def _eq5(self, ctx: Context) -> Fraction:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return eq5_tensor(L=Fraction(m.L, par.pp), b=par.micro_batch, s=m.s, h=m.h, t=par.tp)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        if par.tp == 1:
            return []
        L = f"L/p={m.L}/{par.pp}" if par.pp > 1 else f"L={m.L}"
        formula = f"(12L+2)*b*s*h*(t-1)/t, {L}, b={par.micro_batch}, s={m.s}, h={m.h}, t={par.tp}"
        return [rank0_term(ctx, equation=EQ5, formula=formula, elements=self._eq5(ctx))]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.tp == 1:
            return []
        isz, unit, L = m.itemsize, Fraction(ctx.bsh * (par.tp - 1), par.tp), m.L // par.pp
        out = []
        if not _recomputes(ctx):  # full recompute re-runs the forward's two: Eq. 5's 6 all-reduces a layer
            what = (
                "selective recompute re-runs the core attention only, which sends nothing"
                if par.activation_checkpointing
                else "Megatron's local spec recomputes nothing here"
            )
            out.append(
                Residual(
                    term=EQ5,
                    name="no activation checkpointing" if not par.activation_checkpointing else "selective recompute",
                    bytes=-4 * L * unit * isz,
                    detail=f"{what}: 4 all-reduces per layer, Eq. 5 assumes 6 (a full recompute's)",
                )
            )
        if par.sequence_parallel:
            out.append(
                Residual(
                    term=EQ5,
                    name="sequence-parallel re-gathers",
                    bytes=2 * L * unit * isz,
                    detail="the backward all-gathers linear_qkv's and linear_fc1's sequence shards again for "
                    "their weight gradients (layers.py:522): 2 all-gathers per layer beyond Eq. 5",
                )
            )
        if par.micro_batches > 1:
            out.append(micro_batches(EQ5, self._per_micro_batch(ctx) * isz, par.micro_batches))
        return out


@dataclass(frozen=True, slots=True)
class MegatronDDP:
    """Megatron's ``DistributedDataParallel`` buckets, the distributed optimizer's reduce-scatters and
    all-gathers, ``finalize_model_grads``'s sequence-parallel all-reduce, the gradient norm and the
    optimizer's construction; Eq. 2 with named terms."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s, par, lay = ctx.scenario, ctx.scenario.parallelism, ctx.layout
        job, d = Job.of(s), par.data_ranks
        grad = grad_dtype(s, job)
        term = EQ2 if d > 1 else None
        base = ExpectedCollective(
            op=Op.ALL_REDUCE,
            axis="dp",
            groups=lay.dp_groups(),
            dtype=grad,
            elements=0,
            calls=1,
            phase=Phase.BACKWARD,
            source="",
            paper_term=term,
            overlaps=job.overlap_grad_reduce,
        )
        red = "averaged in the collective (AVG)" if job.average_in_collective else "pre-scaled by 1/d, summed"
        gather = Phase.FORWARD if job.overlap_param_gather else Phase.OPTIMIZER
        where = "the next forward's pre-hook" if job.overlap_param_gather else "the optimizer's step"
        rows = []
        for stage in range(par.pp):  # each stage its own parameters, so its own buckets
            params = param_shapes(s, job, stage)
            bs = buckets(params, job, d, stage)
            at = replace(base, groups=lay.dp_groups(stage))
            on = f", stage {stage}" if par.pp > 1 else ""
            if job.overlap_grad_reduce and stage > 0:
                # the schedule lets only the first stage reduce in its last backward; the others call
                # grad_sync_func after it, outside autograd (schedules.py:2246-2298)
                at = replace(at, phase=PIPELINE_PHASE)
                on += ", launched by the schedule after the last backward"
            for i, (n, _) in enumerate(bs):
                what = f"bucket {i} of {len(bs)}{on}"
                if not job.use_distributed_optimizer:
                    rows.append(replace(at, elements=n, source=f"DDP gradient all-reduce ({red}), {what} (:455)"))
                    continue
                rows += [
                    replace(at, op=Op.REDUCE_SCATTER, elements=n, source=f"distributed optimizer gradient "
                            f"reduce-scatter ({red}), {what} (param_and_grad_buffer.py:443)"),
                    replace(at, op=Op.ALL_GATHER, dtype=s.model.dtype, elements=n, phase=gather,
                            overlaps=job.overlap_param_gather,
                            source=f"distributed optimizer parameter all-gather in {where}, {what} (:285)"),
                ]  # fmt: skip
            if par.sequence_parallel and par.tp > 1:
                rows.append(
                    replace(
                        base,
                        axis="tp",
                        groups=lay.tp_groups(stage),
                        elements=sum(p.numel for p in params if p.sequence_parallel),
                        paper_term=None,
                        overlaps=False,
                        source="finalize_model_grads: the sequence-parallel norms' and row-parallel biases' gradients "
                        f"all-reduced{on} (finalize_model_grads.py:376)",
                    )
                )
        # ChainedOptimizer.step computes the norm whatever clip_grad is (optimizer.py:1314)
        norm_groups = lay.world() if job.use_distributed_optimizer else lay.mp_groups()
        rows.append(
            replace(
                base,
                axis="world" if job.use_distributed_optimizer else "mp",
                groups=norm_groups,
                dtype="fp32",
                elements=1,
                phase=Phase.OPTIMIZER,
                paper_term=None,
                overlaps=False,
                source="gradient-norm all-reduce (clip_grads.py:130; computed whatever clip_grad is)",
            )
        )
        return rows + _construction(ctx)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return DataParallel().paper_terms(ctx)  # Eq. 2 as for torch DDP

    def residuals(self, ctx: Context) -> list[Residual]:
        s, par, m = ctx.scenario, ctx.scenario.parallelism, ctx.scenario.model
        d = par.data_ranks
        if d == 1:
            return []
        job, isz = Job.of(s), m.itemsize
        params = param_shapes(s, job)
        local = sum(p.numel for p in params)
        bs = buckets(params, job, d)
        held = sum(n for n, _ in bs)
        share = Fraction(d - 1, d)
        out = [
            Residual(
                term=EQ2,
                name="parameters beyond Eq. 1",
                bytes=2 * share * (local - ctx.eq1) * isz,
                detail=f"rank 0 holds {local:,} parameters of Megatron's GPTModel (local spec: both LayerNorms' "
                f"biases, every linear bias{', tied embeddings' if m.tied_embeddings else ''}"
                f"{f', its tensor shard of tp={par.tp}' if par.tp > 1 else ''}); Eq. 1 gives {ctx.eq1:,}",
            )
        ]
        if held != local:
            out.append(
                Residual(
                    term=EQ2,
                    name="distributed-optimizer padding",
                    bytes=2 * share * (held - local) * isz,
                    detail=f"each parameter starts at a multiple of 64 elements and each bucket ends at a multiple "
                    f"of lcm(d, 128) (param_and_grad_buffer.py:638-665): {held - local:,} elements of padding",
                )
            )
        g = WIRE_ITEMSIZE[grad_dtype(s, job)]
        if g != isz:
            times = 1 if job.use_distributed_optimizer else 2
            out.append(
                Residual(
                    term=EQ2,
                    name="gradients reduced in fp32",
                    bytes=times * share * held * (g - isz),
                    detail=f"grad_reduce_in_fp32: the gradients are reduced in fp32, the paper counts {m.dtype}",
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class MegatronPP:
    """Megatron's pipeline schedule (``forward_backward_pipelining_without_interleaving``, 1F1B,
    ``pipeline_parallel/schedules.py``) and, with tied embeddings, the embedding group of the first and last
    stages; Eq. 4 with named terms. Per micro-batch every stage boundary carries the activations forward and
    their gradients back (``p2p_communication.py``, ``batch_isend_irecv``): s*b*h elements in
    ``pipeline_dtype`` (s/t*b*h under sequence parallelism), between the ranks of the same tensor and data
    index. The embedding group all-reduces the word embedding once at construction (the last stage's copy
    starts at zero, ``language_module.py:244``) and its gradient every step (``finalize_model_grads.py:258``)."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s, par, m, lay = ctx.scenario, ctx.scenario.parallelism, ctx.scenario.model, ctx.layout
        if par.pp == 1:
            return []
        base = ExpectedCollective(
            op=Op.SEND,
            axis="pp",
            groups=(),
            dtype=m.dtype,
            elements=_boundary(ctx),
            calls=par.micro_batches,
            phase=PIPELINE_PHASE,
            source="",
            paper_term=EQ4,
        )
        rows = []
        for k in range(par.pp - 1):
            for src, dst, what in ((k, k + 1, "activation"), (k + 1, k, "gradient")):
                for op, pairs in ((Op.SEND, lay.stage_pairs(src, dst)), (Op.RECV, lay.stage_pairs(dst, src))):
                    rows.append(
                        replace(base, op=op, groups=pairs, source=f"PP {what} {op} (stage {src} -> {dst}; "
                                "p2p_communication.py, batch_isend_irecv)")
                    )  # fmt: skip
        if m.tied_embeddings:
            ends = tuple((g[0], g[-1]) for g in lay.pp_groups())
            tied = replace(base, op=Op.ALL_REDUCE, axis="pp", groups=ends, elements=m.V // par.tp * m.h,
                           calls=1, paper_term=None)  # fmt: skip
            rows += [
                replace(tied, phase=Phase.INIT, once=True, source="embedding group: the word embedding all-reduced "
                        "at construction, the last stage's copy zeroed first (language_module.py:244)"),
                replace(tied, dtype=grad_dtype(s, Job.of(s)), phase=Phase.BACKWARD, source="embedding group: the "
                        "word embedding's gradient all-reduced (finalize_model_grads.py:258)"),
            ]  # fmt: skip
        return rows

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return PipelineParallel().paper_terms(ctx)

    def residuals(self, ctx: Context) -> list[Residual]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.pp == 1:
            return []
        out = PipelineParallel().residuals(ctx)
        if (shard := _boundary(ctx)) != ctx.bsh:
            out.append(
                Residual(
                    term=EQ4,
                    name="sequence-parallel activations",
                    bytes=Fraction(2 * (par.pp - 1) * par.micro_batches * (shard - ctx.bsh) * m.itemsize),
                    detail=f"under sequence parallelism each stage sends its 1/{par.tp} of the sequence "
                    "(p2p_communication.py's tensor_shape); Eq. 4 counts b*s*h",
                )
            )
        return out


def _boundary(ctx: Context) -> int:
    """Elements a stage boundary carries per micro-batch each way: s*b*h, s/t*b*h under sequence parallelism."""
    par = ctx.scenario.parallelism
    return ctx.bsh // par.tp if par.sequence_parallel and par.tp > 1 else ctx.bsh


def _construction(ctx: Context) -> list[ExpectedCollective]:
    """``get_megatron_optimizer``'s ``all_gather_object`` of its parameter-group keys over every rank, once for
    the dense parameters and once for the (absent) experts' (``optimizer/__init__.py:610,647``): the
    pickled sizes (one int64 a rank), then the keys padded to the largest (uint8)."""
    n = ctx.scenario.world_size
    init = ExpectedCollective(
        op=Op.ALL_GATHER,
        axis="world",
        groups=ctx.layout.world(),
        dtype="int64",
        elements=n,
        calls=2,
        phase=Phase.INIT,
        once=True,
        source="get_megatron_optimizer: all_gather_object of the parameter-group keys, their sizes "
        "(optimizer/__init__.py:181)",
    )
    keys = replace(
        init,
        dtype="uint8",
        elements=n * group_keys_bytes(),
        source="get_megatron_optimizer: all_gather_object of the parameter-group keys (optimizer/__init__.py:181)",
    )
    return [init, keys]


def components(scenario: Scenario, scheme: Scheme) -> tuple[Component, ...]:
    """Megatron's own model of what it sends, whichever scheme (ddp or tp) names the scenario's axes."""
    return (MegatronTP(), MegatronDDP(), MegatronPP())


# ------------------------------------------------------------------------------------------- rules

P = "parallelism"


def _block(c: Check) -> dict[str, Any]:
    block = c.doc.get(MG, {})
    return dict(block) if isinstance(block, Mapping) else {}


def megatrons_model(c: Check) -> None:
    """Megatron's GPTModel with the local spec: GPT-style layers, learned positions, fp32 or bf16."""
    m = c.model
    if m.module is not None:
        c.bad(["model", "module"], f"{m.module!r}: Megatron builds its own GPTModel; give its dimensions")
        return
    if m.llama:
        c.bad(["model", "architecture"], "'llama': Megatron's local GPT spec (LayerNorm, GeLU, biases) is "
              "modelled; set architecture: gpt-neox")  # fmt: skip
    if m.position != "learned":
        c.bad(["model", "position"], f"{m.position!r}: only Megatron's learned_absolute positions are modelled")
    tp = c.par.tp
    if m.kv_heads is None or m.kv_heads == m.a:  # every head its own group: the heads' own rules hold it
        pass
    elif m.kv < tp:  # transformer/attention.py: the fused QKV output all-gathered over tp in every layer
        c.bad(["model", "kv_heads"], f"{m.kv}: fewer query groups (num_query_groups) than tp={tp}: Megatron "
              "all-gathers each layer's QKV output to share them, which is not modelled; give kv_heads a multiple "
              "of tp")  # fmt: skip
    elif m.kv % tp:  # TransformerConfig.__post_init__ refuses it
        c.bad(["model", "kv_heads"], f"{m.kv}: Megatron needs num_query_groups a multiple of tp={tp}")
    if m.dtype == "fp16":
        c.bad(["model", "dtype"], "'fp16': Megatron's fp16 loss scaling (found-inf all-reduce) is not modelled; "
              "use bf16 or fp32")  # fmt: skip


def megatrons_axes(c: Check) -> None:
    """What the adapter runs and the model holds: TP with or without SP over tp, DDP over dp, 1F1B over pp
    (Megatron's own schedule, ``pipeline.engine: megatron``), full or selective recompute; no context
    parallelism, replicas or emulation."""
    par, block = c.par, _block(c)
    if par.pp > 1 and par.pipeline.engine != "megatron":
        c.bad([P, "pipeline", "engine"], f"{par.pipeline.engine}: Megatron's stages run its own schedule; set "
              "parallelism.pipeline.engine: megatron")  # fmt: skip
    elif par.pp > 1 and (par.pipeline.schedule != "1f1b" or par.pipeline.virtual_stages != 1):
        c.bad([P, "pipeline", "schedule"], f"{par.pipeline.schedule}: Megatron's 1F1B without interleaving "
              "(forward_backward_pipelining_without_interleaving) is modelled; virtual stages are not")  # fmt: skip
    refused = (
        ("cp", par.cp, "Megatron's context parallelism is not modelled"),
        ("dp_replicate", par.dp_replicate, "HSDP is not Megatron's"),
    )
    for key, value, why in refused:
        if value != 1:
            c.bad([P, key], f"{value}: {why}")
    if "recompute_granularity" in block and not par.activation_checkpointing:
        c.bad(
            [MG, "recompute_granularity"],
            f"{block['recompute_granularity']}: parallelism.activation_checkpointing is false; set it true",
        )
    if par.sequence_parallel and par.tp > 1 and c.model.s % par.tp:
        c.bad(["model", "s"], f"{c.model.s}: sequence parallelism splits the sequence over tp={par.tp}")


def megatrons_options(c: Check) -> None:
    """The ``megatron:`` block's fields as Megatron's configs accept them."""
    block = _block(c)
    job = Job.from_block(block)
    if job.overlap_param_gather and not (job.use_distributed_optimizer and job.overlap_grad_reduce):
        c.bad([MG, "overlap_param_gather"], "true: Megatron needs use_distributed_optimizer and "
              "overlap_grad_reduce true with it; set them")  # fmt: skip
    if block.get("bucket_size") is not None and not job.overlap_grad_reduce:
        c.bad([MG, "bucket_size"], f"{block['bucket_size']}: DDP uses one bucket without overlap_grad_reduce "
              "(distributed_data_parallel.py:67-68); set overlap_grad_reduce: true or remove it")  # fmt: skip
    if job.grad_reduce_in_fp32 and c.model.dtype == "fp32":
        c.bad([MG, "grad_reduce_in_fp32"], "true: the parameters are fp32 already; remove it")


RULES: tuple[Rule, ...] = (megatrons_model, megatrons_axes, megatrons_options)


MEGATRON = Trainer(
    name="megatron",
    summary="Megatron-core 0.16.1's own GPTModel (local spec), DistributedDataParallel, distributed optimizer "
    "and get_forward_backward_func schedule, with tensor, sequence and pipeline parallelism (1F1B)",
    schemes=("ddp", "tp", "pp", "3d"),
    extra="megatron",
    packages=("megatron.core",),
    options=OPTIONS,
    components=components,
    rules=RULES,
)
