"""torchtitan 0.3.0 as a trainer: its llama3 model package, its own ``parallelize_llama`` (FSDP2 always,
DTensor tensor parallelism with sequence parallelism inside) and its own ``Trainer.train_step``, under
the gate (``commgate.run.trainers.torchtitan`` runs it). What it sends, read from torchtitan 0.3.0 and
torch 2.13 and measured on CPU gloo ranks (paths under ``torchtitan/``):

* FSDP2 groups (``distributed/fsdp.py:110-316``): ``tok_embeddings`` alone, each block, and
  ``[norm, lm_head]`` (not resharded after the forward unless the policy is "always"); the root holds
  nothing. Every parameter is padded on dim 0 to a multiple of d, the fused ``wqkv`` as one tensor.
  Gathers in ``training.mixed_precision_param`` (bf16), reduce-scatters in fp32
  (``mixed_precision_reduce``, its only value), summed: ``set_gradient_divide_factor(1.0)``; the loss is
  normalised by the global token count instead (an int64 all-reduce over the batch ranks,
  ``trainer.py:897-901``).
* ``ChunkedLossWrapper`` (the loss of every llama3 config, ``components/loss.py:728-772``) unshards the
  head group around its chunk loop and reshards it after: from the second step on (on every step with
  "always") the group is gathered twice in the forward; the chunks' backward reduce-scatters
  ``lm_head``'s gradient alone, the decoder's backward gathers the group again for ``norm`` and
  reduce-scatters ``norm``'s gradient alone.
* The optimizer part: ``clip_grad_norm_`` all-reduces the per-tensor partial norms (fp32, one per
  parameter tensor) once per mesh dimension of more than one rank; the logging steps
  (``metrics.log_freq``) all-reduce the loss's sum and max (fp32) and the tokens seen (int64).
* Construction: rank 0's seed broadcast (8 bytes, ``distributed/utils.py:258-263``) unless
  ``debug.seed`` is set; with tensor parallelism each layer's RoPE cache (a Replicate buffer, complex64
  ``s x head_dim/2``) is broadcast over the tensor-parallel group.
* Tensor parallelism with sequence parallelism (``models/common/decoder_sharding.py``): the
  vocabulary-parallel embedding reduce-scatters its output, each block all-gathers its attention and
  FFN inputs and reduce-scatters the outputs of ``wo`` and ``w2``, the final norm's output is gathered
  for the column-parallel head; the backward mirrors them; the loss is vocabulary-parallel (three fp32
  all-reduces per chunk, ``loss.py:69-80``); the norms' replicated weights all-reduce their gradients;
  selective activation checkpointing saves reduce-scatter outputs but not all-gathers
  (``distributed/activation_checkpoint.py:61-64``), full recomputes both. Activations move in the
  mixed-precision dtype, FSDP2's policy applying even on a one-rank data-parallel mesh.

* HSDP (``data_parallel_replicate_degree``): each reduce-scattered shard all-reduced across the replicas.
* Its pipeline (``TorchtitanPP``; its own split of the stages, ``stages``), FSDP2 in each stage replayed
  over the schedule's order on that stage (``_pipelined_fsdp``; interleaved 1F1B: torch's own order of
  each of a rank's stages), TP inside (its 3-D), and its flex context parallelism (``TorchtitanCP``; FSDP2
  over dp x cp, the token count over dp alone; TP inside on the rank's s/c sequence shard).
* Gradient accumulation without a pipeline (``training.global_batch_size`` = m x local x dp):
  ``train_step`` runs m forward-backward passes a step, each syncing (``accumulated``), the token count,
  gradient norm and metrics once. FSDP2's CPU offload (``training.enable_cpu_offload``) sends the same.

Paper: Eq. 3 for the FSDP2 part, Eq. 5 for tensor parallelism, Eq. 4 for the pipeline, commgate's CP
derivation for context parallelism, every difference a named term.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.layout import Axis
from commgate.model.layout import Group as Ranks
from commgate.model.paper import eq5_tensor
from commgate.model.scenario import Scenario
from commgate.model.schemes._common import beyond_eq1, micro_batches, rank0_term, sharding
from commgate.model.schemes.context import TERM as CP_TERM
from commgate.model.schemes.context import ContextParallel, kv_buffer
from commgate.model.schemes.fsdp import Group, pipeline_order, pipelined_gathers
from commgate.model.schemes.pipeline import TERM as PP_TERM
from commgate.model.schemes.pipeline import PipelineParallel, _torch_pipelining
from commgate.model.schemes.scheme import Check, Component, Rule, Scheme
from commgate.model.schemes.zero3 import TERM as EQ3
from commgate.model.schemes.zero3 import eq3_term
from commgate.model.trainers.trainer import Trainer
from commgate.model.transformer import WIRE_ITEMSIZE

EQ5 = "Eq. 5"
ACMode = Literal["none", "selective", "full"]
LEFT_OFF = ("compile", "async_tp", "float8")
"""What a torchtitan config may enable that a CPU run turns off (``torchtitan.left_off``; ``LEFT_OFF_WHY``)."""
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
"""torchtitan's dtype names (``training.mixed_precision_param``) -> commgate's."""


# ------------------------------------------------------------------------------------------ the job


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A scenario's ``torchtitan:`` block, torchtitan's defaults filled in."""

    module: str = "llama3"
    """``--module``: a name of ``torchtitan.models`` or a fully qualified module of config functions."""
    config: str = "llama3_debugmodel"
    """``--config``: a ``config_registry`` function of the module."""
    args: tuple[str, ...] = ()
    """More of torchtitan's command-line overrides (``--training.max-norm 0.5``)."""
    activation_checkpoint: Literal["selective", "full"] = "selective"
    """The mode when ``parallelism.activation_checkpointing`` is on."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    cpu_offload: bool = False
    """``training.enable_cpu_offload``: FSDP2's ``CPUOffloadPolicy`` (shards on the host, copied to the device
    around each collective: the same calls, bytes and groups)."""
    gradient_accumulation_steps: int = 1
    """Under a pipeline: schedule steps per optimizer step (``global_batch_size / (local_batch_size x dp)``;
    without a pipeline ``parallelism.micro_batches`` are the accumulation steps)."""
    loss: Literal["chunked", "cross_entropy"] = "chunked"
    loss_chunks: int = 8
    log_freq: int = 10
    seed: int | None = None
    left_off: tuple[str, ...] = ()

    @classmethod
    def of(cls, scenario: Scenario) -> Job:
        return cls.from_block(scenario.trainer_config)

    @classmethod
    def from_block(cls, block: Mapping[str, Any]) -> Job:
        kw = dict(block)
        for key in ("args", "left_off"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)

    def ac(self, activation_checkpointing: bool) -> ACMode:
        """The activation-checkpointing mode torchtitan runs (``activation-checkpoint:<mode>``)."""
        return self.activation_checkpoint if activation_checkpointing else "none"

    @property
    def param_dtype(self) -> str:
        return DTYPES[self.mixed_precision_param]

    @property
    def chunks(self) -> int:
        """Loss calls per step: the chunks of ``ChunkedLossWrapper``, or one."""
        return self.loss_chunks if self.loss == "chunked" else 1

    def logs(self, step: int) -> bool:
        """Whether commgate's ``step`` (torchtitan's ``step + 1``) is a logging step (``metrics.py:362``)."""
        n = step + 1
        return n == 1 or n % self.log_freq == 0


REDUCE_DTYPE = "fp32"
"""``training.mixed_precision_reduce``: float32 is the only value torchtitan 0.3.0 takes (``configs.py:93``)."""

OPTIONS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "torchtitan's job: its config function, overrides, and the settings commgate's model needs "
    "that the scenario's model and parallelism blocks do not hold (torchtitan's names and defaults).",
    "properties": {
        "module": {
            "type": "string",
            "pattern": r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
            "default": "llama3",
            "description": "--module: llama3, or a fully qualified module holding config functions.",
        },
        "config": {
            "type": "string",
            "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$",
            "default": "llama3_debugmodel",
            "description": "--config: a config_registry function of the module (llama3_8b ...).",
        },
        "args": {
            "type": "array",
            "items": {"type": "string"},
            "maxItems": 64,
            "description": "More ConfigManager overrides (--training.max-norm 0.5); what the scenario sets is refused.",
        },
        "activation_checkpoint": {
            "enum": ["selective", "full"],
            "description": "The mode when parallelism.activation_checkpointing is true (default selective).",
        },
        "mixed_precision_param": {"enum": ["bfloat16", "float32"], "default": "bfloat16"},
        "fsdp_reshard_after_forward": {"enum": ["default", "always", "never"], "default": "default"},
        "gradient_accumulation_steps": {
            "type": "integer",
            "minimum": 1,
            "maximum": 4096,
            "default": 1,
            "description": "Under its pipeline: schedule steps per optimizer step (global_batch_size / "
            "(local_batch_size x dp)); without one, parallelism.micro_batches are the accumulation steps.",
        },
        "cpu_offload": {
            "type": "boolean",
            "default": False,
            "description": "training.enable_cpu_offload: FSDP2's shards kept on the host (the same collectives).",
        },
        "loss": {
            "enum": ["chunked", "cross_entropy"],
            "default": "chunked",
            "description": "The config's loss: ChunkedLossWrapper (every llama3 config) or plain cross-entropy.",
        },
        "loss_chunks": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 8},
        "log_freq": {
            "type": "integer",
            "minimum": 1,
            "maximum": 1000000,
            "default": 10,
            "description": "metrics.log_freq: the steps whose loss and token counts are all-reduced.",
        },
        "seed": {
            "type": ["integer", "null"],
            "description": "debug.seed; unset: rank 0's seed is broadcast at construction.",
        },
        "left_off": {
            "type": "array",
            "items": {"enum": list(LEFT_OFF)},
            "uniqueItems": True,
            "description": "What the config enables that a CPU run turns off and the model leaves out "
            "(named in every run's summary).",
        },
    },
}


# ----------------------------------------------------------------------------------------- flavors


@dataclass(frozen=True, slots=True)
class Flavor:
    """A llama3 flavor of torchtitan's ``models/llama3/__init__.py`` (the same dimensions in 0.2.2's
    ``llama3_args`` and 0.3.0's builders)."""

    L: int
    h: int
    a: int
    kv_heads: int
    V: int
    multiple_of: int
    ffn_dim_multiplier: float | None
    tied: bool = False

    @property
    def ffn_hidden(self) -> int:
        """``compute_ffn_hidden_dim`` (``models/common/feed_forward.py:18-31``): int(8h/3), times the
        multiplier, rounded up to a multiple of ``multiple_of``."""
        hidden = int(2 * 4 * self.h / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of


LLAMA3_FLAVORS: dict[str, Flavor] = {
    "debugmodel": Flavor(6, 256, 16, 16, 2048, 256, None),
    "1B": Flavor(16, 2048, 32, 8, 128256, 1024, 1.5, tied=True),
    "3B": Flavor(28, 3072, 24, 8, 128256, 1024, 1.0, tied=True),
    "8B": Flavor(32, 4096, 32, 8, 128256, 1024, 1.3),
    "70B": Flavor(80, 8192, 64, 8, 128256, 4096, 1.3),
    "405B": Flavor(126, 16384, 128, 8, 128256, 4096, 1.2),
}
LLAMA3_CONFIGS = {"debugmodel": "llama3_debugmodel", "8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}
"""torchtitan 0.3.0's config function of each flavor a 0.2.2 TOML names (``models/llama3/config_registry.py``)."""


def flavor_model(name: str) -> dict[str, Any]:
    """A flavor's dimensions in commgate's names (a scenario's ``model`` block)."""
    f = LLAMA3_FLAVORS[name]
    return {"L": f.L, "h": f.h, "a": f.a, "kv_heads": f.kv_heads, "ffn_hidden": f.ffn_hidden, "V": f.V,
            "tied_embeddings": f.tied}  # fmt: skip


# -------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter as a tensor-parallel rank holds it: ``rows`` (dim 0, which FSDP2 pads) x ``rest``."""

    name: str
    rows: int
    rest: int

    def padded(self, d: int) -> int:
        """Elements in its FSDP2 group's flat all-gather: dim 0 padded to a multiple of d."""
        return -(-self.rows // d) * d * self.rest

    @property
    def numel(self) -> int:
        return self.rows * self.rest


def block_params(ctx: Context) -> tuple[Param, ...]:
    """One block's parameters on a tensor-parallel rank (``decoder_sharding.py:70-116``): the fused
    ``wqkv``, ``w1`` and ``w3`` column-parallel (dim 0 split), ``wo`` and ``w2`` row-parallel (dim 1
    split), the two norms replicated."""
    m, t = ctx.scenario.model, ctx.scenario.parallelism.tp
    hd = m.h // m.a
    return (
        Param("attention.wqkv", (m.a + 2 * m.kv) * hd // t, m.h),
        Param("attention.wo", m.h, m.a * hd // t),
        Param("feed_forward.w1", m.ffn // t, m.h),
        Param("feed_forward.w2", m.h, m.ffn // t),
        Param("feed_forward.w3", m.ffn // t, m.h),
        Param("attention_norm", m.h, 1),
        Param("ffn_norm", m.h, 1),
    )


def vocab_param(ctx: Context, name: str) -> Param:
    """The embedding's or the head's weight: the vocabulary split over the tensor-parallel ranks."""
    m, t = ctx.scenario.model, ctx.scenario.parallelism.tp
    return Param(name, -(-m.V // t), m.h)


def param_tensors(ctx: Context, stage: Stage | None = None) -> int:
    """Parameter tensors with a gradient (of one pipeline ``stage``): 7 a block, the embedding, the final
    norm and the head."""
    st = stage or stages(1, ctx.scenario.model.L)[0]
    tied = ctx.scenario.model.tied_embeddings  # one weight for the embedding and the head
    return len(block_params(ctx)) * st.layers + st.embedding + 2 * st.head - tied


# -------------------------------------------------------------------------------------- pipeline split


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage's share of the model as torchtitan splits it."""

    index: int
    embedding: bool
    """Holds ``tok_embeddings`` (the first stage)."""
    layers: int
    head: bool
    """Holds ``norm`` and ``lm_head`` (the last stage)."""


def stages(n: int, L: int) -> tuple[Stage, ...]:
    """torchtitan's split of L blocks into n stages (``_generate_llm_fqn_per_model_part``,
    ``distributed/pipeline_parallel.py:366-476``, the embedding and the head weighing one block each, its
    defaults ``pipeline_parallel_first/last_stage_less_layers`` = 1): L + 2 units dealt out evenly, the
    first stages taking one more of the remainder; the embedding and the head each take one of their
    stage's units. A test holds it against torchtitan's own function."""
    if n == 1:
        return (Stage(0, True, L, True),)
    per, extra = divmod(L + 2, n)
    out, left = [], L
    for k in range(n):
        units = per + (k < extra) - (k == 0) - (k == n - 1)
        take = min(max(units, 0), left)
        left -= take
        out.append(Stage(k, k == 0, take, k == n - 1))
    return tuple(out)


# ---------------------------------------------------------------------------------------- FSDP2


@dataclass(frozen=True, slots=True)
class Groups:
    """torchtitan's FSDP2 groups with their all-gathers per step (steady state: from the second step)."""

    embedding: Group
    block: Group
    head: Group
    norm_padded: int
    """``norm``'s share of the head group (reduce-scattered alone under the chunked loss)."""

    tied: bool = False
    """``enable_weight_tying``: ``head`` is the one ``[tok_embeddings, norm, lm_head]`` group (``fsdp.py:
    180-192``), resharded after the forward only under "always" as the head group is; no embedding group."""

    def all(self, L: int) -> tuple[tuple[Group, int], ...]:
        """(group, how many of it) in the model."""
        if self.tied:
            return (self.block, L), (self.head, 1)
        return (self.embedding, 1), (self.block, L), (self.head, 1)


def groups(ctx: Context, job: Job) -> Groups:
    d = ctx.scenario.parallelism.data_ranks
    policy = job.fsdp_reshard_after_forward
    blocks = policy != "never"  # fsdp.py:54-78: "default" reshards without PP
    chunked = job.loss == "chunked"
    emb, head, norm = (
        vocab_param(ctx, "tok_embeddings"),
        vocab_param(ctx, "lm_head"),
        Param("norm", ctx.scenario.model.h, 1),
    )
    block = block_params(ctx)
    tied = ctx.scenario.model.tied_embeddings  # lm_head's weight is tok_embeddings' (one tensor, counted once)
    return Groups(
        embedding=Group("tok_embeddings", emb.padded(d), emb.numel, 1, int(blocks)),
        block=Group("block", sum(p.padded(d) for p in block), sum(p.numel for p in block), 1, int(blocks)),
        head=Group(
            "[tok_embeddings, norm, lm_head]" if tied else "[norm, lm_head]",
            norm.padded(d) + head.padded(d),
            norm.numel + head.numel,
            1 + chunked,  # the chunked loss's unshard() gathers again (steady state)
            int(chunked or policy == "always"),
        ),
        norm_padded=norm.padded(d),
        tied=tied,
    )


def _fsdp_base(job: Job, groups: tuple[Ranks, ...]) -> ExpectedCollective:
    """An FSDP2 all-gather over ``groups`` in the job's gather dtype, prefetched (its elements, calls, phase
    and source are the caller's)."""
    return ExpectedCollective(
        op=Op.ALL_GATHER,
        axis="dp",
        groups=groups,
        dtype=job.param_dtype,
        elements=0,
        calls=0,
        phase=Phase.FORWARD,
        source="",
        paper_term=EQ3,
        overlaps=True,
    )


def _scatters(
    ctx: Context, base: ExpectedCollective, elements: int, calls: int, phase: Phase, why: str, pipe: int | None = None
) -> list[ExpectedCollective]:
    """FSDP2's gradient reduce-scatter of ``elements`` (a group's padded gradients), summed, in fp32 (HSDP:
    then all-reduced across the replicas, of pipeline rank ``pipe`` or of all)."""
    rs = replace(
        base,
        op=Op.REDUCE_SCATTER,
        dtype=REDUCE_DTYPE,
        elements=elements,
        calls=calls,
        phase=phase,
        source=f"FSDP2 gradient reduce-scatter (summed), {why}",
    )
    lay = ctx.layout
    if lay.replicate == 1:
        return [rs]
    replicas = replace(
        rs,
        op=Op.ALL_REDUCE,
        axis="rep",
        groups=lay.replicate_groups(pipe),
        elements=elements // lay.dp,
        source=f"HSDP: the reduce-scattered shard all-reduced across the replicas, {why}",
    )
    return [rs, replicas]


def steps(ctx: Context) -> int:
    """Forward-backward passes (without a pipeline) or schedule steps (under one) per optimizer step."""
    par = ctx.scenario.parallelism
    return Job.of(ctx.scenario).gradient_accumulation_steps if par.pp > 1 else par.micro_batches


def accumulation(term: str, one: Fraction, m: int) -> Residual:
    """The gradient-accumulation steps beyond the first, ``one`` being a step's bytes of one micro-batch."""
    return Residual(
        term=term,
        name="gradient accumulation",
        bytes=one * (m - 1),
        detail=f"{term} counts one pass; torchtitan's train_step runs m={m} forward-backward passes (under a "
        "pipeline: schedule steps) a step (training.global_batch_size / (local_batch_size x data-parallel "
        "degree), trainer.py:885-930), each syncing its gradients",
    )


def accumulation_after(term: str, paper: Fraction, out: list[Residual], m: int) -> Residual:
    """``accumulation`` of a whole pass: the paper's bytes and the named terms before it, ``m`` times."""
    return accumulation(term, paper + sum((x.bytes for x in out), Fraction(0)), m)


def accumulated(rows: list[ExpectedCollective], m: int) -> list[ExpectedCollective]:
    """One micro-batch's ``rows`` as a step of ``m`` gradient-accumulation steps sends them (without a
    pipeline: torchtitan's train_step syncs every micro-batch); a row sent once a run stays once, and one
    that the run's first micro-batch does not send (``from_step`` 1: the chunked loss's second gather of
    the head group) is sent by the first step's other m - 1."""
    if m == 1:
        return rows
    out = []
    for r in rows:
        if r.once:
            out.append(r)
        elif r.from_step == 1:
            out += [r, replace(r, calls=r.calls * (m - 1), from_step=0)]
        else:
            assert r.from_step == 0, r
            out.append(replace(r, calls=r.calls * m))
    return out


@dataclass(frozen=True, slots=True)
class TorchtitanFSDP:
    """torchtitan's FSDP2 over the data-parallel ranks (``apply_fsdp_to_decoder``): what is gathered and
    reduce-scattered, group by group; Eq. 3 with named terms."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The trainer's rules hold what torchtitan runs (``TORCHTITAN.rules``)."""
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        if ctx.scenario.parallelism.data_ranks == 1:  # a one-rank mesh: torch skips the collectives
            return []
        if ctx.scenario.parallelism.pp > 1:
            return _pipelined_fsdp(ctx)
        job = Job.of(ctx.scenario)
        g, L = groups(ctx, job), ctx.scenario.model.L
        base = _fsdp_base(job, ctx.layout.dp_groups())

        def gather(group: Group, calls: int, phase: Phase, why: str, **kw: Any) -> ExpectedCollective:
            return replace(
                base, elements=group.padded, calls=calls, phase=phase, source=f"FSDP2 all-gather, {why}", **kw
            )

        def scatter(elements: int, calls: int, why: str) -> list[ExpectedCollective]:
            return _scatters(ctx, base, elements, calls, Phase.BACKWARD, why)

        fwd, bwd = Phase.FORWARD, Phase.BACKWARD
        head, first = g.head.name, "the embedding's" if g.tied else "norm's"
        rows = [
            *([] if g.tied else [gather(g.embedding, 1, fwd, "tok_embeddings")]),
            gather(g.block, L, fwd, "each block"),
            gather(g.head, 1, fwd, f"{head} for {first} forward"),
        ]
        if job.loss == "chunked":
            again = f"{head} again: ChunkedLossWrapper's unshard() after the group's post-forward resharded it"
            rows.append(gather(g.head, 1, fwd, again, from_step=0 if job.fsdp_reshard_after_forward == "always" else 1))
            rows += scatter(g.head.padded - g.norm_padded, 1, "lm_head's weight alone, at the loss's last chunk")
            rows.append(gather(g.head, 1, bwd, f"{head} again for the backward (the loss resharded it)"))
            if g.tied:  # the embedding's backward adds to the tied weight's gradient: reduced with norm's
                rows += scatter(g.head.padded, 1, "the tied weight's embedding gradient and norm's")
            else:
                rows += scatter(g.norm_padded, 1, "norm alone")
        else:
            if g.head.backward:
                rows.append(gather(g.head, 1, bwd, "[norm, lm_head] (resharded: policy always)"))
            rows += scatter(g.head.padded, 1, "[norm, lm_head]")
        if g.block.backward:
            rows.append(gather(g.block, L, bwd, "each block (resharded after forward)"))
        rows += scatter(g.block.padded, L, "each block")
        if not g.tied:
            if g.embedding.backward:
                rows.append(gather(g.embedding, 1, bwd, "tok_embeddings (resharded after forward)"))
            rows += scatter(g.embedding.padded, 1, "tok_embeddings")
        return accumulated(rows, ctx.scenario.parallelism.micro_batches)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return [eq3_term(ctx)] if ctx.scenario.parallelism.data_ranks > 1 else []

    def residuals(self, ctx: Context) -> list[Residual]:
        """Eq. 3 (a forward and a backward all-gather and a reduce-scatter of N parameters in the model's
        dtype) to what torchtitan's FSDP2 sends on rank 0, term by term; their sum is exact."""
        par, model = ctx.scenario.parallelism, ctx.scenario.model
        d = par.data_ranks
        if d == 1:
            return []
        job = Job.of(ctx.scenario)
        g, isz, share = groups(ctx, job), model.itemsize, Fraction(d - 1, d)
        every = g.all(model.L) if par.pp == 1 else _first_stage(ctx, g, job)
        padded = sum(grp.padded * n for grp, n in every)
        unpadded = sum(grp.unpadded * n for grp, n in every)
        full = ctx.param_count
        out = [beyond_eq1(ctx, term=EQ3, factor=3 * share, counted=full)]
        if unpadded != full:
            out.append(sharding(ctx, term=EQ3, factor=3 * share, full=full, rank0=unpadded))
        out.append(
            Residual(
                term=EQ3,
                name="dim-0 padding",
                bytes=3 * share * (padded - unpadded) * isz,
                detail=f"every parameter (the fused wqkv as one) is padded on dim 0 to a multiple of d={d}: "
                f"{padded - unpadded:,} elements",
            )
        )
        if par.pp == 1:
            out += _gather_terms(g, model.L, job, share * isz)
        else:
            out += _stage_gather_terms(ctx, every, share * isz)
        p_isz, r_isz = WIRE_ITEMSIZE[job.param_dtype], WIRE_ITEMSIZE[REDUCE_DTYPE]
        precision = share * sum(
            n * grp.padded * ((grp.forward + grp.backward) * (p_isz - isz) + (r_isz - isz)) for grp, n in every
        )
        out.append(
            Residual(
                term=EQ3,
                name="mixed precision",
                bytes=precision,
                detail=f"parameters gathered in {job.param_dtype} (training.mixed_precision_param), gradients "
                f"reduce-scattered in {REDUCE_DTYPE}; Eq. 3 counts {model.dtype}",
            )
        )
        twice = g.head.padded - g.norm_padded if g.tied and job.loss == "chunked" else 0
        if twice:
            out.append(
                Residual(
                    term=EQ3,
                    name="tied weight reduce-scattered twice",
                    bytes=share * twice * r_isz,
                    detail="the chunked loss reduce-scatters lm_head's gradient at its last chunk, then the "
                    "embedding's backward adds to the same (tied) weight, reduced again with norm's",
                )
            )
        r = par.dp_replicate
        if r > 1:
            out.append(
                Residual(
                    term=EQ3,
                    name="HSDP replica all-reduce",
                    bytes=2 * Fraction(r - 1, r) * (sum(grp.padded // d * n for grp, n in every) + twice // d) * r_isz,
                    detail=f"each rank's reduce-scattered gradient shard is all-reduced (fp32) over the {r} replicas "
                    f"(data_parallel_replicate_degree){TIED_TWICE if twice else ''}; Eq. 3 counts "
                    f"d={d}, the sharding group",
                )
            )
        if (n := steps(ctx)) > 1:  # every row above is one pass's, or one schedule step's (accumulated())
            out.append(accumulation_after(EQ3, eq3_term(ctx).bytes, out, n))
        return out


@dataclass(frozen=True, slots=True)
class HeadReplay:
    """The ``[norm, lm_head]`` group on the last stage over one step of the schedule, under the chunked loss."""

    forward: int
    backward: int
    head_alone: int
    """The loss's reduce-scatters of ``lm_head``'s gradient alone (no ``norm`` gradient held yet)."""
    head_and_norm: int
    """... of ``lm_head``'s with ``norm``'s, accumulated by the backwards since the previous forward."""


def head_replay(order: str) -> HeadReplay:
    """Replay the chunked loss (``components/loss.py:724-772``) on the last stage's schedule order. Each
    forward: ``norm`` gathers the group if it is sharded and (the loss having set reshard_after_forward
    true at the end of the step before) frees it; the loss ``unshard()``s it again, reduce-scatters at its
    last chunk the gradients the group holds unsharded (``lm_head``'s, and ``norm``'s when a backward has
    run since the previous forward), then ``reshard()``s it. Each backward: ``norm``'s backward gathers it
    if sharded and, the stage having turned resharding after backward and gradient sync off, keeps it
    gathered with ``norm``'s gradient unreduced. The step's ``perform_reduce_grad`` reduce-scatters the
    ``norm`` gradient of the last backward."""
    gathered = pending = False
    fwd = bwd = alone = both = 0
    for action in order.replace("I", "B").replace("W", ""):  # zero-bubble's backward for the inputs, as B
        if action == "F":
            fwd += 1 + (not gathered)
            both, alone = both + pending, alone + (not pending)
            gathered = pending = False
        else:
            bwd += not gathered
            gathered = pending = True
    return HeadReplay(fwd, bwd, alone, both)


def _pipelined_fsdp(ctx: Context) -> list[ExpectedCollective]:
    """FSDP2 in each pipeline stage (``apply_fsdp_to_decoder`` on the stage's model part, its own data-
    parallel groups), replaying the single-stage schedule's order (``pipelined_gathers``): under a pipeline
    the default policy does not reshard after the forward (``fsdp.py:54-74``), so a group is gathered once
    a step and its gradient reduce-scattered once, by the schedule's ``perform_reduce_grad`` after the last
    backward, outside autograd (recorded in the forward phase). The last stage's ``[norm, lm_head]`` follows
    the chunked loss (``head_replay``)."""
    job, par = Job.of(ctx.scenario), ctx.scenario.parallelism
    g = groups(ctx, job)
    split = stages(par.pp * par.pipeline.virtual_stages, ctx.scenario.model.L)
    return accumulated([row for st in split for row in _stage(ctx, job, g, st) if row.calls], steps(ctx))


def _stage(ctx: Context, job: Job, g: Groups, st: Stage) -> list[ExpectedCollective]:
    """One pipeline stage's FSDP2 calls (``_pipelined_fsdp``)."""
    always = job.fsdp_reshard_after_forward == "always"
    where = f", stage {st.index} ({pipeline_order(ctx, st.index)})"
    base = _fsdp_base(job, ctx.layout.dp_groups(st.index % ctx.scenario.parallelism.pp))  # stage s on rank s mod p
    fwd, bwd = pipelined_gathers(ctx, st.index, always)

    def gathers(group: Group, n: int, what: str) -> list[ExpectedCollective]:
        one = replace(base, elements=group.padded, source=f"FSDP2 all-gather, {what}{where}")
        backward = replace(one, calls=n * bwd, phase=Phase.BACKWARD, source=f"{one.source}, backward")
        return [replace(one, calls=n * fwd), backward]

    def scatter(elements: int, calls: int, what: str, phase: Phase = Phase.FORWARD) -> list[ExpectedCollective]:
        when = "" if phase == Phase.BACKWARD else " (perform_reduce_grad after the last backward)"
        return _scatters(ctx, base, elements, calls, phase, f"{what}{where}{when}", st.index % ctx.layout.pp)

    rows = []
    if st.embedding:
        rows += [*gathers(g.embedding, 1, "tok_embeddings"), *scatter(g.embedding.padded, 1, "tok_embeddings")]
    if st.layers:
        rows += [*gathers(g.block, st.layers, "each block"), *scatter(g.block.padded, st.layers, "each block")]
    if st.head and job.loss != "chunked":
        rows += [*gathers(g.head, 1, "[norm, lm_head]"), *scatter(g.head.padded, 1, "[norm, lm_head]")]
    elif st.head:
        r, head, bwd_phase = head_replay(pipeline_order(ctx, st.index)), g.head.padded, Phase.BACKWARD
        if norm_grad_lost(ctx):  # no norm gradient to carry, nor to reduce at the end (NORM_GRAD_LOST)
            r = replace(r, head_alone=r.head_alone + r.head_and_norm, head_and_norm=0)
        rows += [
            replace(
                base,
                elements=head,
                calls=r.forward,
                source=f"FSDP2 all-gather, [norm, lm_head]: norm's forward and the chunked loss's unshard(){where}",
            ),
            replace(
                base,
                elements=head,
                calls=r.backward,
                phase=bwd_phase,
                source=f"FSDP2 all-gather, [norm, lm_head] for norm's backward, kept until a forward{where}",
            ),
            *scatter(head - g.norm_padded, r.head_alone, "lm_head alone, the loss's last chunk", bwd_phase),
            *scatter(head, r.head_and_norm, "lm_head and the norm gradient held, the loss's last chunk", bwd_phase),
            *scatter(g.norm_padded, 0 if norm_grad_lost(ctx) else 1, "norm's gradient of the last backward"),
        ]
    return rows


def norm_grad_lost(ctx: Context) -> bool:
    """Whether the job loses the final norm's gradient (``NORM_GRAD_LOST``): zero-bubble's split backward
    with FSDP2 over dp > 1 and the chunked loss (measured on torch 2.13: the loss reshards the head group and
    the weight pass then finds no gradient for ``norm``)."""
    par = ctx.scenario.parallelism
    return par.pipeline.schedule == "zero-bubble" and par.data_ranks > 1 and Job.of(ctx.scenario).loss == "chunked"


TIED_TWICE = ", the tied weight's twice"


def rank0_stages(ctx: Context) -> tuple[Stage, ...]:
    """The stages rank 0 holds: stage 0, and under interleaving stages p, 2p, ... (torchtitan's loop style)."""
    par = ctx.scenario.parallelism
    return stages(par.pp * par.pipeline.virtual_stages, ctx.scenario.model.L)[:: par.pp]


def _first_stage(ctx: Context, g: Groups, job: Job) -> tuple[tuple[Group, int], ...]:
    """Rank 0's groups under a pipeline (stage 0: the embedding and its blocks, and under interleaving the
    blocks of its other stages; the head is on the last stage, never rank 0's), with their all-gathers per
    step in the schedule (``pipelined_gathers``)."""
    out: list[tuple[Group, int]] = []
    for st in rank0_stages(ctx):
        fwd, bwd = pipelined_gathers(ctx, st.index, job.fsdp_reshard_after_forward == "always")
        mine = ((g.embedding, int(st.embedding)), (g.block, st.layers))
        out += [(replace(grp, forward=fwd, backward=bwd), n) for grp, n in mine if n]
    return tuple(out)


def _stage_gather_terms(ctx: Context, every: tuple[tuple[Group, int], ...], per_element: Fraction) -> list[Residual]:
    """Rank 0's all-gathers under a pipeline beyond Eq. 3's one forward and one backward per parameter."""
    policy = Job.of(ctx.scenario).fsdp_reshard_after_forward
    order = ", ".join(f"{st.index}: {pipeline_order(ctx, st.index)}" for st in rank0_stages(ctx))
    fwd = sum((grp.forward - 1) * grp.padded * n for grp, n in every)
    bwd = sum((grp.backward - 1) * grp.padded * n for grp, n in every)
    why = {
        "default": "under a pipeline the default policy does not reshard after the forward (distributed/fsdp.py:54-74)",
        "never": "fsdp_reshard_after_forward never",
        "always": "fsdp_reshard_after_forward always",
    }[policy]
    sched = f"in the {ctx.scenario.parallelism.pipeline.schedule} schedule on rank 0's stages ({order})"
    terms = (
        (
            fwd,
            "forward all-gathers per micro-batch",
            f"{sched} a forward after a forward gathers again ({why}), one after a backward finds the group "
            "gathered (torch's stage turns resharding after backward off)",
        ),
        (
            bwd,
            "backward all-gathers",
            f"{sched} a backward gathers only a group its forward freed ({why}); one after a backward finds it "
            "gathered",
        ),
    )
    return [Residual(term=EQ3, name=n, bytes=e * per_element, detail=d) for e, n, d in terms if e]


def _gather_terms(g: Groups, L: int, job: Job, per_element: Fraction) -> list[Residual]:
    """The all-gathers torchtitan issues beyond Eq. 3's one forward and one backward per parameter."""
    terms = (
        (
            g.head.forward > 1,
            f"chunked loss re-gathers {g.head.name}",
            (g.head.forward - 1) * g.head.padded,
            "ChunkedLossWrapper unshards the head group around its chunk loop and reshards it after "
            "(components/loss.py:728-772): the group's post-forward frees it, the loss gathers it again",
        ),
        (
            not g.head.backward,
            f"{g.head.name} kept gathered for the backward",
            -g.head.padded,
            "torchtitan does not reshard the head group after the forward unless the policy is always "
            "(distributed/fsdp.py:202-207): its backward gathers nothing",
        ),
        (
            not g.block.backward,
            "fsdp_reshard_after_forward never",
            -(L * g.block.padded + (0 if g.tied else g.embedding.padded)),
            "the blocks" + ("" if g.tied else " and the embedding") + " stay gathered after the forward: their "
            "backward gathers nothing",
        ),
    )
    return [Residual(term=EQ3, name=n, bytes=e * per_element, detail=d) for on, n, e, d in terms if on]


# --------------------------------------------------------------------------------- tensor parallel


@dataclass(frozen=True, slots=True)
class TorchtitanTP:
    """torchtitan's declarative tensor parallelism with sequence parallelism; Eq. 5 with named terms."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.tp == 1 or not par.sequence_parallel:  # without SP: measured only (baseline-only, a rule says)
            return []
        split = stages(par.pp * par.pipeline.virtual_stages, m.L)
        rows = [row for st in split for row in _tp_stage(ctx, st)]
        return accumulated(rows, steps(ctx)) if par.pp > 1 else rows  # (without one, per micro-batch already)

    def _units(self, ctx: Context) -> int:
        """Rank 0's all-gathers and reduce-scatters of one activation in one micro-batch under Eq. 5 (counted
        in ``paper_term``): its stage's blocks (all of them without a pipeline) and the embedding's."""
        par = ctx.scenario.parallelism
        L0 = sum(st.layers for st in rank0_stages(ctx))
        ac = Job.of(ctx.scenario).ac(par.activation_checkpointing)
        return 8 * L0 + 2 + {"none": 0, "selective": 2 * L0, "full": 4 * L0}[ac]

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.tp == 1 or not par.sequence_parallel:
            return []
        eq5 = eq5_tensor(L=Fraction(m.L, par.pp), b=par.micro_batch, s=m.s, h=m.h, t=par.tp)
        L = f"L/p={m.L}/{par.pp}" if par.pp > 1 else f"L={m.L}"
        formula = f"(12L+2)*b*s*h*(t-1)/t, {L}, b={par.micro_batch}, s={m.s}, h={m.h}, t={par.tp}"
        return [rank0_term(ctx, equation=EQ5, formula=formula, elements=eq5)]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.tp == 1 or not par.sequence_parallel:
            return []
        job = Job.of(ctx.scenario)
        unit = Fraction(ctx.bsh * (par.tp - 1), par.tp) * m.itemsize
        L0, mb = sum(st.layers for st in rank0_stages(ctx)), par.micro_batches  # a pipeline's, or accumulation's
        units = self._units(ctx)
        ac = job.ac(par.activation_checkpointing)
        why = {
            "none": "no activation checkpointing: nothing is recomputed; Eq. 5 assumes 2 all-reduces a layer",
            "selective": "torchtitan's selective checkpointing saves reduce-scatter outputs, not all-gathers "
            "(activation_checkpoint.py:61-64): 2 all-gathers a layer recomputed, Eq. 5 assumes 2 all-reduces",
            "full": "",
        }[ac]
        out = []
        if par.cp > 1:  # the units below are of the rank's sequence shard (ctx.bsh)
            c = par.cp
            out.append(
                Residual(
                    term=EQ5,
                    name="context-parallel sequence shard",
                    bytes=self.paper_terms(ctx)[0].bytes * Fraction(1 - c, c),
                    detail=f"under context parallelism each rank holds s/c = {m.s}/{c} of the sequence, whose "
                    "activations its TP collectives move; Eq. 5 counts the whole s",
                )
            )
        if why:
            out.append(Residual(term=EQ5, name=f"recomputation ({ac})", bytes=(units - 2 - 12 * L0) * unit, detail=why))
        if Fraction(m.L, par.pp) != L0:
            out.append(
                Residual(
                    term=EQ5,
                    name="torchtitan's stage split",
                    bytes=12 * (L0 - Fraction(m.L, par.pp)) * unit,
                    detail=f"rank 0 holds {L0} of the {m.L} blocks (torchtitan weighs the embedding and the head "
                    f"as a block each, pipeline_parallel.py:366-476); Eq. 5 counts L/p",
                )
            )
        if mb > 1:
            out.append((micro_batches if par.pp > 1 else accumulation)(EQ5, units * unit, mb))
        p_isz = WIRE_ITEMSIZE[job.param_dtype]
        if p_isz != m.itemsize:
            out.append(
                Residual(
                    term=EQ5,
                    name="activations in a lower precision",
                    bytes=units * mb * unit * (p_isz - m.itemsize) / m.itemsize,
                    detail=f"FSDP2's mixed-precision policy ({job.mixed_precision_param}) applies even on a one-rank "
                    f"data-parallel mesh: the layers compute, and TP moves, {job.param_dtype} activations; Eq. 5 "
                    f"counts {m.dtype}",
                )
            )
        if par.pp > 1 and (n := steps(ctx)) > 1:  # the pipeline's schedule steps of one optimizer step
            out.append(accumulation_after(EQ5, self.paper_terms(ctx)[0].bytes, out, n))
        return out


def _tp_stage(ctx: Context, st: Stage) -> list[ExpectedCollective]:
    """Tensor parallelism with sequence parallelism on one pipeline stage's model part (the whole model,
    ``stages(1, L)``, without a pipeline), per micro-batch: the embedding's reduce-scatter on the first
    stage, each block's two all-gathers and two reduce-scatters and their mirrors, the recomputed ones, the final norm's
    gather and the loss-parallel all-reduces on the last stage; the norms' replicated weights all-reduce
    their gradients: without a pipeline in the backward, in the activations' dtype; under one with FSDP2's
    reduce of their group, in fp32, at the schedule's ``perform_reduce_grad`` (the forward phase), the final
    norm's also with each of the chunked loss's reduce-scatters that carry its gradient (``head_replay``)."""
    par, m, job = ctx.scenario.parallelism, ctx.scenario.model, Job.of(ctx.scenario)
    pipelined = par.pp > 1
    L, ac, mb = st.layers, job.ac(par.activation_checkpointing), par.micro_batches  # a pipeline's, or accumulation's
    where = f", stage {st.index}" if pipelined else ""
    base = ExpectedCollective(
        op=Op.ALL_GATHER,
        axis="tp",
        groups=ctx.layout.tp_groups(st.index % par.pp),  # stage s on pipeline rank s mod p
        dtype=job.param_dtype,
        elements=ctx.bsh,
        calls=0,
        phase=Phase.FORWARD,
        source="",
        paper_term=EQ5,
    )
    ag, rs, fwd, bwd = Op.ALL_GATHER, Op.REDUCE_SCATTER, Phase.FORWARD, Phase.BACKWARD

    def r(op: Op, calls: int, phase: Phase, source: str, term: str | None = EQ5) -> ExpectedCollective:
        return replace(base, op=op, calls=calls * mb, phase=phase, source=source + where, paper_term=term)

    rows = []
    if st.embedding:
        rows += [
            r(rs, 1, fwd, "SP reduce-scatter of the vocabulary-parallel embedding's output (Partial -> Shard(1))"),
            r(ag, 1, bwd, "SP all-gather of the embedding output's gradient"),
        ]
    rows += [
        r(ag, 2 * L, fwd, "SP all-gather of each block's attention and FFN inputs"),
        r(rs, 2 * L, fwd, "SP reduce-scatter of each block's wo and w2 outputs"),
        r(ag, 2 * L, bwd, "SP all-gather of the wo and w2 outputs' gradients"),
        r(rs, 2 * L, bwd, "SP reduce-scatter of the attention and FFN inputs' gradients"),
    ]
    if ac != "none":
        rows.append(r(ag, 2 * L, bwd, f"SP all-gathers recomputed by {ac} activation checkpointing"))
    if ac == "full":
        rows.append(r(rs, 2 * L, bwd, "SP reduce-scatters recomputed by full activation checkpointing"))
    norm = replace(
        base,
        op=Op.ALL_REDUCE,
        dtype=REDUCE_DTYPE if pipelined else base.dtype,  # FSDP2 reduces it (fp32) or autograd (bf16)
        elements=m.h,
        calls=2 * L * (1 if pipelined else mb),  # a pipeline reduces once a step, autograd once a backward
        phase=Phase.FORWARD if pipelined else bwd,
        source="SP norm-weight gradient all-reduce (Replicate weight, Partial gradient), each block's two" + where,
        paper_term=None,
    )
    rows.append(norm)
    if st.head:
        tokens = par.micro_batch * (m.s // par.cp) // job.chunks  # the rank's sequence shard under CP
        rows += [
            r(ag, 1, fwd, "SP all-gather of the final norm's output for the column-parallel head", None),
            r(rs, 1, bwd, "SP reduce-scatter of the final norm output's gradient", None),
            replace(
                base,
                op=Op.ALL_REDUCE,
                dtype="fp32",
                elements=tokens,
                calls=3 * job.chunks * mb,
                source="loss-parallel cross-entropy all-reduces (max, sum of exp, target logit) per loss chunk" + where,
                paper_term=None,
                overlaps=False,
            ),
        ]
        final = replace(
            norm, calls=1 if pipelined else mb, source="SP norm-weight gradient all-reduce, the final norm's" + where
        )
        if pipelined and job.loss == "chunked":  # with each loss reduce-scatter that carries its gradient
            carried = head_replay(pipeline_order(ctx, st.index)).head_and_norm
            rows.append(replace(final, calls=carried, phase=bwd, source=final.source + ", at the loss"))
        rows.append(final)
    if L:
        hd = m.h // m.a
        rows.append(
            replace(
                base,
                op=Op.BROADCAST,
                dtype="fp32",
                elements=m.s * hd,  # complex64 s x hd/2, sent as its fp32 view
                calls=L,
                phase=Phase.INIT,
                once=True,
                source="RoPE cache broadcast (a Replicate buffer distributed), each layer" + where,
                paper_term=None,
            )
        )
    return [row for row in rows if row.calls]


# ------------------------------------------------------------------------------- the step's others


@dataclass(frozen=True, slots=True)
class TorchtitanStep:
    """What ``train_step`` and construction send besides FSDP2 and TP: the token count, the gradient
    norm, the logging steps' metrics, the seed broadcast. None of it is in the paper."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s, par, lay = ctx.scenario, ctx.scenario.parallelism, ctx.layout
        job = Job.of(s)
        base = ExpectedCollective(
            op=Op.ALL_REDUCE,
            axis="dp",
            groups=lay.dp_groups(),
            dtype="int64",
            elements=1,
            calls=1,
            phase=Phase.FORWARD,
            source="global valid-token count all-reduce (the loss is normalised by it, trainer.py:897-901)",
        )
        rows = []
        if s.world_size > 1 and job.seed is None:
            rows.append(
                replace(
                    base,
                    op=Op.BROADCAST,
                    axis="world",
                    groups=lay.world(),
                    dtype="uint8",
                    elements=8,
                    phase=Phase.INIT,
                    once=True,
                    source="rank 0's RNG seed broadcast (debug.seed unset, distributed/utils.py:258-263)",
                )
            )
        axes: list[tuple[Axis, tuple[Ranks, ...]]] = []
        if lay.replicate > 1:  # the batch and loss meshes span the replicas too (dp_replicate x dp_shard)
            base = replace(base, groups=lay.data_groups())
        if par.dp * par.dp_replicate > 1:  # the batch mesh: dp alone, each of its groups one cp index
            rows.append(replace(base, groups=lay.batch_groups()) if par.cp > 1 else base)
        if par.data_ranks > 1:
            axes.append(("dp", lay.dp_groups()))
        if par.tp > 1:
            axes.append(("tp", lay.tp_groups()))
        for axis, grps in axes:
            clip = replace(
                base,
                axis=axis,
                groups=grps,
                dtype="fp32",
                elements=param_tensors(ctx),
                phase=Phase.OPTIMIZER,
                source=f"clip_grad_norm_: the per-tensor partial norms all-reduced over the {axis} mesh dimension",
            )
            if par.pp == 1:
                rows.append(clip)
                continue
            split = stages(par.pp * par.pipeline.virtual_stages, s.model.L)
            for r in range(par.pp):  # each pipeline rank's own tensors (all its stages'), over its own groups
                mine = lay.dp_groups(r) if axis == "dp" else lay.tp_groups(r)
                held = split[r :: par.pp]
                which = "+".join(str(st.index) for st in held)
                lost = int(norm_grad_lost(ctx) and any(st.head for st in held))  # norm has no gradient to count
                rows.append(replace(clip, groups=mine, elements=sum(param_tensors(ctx, st) for st in held) - lost,
                                    source=f"{clip.source}, stage {which}'s tensors"))  # fmt: skip
        if par.data_ranks > 1:
            rows += _metrics(base, job, s.warmup_steps + s.steps)
        return rows

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return []

    def residuals(self, ctx: Context) -> list[Residual]:
        return []


@dataclass(frozen=True, slots=True)
class TorchtitanPP(PipelineParallel):
    """torchtitan's pipeline (``distributed/pipeline_parallel.py``) on ``torch.distributed.pipelining``:
    the model split into p x v stages (the first holds ``tok_embeddings``, the last ``norm`` and
    ``lm_head``), each stage's FSDP2 on its own (one-rank, so silent) data-parallel mesh, stepped by the
    scenario's schedule over ``training.local_batch_size / pipeline_parallel_microbatch_size`` micro-batches.
    Per micro-batch each stage boundary carries the activation forward and its gradient back, b*s*h each,
    in FSDP2's ``param_dtype`` (the stages compute in it), recorded in the forward phase: the schedule
    sends outside autograd (``_torch_pipelining``). ``clip_grad_norm_`` all-reduces the total norm across
    the stages (``distributed/utils.py:667-672``). The first step also infers the stages' shapes
    (int32 votes and pickled metadata, ``stage.py:1720-1810``): a warm-up step, never reconciled (the rules
    require one)."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def activation_dtype(self, ctx: Context) -> str:
        return Job.of(ctx.scenario).param_dtype

    def residuals(self, ctx: Context) -> list[Residual]:
        out = PipelineParallel.residuals(self, ctx)
        if ctx.scenario.parallelism.pp == 1:
            return out
        t = ctx.scenario.parallelism.tp
        if t > 1:
            sent = self._eq4(ctx) * ctx.scenario.model.itemsize + sum((r.bytes for r in out), Fraction(0))
            out.append(
                Residual(
                    term=PP_TERM,
                    name="sequence-parallel shards",
                    bytes=-sent * Fraction(t - 1, t),
                    detail=f"under sequence parallelism each of the t={t} tensor-parallel ranks sends its s/t shard "
                    "of the activation and its gradient to its peer of the next stage; Eq. 4 counts the whole b*s*h",
                )
            )
        if (n := steps(ctx)) > 1:
            out.append(accumulation_after(PP_TERM, self._eq4(ctx) * ctx.scenario.model.itemsize, out, n))
        return out

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par = ctx.scenario.parallelism
        if par.pp == 1:
            return []
        act = self.activation_dtype(ctx)
        shard = ctx.bsh // par.tp  # under sequence parallelism each tensor-parallel rank sends its s/t shard
        rows = [
            replace(
                r,
                dtype=act,
                elements=shard,
                phase=Phase.FORWARD,
                source=r.source.replace("torch PP", "torchtitan PP") + (", its sequence shard" if par.tp > 1 else ""),
            )
            for r in _torch_pipelining(ctx)
        ]
        rows = accumulated(rows, steps(ctx))  # each schedule step of the optimizer step sends them
        rows.append(
            ExpectedCollective(
                op=Op.ALL_REDUCE,
                axis="pp",
                groups=ctx.layout.pp_groups(),
                dtype="fp32",
                elements=1,
                calls=1,
                phase=Phase.OPTIMIZER,
                source="clip_grad_norm_: the total norm all-reduced across the stages (distributed/utils.py:667-672)",
            )
        )
        return rows


@dataclass(frozen=True, slots=True)
class TorchtitanCP(ContextParallel):
    """torchtitan's context parallelism with flex attention (``distributed/context_parallel/api.py:57-77``,
    ``flex_cp_allgather``): each layer all-gathers its K and V shards (b x kv heads x s/c x head size each,
    in FSDP2's ``param_dtype``) over the cp ranks before attention; autograd's backward of each all-gather is
    a reduce-scatter of its gradient, in the same dtype; activation checkpointing re-runs the forward's
    all-gathers in the backward; with TP inside, each TP rank its own K/V heads. FSDP2 shards over the
    dp x cp ranks (``TorchtitanFSDP``), the metrics and the gradient norm go over them too, the global
    token count over dp alone (none with dp = 1). Against
    commgate's derivation of V_cp (forward K/V, backward K/V, dK/dV: three passes), the backward K/V pass
    is the recomputation's, so without checkpointing it is a named term."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par, L = ctx.scenario.parallelism, ctx.scenario.model.L
        if par.cp == 1:
            return []
        gather = ExpectedCollective(
            op=Op.ALL_GATHER,
            axis="cp",
            groups=ctx.layout.cp_groups(),
            dtype=Job.of(ctx.scenario).param_dtype,
            elements=par.cp * kv_buffer(ctx) // 2,  # K or V: half the buffer of kv_buffer's K and V
            calls=2 * L,
            phase=Phase.FORWARD,
            source="flex CP: each layer's K and V all-gathered (context_parallel/api.py:57-77)",
            paper_term=CP_TERM,
        )
        rows = [
            gather,
            replace(
                gather,
                op=Op.REDUCE_SCATTER,
                phase=Phase.BACKWARD,
                source="flex CP: the all-gathers' backward, K's and V's gradients reduce-scattered",
            ),
        ]
        if par.activation_checkpointing:
            rows.append(
                replace(gather, phase=Phase.BACKWARD, source="flex CP: K and V all-gathered again by the recomputation")
            )
        return accumulated(rows, par.micro_batches)

    def residuals(self, ctx: Context) -> list[Residual]:
        par, model = ctx.scenario.parallelism, ctx.scenario.model
        if par.cp == 1:
            return []
        isz, act = model.itemsize, Job.of(ctx.scenario).param_dtype
        block = par.cp * kv_buffer(ctx) * Fraction(par.cp - 1, par.cp)  # one K/V pass, the paper's convention
        passes = 2 + par.activation_checkpointing
        out = []
        if not par.activation_checkpointing:
            out.append(
                Residual(
                    term=CP_TERM,
                    name="no backward K/V pass",
                    bytes=-model.L * block * isz,
                    detail="flex's all-gather keeps the gathered K and V for the backward; only a recomputation "
                    "(activation checkpointing) gathers them again",
                )
            )
        if WIRE_ITEMSIZE[act] != isz:
            out.append(
                Residual(
                    term=CP_TERM,
                    name="activations in a lower precision",
                    bytes=model.L * passes * block * (WIRE_ITEMSIZE[act] - isz),
                    detail=f"K, V and their gradients move in {act}; the derivation counts {model.dtype}",
                )
            )
        if par.micro_batches > 1:
            out.append(accumulation_after(CP_TERM, self.paper_terms(ctx)[0].bytes, out, par.micro_batches))
        return out


def _metrics(base: ExpectedCollective, job: Job, steps: int) -> list[ExpectedCollective]:
    """The logging steps' all-reduces over the loss mesh (the data-parallel ranks): the loss's sum and
    max, the tokens seen (``trainer.py:957-985``); every step with ``log_freq`` 1, else once at each
    logging step among the run's ``steps``."""
    rows = [
        replace(base, dtype="fp32", calls=2, source="metrics: the loss's sum and max all-reduced (logging steps)"),
        replace(base, source="metrics: the tokens seen all-reduced (logging steps)"),
    ]
    rows = [replace(r, phase=Phase.OPTIMIZER) for r in rows]
    if job.log_freq == 1:
        return rows
    return [replace(r, once=True, at_step=k) for k in range(steps) if job.logs(k) for r in rows]


def components(scenario: Scenario, scheme: Scheme) -> tuple[Component, ...]:
    """torchtitan's own model of what it sends, whichever scheme (fsdp or tp) names the scenario's axes."""
    return (TorchtitanFSDP(), TorchtitanTP(), TorchtitanPP(), TorchtitanCP(), TorchtitanStep())


# ------------------------------------------------------------------------------------------- rules

P = "parallelism"
TT = "torchtitan"


def _block(c: Check) -> dict[str, Any]:
    block = c.doc.get(TT, {})
    return dict(block) if isinstance(block, Mapping) else {}


FLEX_BLOCK = 128
"""Flex attention's block size: under context parallelism the sequence must split into whole blocks."""

MIN_VOCAB = 258
"""A byte-level tokenizer's least vocabulary (256 bytes and the two special tokens): the run trains torchtitan
on text through one (``commgate.run.trainers.torchtitan.make_assets``)."""


def torchtitans_model(c: Check) -> None:
    """torchtitan's llama3 package: a Llama-style decoder, tied or not (tied: not under its pipeline), no
    biases, fp32 parameters."""
    m = c.model
    if m.module is not None:
        c.bad(["model", "module"], f"{m.module!r}: torchtitan builds its own llama3 model; give its dimensions")
        return
    if not m.llama:
        c.bad(["model", "architecture"], f"{m.architecture!r}: torchtitan's llama3 model: set architecture: llama")
    if m.tied_embeddings and c.par.tp > 1 and c.par.dp > 1:
        c.bad(
            ["model", "tied_embeddings"],
            "true: with FSDP2 over dp and TP, the tied group's all-gather carries the weight's TP shard twice and "
            "its reduce-scatter once (measured, not modelled yet): tp = 1, dp = 1, or untied",
        )
    if m.tied_embeddings and c.par.pp > 1:
        c.bad(
            ["model", "tied_embeddings"],
            "true: torchtitan refuses weight tying under its pipeline (models/common/decoder.py:139, "
            "NotImplementedError): untie, or no pipeline",
        )
    if m.qkv_bias:
        c.bad(["model", "qkv_bias"], "true: torchtitan's llama3 layers have no biases")
    if m.V < MIN_VOCAB:  # refused when loaded, not on the ranks (found by tests/trainer_gen.py's draws)
        c.bad(
            ["model", "V"],
            f"{m.V}: a torchtitan run reads text through a byte-level tokenizer of at least {MIN_VOCAB} tokens "
            f"(256 bytes and 2 special tokens); give V >= {MIN_VOCAB}",
        )
    if m.dtype != "fp32":
        c.bad(
            ["model", "dtype"],
            f"{m.dtype!r}: torchtitan trains fp32 parameters (training.dtype float32) under its mixed precision "
            "(torchtitan.mixed_precision_param); full-bf16 training is not modelled: use fp32",
        )


def torchtitans_axes(c: Check) -> None:
    """What torchtitan runs on torch 2.13 CPU and the model holds: FSDP2 (HSDP) over dp (scheme with FSDP),
    TP with dp = 1 (the tensor scheme), its pipeline with FSDP2 in its stages, context parallelism with
    FSDP2 and TP; ``micro_batches``: the pipeline's, or without one gradient accumulation's steps."""
    par, acc = c.par, _block(c).get("gradient_accumulation_steps", 1)
    if par.pp == 1:
        if acc != 1:
            c.bad(
                [TT, "gradient_accumulation_steps"],
                f"{acc}: without a pipeline torchtitan's accumulation steps are parallelism.micro_batches; give "
                "them there",
            )
    elif par.tp > 1 and par.pipeline.virtual_stages > 1:
        c.bad(
            [P, "pipeline", "schedule"],
            f"{par.pipeline.schedule}: torchtitan's 3-D under an interleaved schedule aborts on torch 2.13's CPU "
            "gloo (SIGABRT in a stage's forward, its peers' sends failing with writev Bad address; seen here), "
            "so it is not run: gpipe or 1f1b with tensor parallelism, or tp = 1",
        )
    elif par.pp * par.pipeline.virtual_stages > c.model.L + 2:
        c.bad(
            [P, "pp"],
            f"{par.pp}: torchtitan splits L + 2 = {c.model.L + 2} units (the blocks, the embedding and the head) "
            f"over pp x virtual_stages = {par.pp * par.pipeline.virtual_stages} stages and refuses an empty one: "
            "fewer stages or more layers",
        )
    elif c.doc.get("warmup_steps", 1) == 0:
        c.bad(
            ["warmup_steps"],
            "0: torchtitan's pipeline infers its stages' shapes in the first step (pickled "
            "metadata the model does not predict): give it a warm-up step",
        )
    if par.cp > 1 and par.pp > 1:
        c.bad(
            [P, "cp"],
            f"{par.cp}: torchtitan's context parallelism is modelled with FSDP2 over dp x cp and TP inside "
            "(pp = 1): with its pipeline not yet",
        )
    if par.cp > 1 and c.model.s % (FLEX_BLOCK * par.cp):
        c.bad(
            ["model", "s"],
            f"{c.model.s}: flex attention under context parallelism needs s divisible by cp={par.cp} x its block "
            f"size {FLEX_BLOCK} (torch's flex CP raises NotImplementedError otherwise)",
        )
    if "fsdp" in c.declared:
        c.bad(
            [P, "fsdp"],
            "torchtitan's FSDP2 options are its own: torchtitan.fsdp_reshard_after_forward and "
            "torchtitan.mixed_precision_param (reduce is float32)",
        )
    if c.scheme.tensor and par.dp > 1:
        c.bad(
            [P, "dp"],
            f"{par.dp}: torchtitan shards over the data-parallel ranks with FSDP2: scheme {c.names(lambda r: r.fsdp)}",
        )


def torchtitans_modes(c: Check) -> None:
    """What the model holds of torchtitan's modes: sequence parallelism under TP, no float8 under TP, an
    activation-checkpointing mode only with checkpointing on, a sequence the chunks and TP divide."""
    par, block = c.par, _block(c)
    job = Job.from_block(block)
    if par.tp > 1 and not par.sequence_parallel and c.checked:
        c.bad(
            [P, "sequence_parallel"],
            "false: torchtitan's TP without sequence parallelism is measured, not modelled: set "
            "expectations: {model: {check: false}} (baseline-only) or sequence_parallel: true",
        )
    if par.tp > 1 and "float8" in job.left_off and c.checked:
        c.bad(
            [TT, "left_off"],
            "float8 with tensor parallelism adds amax all-reduces the model does not hold: set "
            "expectations: {model: {check: false}} (baseline-only)",
        )
    if "activation_checkpoint" in block and not par.activation_checkpointing:
        c.bad(
            [TT, "activation_checkpoint"],
            f"{block['activation_checkpoint']}: parallelism.activation_checkpointing is false; set it true",
        )
    s = c.model.s
    if job.loss == "chunked" and s % job.loss_chunks:
        c.bad(["model", "s"], f"{s}: ChunkedLossWrapper splits the sequence into loss_chunks={job.loss_chunks}")
    if par.tp > 1 and s % par.tp:
        c.bad(["model", "s"], f"{s}: sequence parallelism splits the sequence over tp={par.tp}")
    if (
        par.pp > 1
        and par.pipeline.schedule != "gpipe"
        and job.loss == "chunked"
        and job.chunks == 1
        and job.param_dtype != "fp32"
    ):
        c.bad(
            [TT, "loss_chunks"],
            "1: torchtitan itself fails this job: under a pipeline whose last stage runs a backward before a "
            "forward, the loss's single chunk reduce-scatters lm_head's bf16 gradient with norm's fp32 "
            "accumulated one and FSDP2 asserts a uniform dtype (seen on torch 2.13): 2 or more chunks, "
            "gpipe, or mixed_precision_param float32",
        )
    if par.pp > 1 and par.pipeline.schedule == "zero-bubble" and job.ac(par.activation_checkpointing) == "selective":
        c.bad(
            [P, "activation_checkpointing"],
            "true: torchtitan itself fails this job: InterleavedZeroBubble runs each backward in two passes "
            '(inputs, then weights) and selective checkpointing allows one (RuntimeError "Trying to backward '
            'an extra time", seen on torch 2.13): torchtitan.activation_checkpoint full, or none',
        )


GIVEN: dict[str, str] = {
    "module": "torchtitan.module",
    "config": "torchtitan.config",
    "parallelism.data_parallel_shard_degree": "parallelism.dp",
    "parallelism.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "parallelism.tensor_parallel_degree": "parallelism.tp",
    "parallelism.pipeline_parallel_degree": "parallelism.pp",
    "parallelism.context_parallel_degree": "parallelism.cp",
    "parallelism.pipeline_parallel_schedule": "parallelism.pipeline.schedule",
    "parallelism.pipeline_parallel_microbatch_size": "parallelism.micro_batch",
    "training.disable_cuda_graphs": "the adapter (under a pipeline: torchtitan refuses PP otherwise, trainer.py:179)",
    "parallelism.enable_sequence_parallel": "parallelism.sequence_parallel",
    "parallelism.fsdp_reshard_after_forward": "torchtitan.fsdp_reshard_after_forward",
    "training.enable_cpu_offload": "torchtitan.cpu_offload",
    "parallelism.spmd_backend": "the adapter (partial_dtensor: spmd_types fails in torch 2.13's fully_shard)",
    "training.local_batch_size": "parallelism.micro_batch (x micro_batches under a pipeline)",
    "training.global_batch_size": "parallelism.micro_batch x micro_batches x dp x dp_replicate "
    "(x torchtitan.gradient_accumulation_steps under a pipeline)",
    "training.seq_len": "model.s",
    "training.dtype": "model.dtype",
    "training.mixed_precision_param": "torchtitan.mixed_precision_param",
    "training.mixed_precision_reduce": "torchtitan (float32, its only value)",
    "metrics.log_freq": "torchtitan.log_freq",
    "loss.num_chunks": "torchtitan.loss_chunks",
    "debug.seed": "torchtitan.seed",
    "hf_assets_path": "the run (a tokenizer made in its private directory)",
    "dump_folder": "the run (its private directory)",
    "dataloader": "the run (local data made in its private directory)",
    "activation-checkpoint": "parallelism.activation_checkpointing and torchtitan.activation_checkpoint",
}
"""torchtitan's command-line keys the scenario (or the run) gives: refused in ``torchtitan.args``."""

BLOCKED: dict[str, str] = {
    "parallelism.expert_parallel_degree": "llama3 has no experts",
    "parallelism.enable_fsdp_symm_mem": "symmetric memory is CUDA-only",
    "compile.enable": "compile does not run on torch 2.13 CPU (InductorError compiling a block with flex attention)",
    "compile.enable_async_tensor_parallel": "async TP needs compile and CUDA symmetric memory",
    "parallelism.pipeline_parallel_layers_per_stage": "the model holds torchtitan's default split of the blocks",
    "parallelism.pipeline_parallel_first_stage_less_layers": "the model holds torchtitan's default split (1)",
    "parallelism.pipeline_parallel_last_stage_less_layers": "the model holds torchtitan's default split (1)",
    "parallelism.module_fqns_per_model_part": "the model holds torchtitan's default split of the blocks",
    "parallelism.pipeline_parallel_schedule_csv": "a schedule read from a CSV file is not modelled (the model "
    "replays the named schedule, parallelism.pipeline.schedule)",
    "comm.mode": "the gate's ranks run on commgate's real process group, which torchtitan's init_distributed keeps "
    "(distributed/utils.py:466-471): a fake or local backend would not be the job judged",
    "help": "torchtitan's help is not a job",
    "checkpoint.enable": "checkpoints are not modelled (the gate steps train_step only; DCP's saves and loads "
    "gather and broadcast the sharded state)",
    "validator.enable": "validation is not modelled (the gate steps train_step only; a validation pass gathers "
    "and all-reduces as a step does)",
    "debug.deterministic": "torchtitan's set_determinism compiles flex attention again (distributed/utils.py:214-236), "
    "over the adapter's P3: it does not run on torch 2.13 CPU",
}
"""torchtitan's command-line keys that do not run on torch 2.13 CPU or are not modelled (their negation,
``--compile.no-enable``, passes)."""


def arg_key(arg: str) -> tuple[str, bool] | None:
    """(torchtitan's key, negated) of an override flag (``--parallelism.no-enable-sequence-parallel`` ->
    ``parallelism.enable_sequence_parallel``, True), or None for a value; ``activation-checkpoint:full`` (a
    tyro subcommand) -> ``activation-checkpoint``."""
    if arg.startswith("activation-checkpoint") or arg.startswith("activation_checkpoint"):
        return "activation-checkpoint", False
    if not arg.startswith("--"):
        return None
    path = arg[2:].split("=", 1)[0].split(".")
    last = path[-1]
    negated = re.match(r"no[-_]", last) is not None
    path[-1] = last[3:] if negated else last
    return ".".join(p.replace("-", "_") for p in path), negated


def torchtitans_args(c: Check) -> None:
    """``torchtitan.args``: no key the scenario gives, nothing that does not run here."""
    args = _block(c).get("args", [])
    for i, arg in enumerate(args):
        parsed = arg_key(arg) if arg != "-h" else ("help", False)
        if parsed is None:
            continue
        key, negated = parsed
        section = key.split(".")[0]
        given = GIVEN.get(key) or (GIVEN.get(section) if section in ("dataloader",) else None)
        if given:
            c.bad([TT, "args", i], f"{arg!r}: {key} is given by {given}; remove it")
        elif key in BLOCKED and not negated:
            c.bad([TT, "args", i], f"{arg!r}: {BLOCKED[key]}; remove it")
        elif key == "training.steps" and (steps := _value(args, i)) is not None:
            total = c.doc.get("warmup_steps", 1) + c.doc.get("steps", 3)
            if isinstance(total, int) and steps < total:  # its learning-rate schedule ends before the gate's run
                c.bad(
                    [TT, "args", i],
                    f"{arg!r}: the job's {steps} step(s), fewer than the {total} the gate runs (warmup_steps + steps): "
                    "torchtitan's learning-rate schedule ends before them; give at least as many",
                )


def _value(args: Sequence[Any], i: int) -> int | None:
    """The integer an override at ``args[i]`` gives (``--key=N`` or ``--key N``), or None."""
    arg = str(args[i])
    text = arg.split("=", 1)[1] if "=" in arg else str(args[i + 1]) if i + 1 < len(args) else ""
    return int(text) if text.strip().lstrip("-").isdigit() else None


def torchtitans_config(c: Check) -> None:
    """``torchtitan.config`` names a function of the config registry it reads (else the run fails in
    torchtitan's ``ConfigManager``, "Config function ... not found", after its ranks start): checked where the
    registry's source is found, read without importing it (torchtitan's llama3 registry imports Hugging Face
    ``datasets``, seconds)."""
    block = _block(c)
    module, config = block.get("module", "llama3"), block.get("config", "llama3_debugmodel")
    if not isinstance(module, str) or not isinstance(config, str):
        return
    registry = module if "." in module else f"torchtitan.models.{module}.config_registry"
    file = _source(registry)
    if file is not None and "." not in module and module != "llama3":  # said on the ranks after their start-up
        c.bad(
            [TT, "module"],
            f"{module!r}: torchtitan's {module} model package; commgate models torchtitan's llama3 model only "
            "(its parallelize_llama and model): module llama3",
        )
        return
    if file is None:
        models = _source("torchtitan.models")
        if "." not in module and models is not None:  # torchtitan is there, without such a model package
            names = sorted(d.parent.name for d in models.parent.glob("*/config_registry.py"))
            c.bad([TT, "module"], f"{module!r}: torchtitan has no such model package; {_hint(module, names, 'models')}")
        return
    read = _registry_names(file)
    if read is None or config in read[0]:
        return
    c.bad([TT, "config"], f"{config!r}: {registry} ({file}) has no such function; {_hint(config, read[1], 'configs')}")


def _hint(word: str, names: Sequence[str], what: str) -> str:
    """ "did you mean X? its WHAT: A, B" (X the closest of ``names``, if any is close)."""
    close = difflib.get_close_matches(word, names, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"its {what}: {', '.join(names) or '(none)'}"


@functools.cache
def _registry_names(file: Path) -> tuple[frozenset[str], tuple[str, ...]] | None:
    """(every name the registry module binds, its functions returning a ``Config``), read off its source once
    per process; None where the source cannot tell (unreadable, a star import, a module ``__getattr__``)."""
    try:
        tree = ast.parse(file.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    bound = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    bound |= {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)
              for a in n.names}  # fmt: skip
    bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    if "*" in bound or "__getattr__" in bound:
        return None
    configs = tuple(
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.returns is not None and ast.unparse(n.returns).endswith("Config")
    )
    return frozenset(bound), configs


def _source(dotted: str) -> Path | None:
    """The source file of module ``dotted``, found without importing it or its packages (None where it is not a
    plain ``.py`` file on the path)."""
    top, *rest = dotted.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for base in spec.submodule_search_locations or ():
        where = Path(base, *rest)
        for file in (where.with_suffix(".py"), where / "__init__.py"):
            if file.is_file():
                return file
    return None


RULES: tuple[Rule, ...] = (torchtitans_model, torchtitans_axes, torchtitans_modes, torchtitans_args, torchtitans_config)


LEFT_OFF_WHY: dict[str, tuple[str, str]] = {
    "compile": (
        "compiles its blocks (compile.enable)",
        "torch 2.13's inductor fails on flex attention on CPU: a CPU run is eager, and the model assumes "
        "compiling changes no collective",
    ),
    "async_tp": (
        "runs async TP (compile.enable_async_tensor_parallel)",
        "it needs compile and CUDA symmetric memory, and splits the TP all-gathers and reduce-scatters into "
        "chunks the model does not hold: the prediction is plain TP's",
    ),
    "float8": (
        "converts its linear layers to float8",
        "the converter needs torchao and an SM89+ GPU: a CPU run keeps them in bf16; under FSDP2 float8 layers "
        "gather in the parameter dtype as modelled, float8 all-gathers and TP amax all-reduces are not modelled",
    ),
}
"""What each ``torchtitan.left_off`` entry names: (what the config does, why a run and the model leave it out)."""


def torchtitans_warnings(doc: Mapping[str, Any]) -> tuple[str, ...]:
    """One line for each thing ``torchtitan.left_off`` names (the run and the model leave it out), and one
    where the job loses a gradient (``NORM_GRAD_LOST``)."""
    block, par = doc.get(TT, {}), doc.get(P, {})
    block, par = (x if isinstance(x, Mapping) else {} for x in (block, par))
    out = [  # whether the config does is known once it is read on the ranks: said as a condition here (it said the
        # job did where the config did not: found by an adversarial pass)
        f"torchtitan.left_off {what}: where the job {LEFT_OFF_WHY[what][0]}, the run leaves it out; "
        f"{LEFT_OFF_WHY[what][1]}"
        for what in block.get("left_off", ())
    ]
    pipeline = par.get("pipeline", {})
    schedule = pipeline.get("schedule") if isinstance(pipeline, Mapping) else None
    if schedule == "zero-bubble" and par.get("dp", 1) != 1 and block.get("loss", "chunked") == "chunked":
        out.append(NORM_GRAD_LOST)
    return tuple(out)


NORM_GRAD_LOST = (
    "torchtitan's final norm gets no gradient in this job: under zero-bubble with FSDP2 (dp > 1) and the chunked "
    "loss, torch 2.13's weight pass leaves norm.weight.grad None (measured: never reduce-scattered, absent from "
    "the gradient norm; with plain cross-entropy it is not lost): the model predicts what the job sends, and the "
    "norm is not trained; a bug upstream, not in your job's configuration"
)
"""Found by commgate's reconciliation (the last stage's reduce-scatters and per-tensor norm count)."""


TORCHTITAN = Trainer(
    name="torchtitan",
    summary="torchtitan 0.3.0's own Trainer: its llama3 model, parallelize_llama (FSDP2, TP with sequence "
    "parallelism) and train_step",
    schemes=("fsdp", "tp", "pp", "cp", "3d"),
    extra="torchtitan",
    packages=("torchtitan", "tyro", "tokenizers"),
    options=OPTIONS,
    components=components,
    rules=RULES,
    warnings=torchtitans_warnings,
    splits_stages=True,
)
