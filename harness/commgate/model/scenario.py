"""A scenario as records: the frozen, typed description of one run (model, parallelism, expectations)
that everything downstream reads. These records import nothing of commgate: the scenario file's loading
(YAML, schema, sweeps, ``deepspeed:`` merging) is ``commgate.model.loader``, the consistency rules live
with the schemes (``commgate.model.schemes``) and trainers (``commgate.model.trainers``) they belong to.

Naming: ``L`` layers, ``h`` hidden, ``a`` heads, ``V`` vocabulary, ``s`` sequence, ``x`` MLP expansion,
as in the seed paper's Table I; ``dp``, ``tp``, ``pp``, ``cp`` the data-, tensor-, pipeline- and
context-parallel degrees.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any, Literal

Backend = Literal["gloo", "nccl", "auto"]
MARKERS: tuple[str, ...] = ("gpu", "multinode", "slow", "nightly")

Position = Literal["learned", "rotary", "none"]
Architecture = Literal["gpt-neox", "llama"]
ARCHITECTURES: tuple[Architecture, ...] = ("gpt-neox", "llama")
DType = Literal["fp32", "fp16", "bf16"]

ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}

ModelBuilder = Callable[["Scenario"], tuple[Any, Callable[[int], tuple[Any, ...]]]]
"""``build(scenario)``: a model (a ``torch.nn.Module``, on torch's current default device) and a function from a
seed to one micro-batch's inputs, ``model(*inputs)`` returning the loss (``commgate.model.usermodule``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Dimensions of a decoder (GPT-NeoX-shaped by default, or Llama-style)."""

    L: int
    """Transformer layers."""
    h: int
    """Hidden size."""
    a: int
    """Attention heads."""
    V: int
    """Vocabulary size (padded)."""
    s: int
    """Sequence length."""
    x: int = 4
    """MLP expansion factor (the MLP's width is ``x * h`` unless ``ffn_hidden`` is given)."""
    architecture: Architecture = "gpt-neox"
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention; Llama only); None: as many as ``a``."""
    ffn_hidden: int | None = None
    """The MLP's inner width; None: ``x * h``."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Llama only): Qwen2's layout."""
    module: str | None = None
    """A user's own model, ``package.module:build`` (``commgate.model.usermodule``): its parameters,
    gradient order and module trace replace the built-in decoder's (the dimensions above are then unused).
    With ``builder``, the name of the model it builds (``transformers:LlamaForCausalLM``), for people."""
    builder: ModelBuilder | None = None
    """What builds the model instead of importing ``module``: the scenario's trainer's (``Trainer.model``,
    set by the loader, never written in a scenario)."""
    tied_embeddings: bool = False
    position: Position = "learned"
    dtype: DType = "fp32"
    autocast: DType | None = None
    """Compute dtype under ``torch.autocast`` (DDP): the parameters, and so the gradients reduced, stay
    ``dtype``."""
    preset: str | None = None
    """Name of the preset these dimensions came from, if any (informational)."""

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.ffn_hidden if self.ffn_hidden is not None else self.x * self.h

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads if self.kv_heads is not None else self.a

    @property
    def llama(self) -> bool:
        return self.architecture == "llama"


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroConfig:
    stage: int = 0
    hpz: int = 1
    """ZeRO++ hierarchical partition size (secondary copy of the parameters within hpz ranks)."""
    qwz: bool = False
    """ZeRO++ quantized (int8) weight all-gather."""
    qgz: bool = False
    """ZeRO++ quantized (int4) gradient all-to-all."""
    bucket_elements: int = 500_000_000
    """DeepSpeed reduce_bucket_size / allgather_bucket_size (elements)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPConfig:
    """torch FSDP2 (``fully_shard``) options: one parameter group per transformer block, the root's
    parameters (embeddings, final norm, head) in one more."""

    reshard_after_forward: bool | int | None = None
    """For every group; None leaves torch's choice: the blocks reshard after the forward, the root not; an
    int k (dividing dp) reshards to groups of k ranks, so the backward gathers within them."""
    reshard_after_backward: bool = True
    """Between gradient-accumulation micro-batches (False: ``set_reshard_after_backward(False)`` keeps
    the parameters gathered until the last micro-batch)."""
    param_dtype: Literal["fp32", "bf16"] | None = None
    """``MixedPrecisionPolicy.param_dtype``: what is all-gathered; None: the model's dtype."""
    reduce_dtype: Literal["fp32", "bf16"] | None = None
    """``MixedPrecisionPolicy.reduce_dtype``: what is reduce-scattered; None: ``param_dtype``."""

    @property
    def reshard_group(self) -> int | None:
        """The int ``reshard_after_forward`` (the post-forward group size), None when it is a bool or unset."""
        k = self.reshard_after_forward
        return None if k is None or isinstance(k, bool) else k

    @property
    def reshards(self) -> bool | None:
        """Whether groups reshard after the forward, as torch reads the setting (an int k > 1 does, to groups
        of k; 1 does not); None when unset (torch's choice: the blocks do, the root does not)."""
        k = self.reshard_after_forward
        return k if k is None or isinstance(k, bool) else k > 1

    def compute_dtype(self, model_dtype: str) -> str:
        """The dtype the layers compute in (and the gathers move): ``param_dtype``, else the parameters'."""
        return self.param_dtype or model_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineConfig:
    """The pipeline engine: DeepSpeed's (its own 1F1B) or ``torch.distributed.pipelining`` with a schedule."""

    engine: Literal["deepspeed", "torch", "megatron"] = "deepspeed"
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    virtual_stages: int = 1
    """Stages per rank (interleaved schedules: stage k on rank k mod pp)."""

    @property
    def looped(self) -> bool:
        """The schedule runs several stages per rank (torch's ``_PipelineScheduleRuntime``)."""
        return self.schedule in ("interleaved-1f1b", "zero-bubble")


TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}
"""The ``torch.distributed.pipelining`` schedule class of each ``pipeline.schedule``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    experts: int
    ep: int = 1
    top_k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4
    every: int = 1
    """Every ``every``-th layer is an MoE layer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    scheme: str
    """A name in ``commgate.model.schemes.SCHEMES`` (the one place where a scheme's facts live)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism inside the tensor-parallel groups (DTensor ``SequenceParallel``)."""
    dp_replicate: int = 1
    """HSDP replicas (scheme fsdp): the model is sharded over ``dp`` ranks and replicated this many times."""
    cp: int = 1
    """Context-parallel degree (scheme cp, or fsdp): each sequence split over cp ranks, attention by torch's ring."""
    cp_rotate: Literal["allgather", "alltoall"] = "allgather"
    """How torch's ring attention passes K/V (``set_rotate_method``): one all-gather per attention, or
    cp-1 all-to-all rotations."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    moe: MoEConfig | None = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    micro_batch: int = 1
    """Micro-batch size b."""
    micro_batches: int = 1
    """Micro-batches per step m: pipeline micro-batches, or gradient-accumulation steps."""
    activation_checkpointing: bool = False
    ddp_bucket_mb: float | None = None
    """torch DDP ``bucket_cap_mb``; None keeps DDP's default (25 MiB, with a 1 MiB first bucket)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks of one gradient reduction (DDP) or parameter sharding (FSDP2): dp, times cp, since each
        context-parallel rank computes gradients from its own part of the sequences."""
        return self.dp * self.cp

    @property
    def axes(self) -> str:
        """How the world size is made, for messages: ``dp*tp*pp = 2*2*1``."""
        rep = (f"{self.dp_replicate}*", "dp_replicate*") if self.dp_replicate > 1 else ("", "")
        cp = (f"{self.cp}*", "cp*") if self.cp > 1 else ("", "")
        return f"{rep[1]}dp*{cp[1]}tp*pp = {rep[0]}{self.dp}*{cp[0]}{self.tp}*{self.pp}"

    @property
    def ep(self) -> int:
        return self.moe.ep if self.moe else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    rtol: float = 0.0
    atol: int = 0

    def allows(self, obtained: float | Fraction, expected: float | Fraction) -> bool:
        if not self.rtol and not self.atol:
            return obtained == expected  # exact (Fractions stay exact)
        return abs(float(obtained) - float(expected)) <= self.atol + self.rtol * abs(float(expected))


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyRule:
    """How latency is judged against stored runs (``commgate.judge.drift.shifts``)."""

    factor: float = 1.75
    """The least ratio of an op's floor per step that counts (raised to the stored runs' own spread)."""
    min_runs: int = 3
    """Stored runs needed before latency is judged."""
    confirm: int = 2
    """Reruns a scenario whose latency looks shifted must show the same shift in too."""
    min_share: float = 0.03
    """Ops under this share of the step time (in the stored runs) are not judged: their time is
    scheduling noise on a shared machine. Below 5%, so that an op holding 5% of the step is judged whatever
    stored runs the machine's spread gave (on 2 cores an op's share moves x0.5-x2 between unchanged runs)."""
    action: Literal["warn", "fail"] = "warn"


@dataclass(frozen=True, slots=True, kw_only=True)
class ColdStartRule:
    factor: float = 10.0
    min_excess_ms: float = 100.0
    action: Literal["warn", "fail"] = "warn"


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectations:
    model_check: bool = True
    """False: baseline-only mode; the model and the paper are not asserted (the result says so)."""
    model_known: bool = True
    """False: no scenario describes the job (``commgate check DIR`` without ``--scenario``): the model is a
    stand-in, so it is neither checked nor shown, nor is the time model's prediction."""
    model_bytes: Tolerance = field(default_factory=Tolerance)
    model_calls: Tolerance = field(default_factory=Tolerance)
    paper_rtol: float = 0.01
    baseline_bytes: Tolerance = field(default_factory=Tolerance)
    baseline_calls: Tolerance = field(default_factory=Tolerance)
    latency: LatencyRule = field(default_factory=LatencyRule)
    cold_start: ColdStartRule = field(default_factory=ColdStartRule)
    time_max_error: float | None = None
    """``expectations.time.max_error``: the largest |predicted - measured| communication fraction that
    passes (``commgate.report.timemodel``); None: the time model is reported, not judged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One runnable scenario (a sweep expands into several of these)."""

    id: str
    """Unique, readable id: the name, plus ``[key=value,...]`` for a sweep variant."""
    name: str
    model: ModelSpec
    parallelism: Parallelism
    description: str = ""
    file: str | None = None
    capture: str | None = None
    """A job already captured (``capture:``, resolved beside the file): judged instead of run."""
    backend: Backend = "auto"
    emulate: bool = False
    """Run rank 0 alone at the declared world size, the other ranks emulated (``commgate.run.emulate``)."""
    steps: int = 3
    warmup_steps: int = 1
    deadline_s: float = 300.0
    stall_s: float | None = None
    """The stall watchdog's limit (``commgate.run.diagnose``); None: derived from the steps seen."""
    markers: tuple[str, ...] = ()
    trainer: str = "commgate"
    """Who builds, parallelizes and steps the job: a name in ``commgate.model.trainers.TRAINERS``."""
    trainer_options: str = "{}"
    """The trainer's options block (the scenario's key named after the trainer) as canonical JSON."""
    workload: str | None = None
    expectations: Expectations = field(default_factory=Expectations)
    deepspeed: str = "{}"
    """The ``deepspeed:`` block as canonical JSON (merged over commgate's own DeepSpeed config)."""
    warnings: tuple[str, ...] = ()
    """What is suspicious but not wrong (e.g. a DeepSpeed key DeepSpeed does not know)."""
    notes: tuple[str, ...] = ()
    """What the configs the scenario was made from set that it does not take as such (``commgate
    import``); shown as the warnings are."""

    @property
    def remarks(self) -> tuple[str, ...]:
        """The warnings, then the notes: what a run's summary, report.json and ``commgate validate`` show."""
        return (*self.warnings, *(f"imported: {note}" for note in self.notes))

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def trainer_config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.trainer_options)
        return loaded

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.deepspeed)
        return loaded


def field_names(cls: type) -> tuple[str, ...]:
    """Field names of a record dataclass (used by tests to keep schema and records in step)."""
    return tuple(f.name for f in fields(cls))
