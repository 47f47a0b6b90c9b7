"""What a parallelism scheme is: the record every other part of commgate derives its facts from, the
components whose collectives make up its per-collective model, and the shape of a consistency rule.

A scheme is a tuple of components (one module each under ``commgate.model.schemes``); each contributes
the collectives it issues, the paper equation that idealises them and the named residuals between the
two, and the consistency rules of the feature it models (``RULES`` of its module). The registry itself,
``SCHEMES``, is ``commgate.model.schemes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Residual
from commgate.model.scenario import ModelSpec, Parallelism

OptionalAxis = Literal["tp", "pp", "cp"]
"""The axes a scheme needs, allows or refuses (data parallelism is every scheme's; ``min_dp`` bounds it)."""


class Component(Protocol):
    """One part of a scheme's per-collective model (one module each): what it issues, the paper's equation
    for it, the named residuals between the two, and the consistency rules of the feature it models."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]: ...

    def paper_terms(self, ctx: Context) -> list[PaperTerm]: ...

    def residuals(self, ctx: Context) -> list[Residual]: ...

    @property
    def rules(self) -> tuple[Rule, ...]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Scheme:
    name: str
    summary: str
    """One line for ``--help`` and the docs."""
    components: tuple[Component, ...]
    deepspeed: bool = True
    """Trained by a DeepSpeed engine (else by torch alone)."""
    zero_stage: int | None = None
    """The ZeRO stage the scheme implies; None: the scenario's ``zero.stage`` (0 unless given)."""
    zero: bool = True
    """Whether ZeRO stages are allowed at all (torch DDP has none)."""
    tensor: bool = False
    """Needs tp >= 2 (else tp must be 1, unless ``optional_tensor``)."""
    optional_tensor: bool = False
    """Allows tp >= 2 without needing it (FSDP2 over data parallelism, DTensor tensor parallelism inside)."""
    pipeline: bool = False
    """Needs pp >= 2 (else pp must be 1, unless it has ``pipeline_engines`` all the same)."""
    pipeline_engines: tuple[str, ...] = ()
    """The pipeline engines it runs stages on (``parallelism.pipeline.engine``): ``deepspeed`` (its
    PipelineEngine), ``torch`` (torch.distributed.pipelining); with ``pipeline`` False, pp >= 2 is allowed
    on these engines without being needed (FSDP2 inside torch's stages)."""
    min_dp: int = 2
    """The smallest data-parallel degree: 2 where data parallelism is the scheme, 1 where it is optional."""
    zero_plus_plus: bool = False
    """Needs (and alone allows) ZeRO++ options: hpz, qwz, qgz."""
    moe: bool = False
    """Needs (and alone allows) a ``moe`` block."""
    fsdp: bool = False
    """Trained by torch FSDP2 (``fully_shard``): alone allows an ``fsdp`` block and HSDP replicas."""
    context: bool = False
    """Needs cp >= 2: context parallelism by torch's ring attention."""
    optional_context: bool = False
    """Allows cp >= 2 without needing it (FSDP2 sharding over dp x cp, as torchtitan composes them)."""
    autocast: bool = False
    """Runs the model under ``torch.autocast`` when ``model.autocast`` asks (torch DDP only)."""
    user_module: bool = False
    """A user's own ``nn.Module`` (``model.module``) can stand in for the decoder: the engine sees only its
    parameters (``commgate.model.usermodule``)."""

    @property
    def optional_pipeline(self) -> bool:
        """Allows pp >= 2 without needing it."""
        return bool(self.pipeline_engines) and not self.pipeline

    def needs(self, axis: OptionalAxis) -> bool:
        """Whether the scheme runs only with a degree >= 2 on ``axis``."""
        return {"tp": self.tensor, "pp": self.pipeline, "cp": self.context}[axis]

    def allows(self, axis: OptionalAxis) -> bool:
        """Whether the scheme runs with a degree >= 2 on ``axis`` (needing it or not)."""
        optional = {"tp": self.optional_tensor, "pp": self.optional_pipeline, "cp": self.optional_context}
        return self.needs(axis) or optional[axis]

    def workload_kind(self, par: Parallelism) -> str:
        """The workload kind whose host time per layer pass and lag the time model calibrates
        (``commgate.report.timemodel``): the scheme, with ``+sp`` for DTensor's sequence parallelism, ``+cp``
        for a context-parallel ring inside a scheme that does not need one (each adds its own dispatch per
        layer) and ``+torchpp`` for torch.distributed.pipelining's stages (which post their receives ahead
        of need, where DeepSpeed's engine posts them when due)."""
        kind = self.name
        if par.sequence_parallel:
            kind += "+sp"
        if par.cp > 1 and not self.context:
            kind += "+cp"
        if par.pp > 1 and par.pipeline.engine == "torch":
            kind += "+torchpp"
        return kind


Bad = Callable[[list[str | int], str], None]
"""Reports one problem: the JSON path (as parts) and the message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """What a consistency rule sees of one scenario (a sweep variant): the document as written, the records
    built from it, the merged DeepSpeed block, its scheme's record and the registry (for hints that name
    the schemes that would do), and ``bad`` to report a problem."""

    doc: Mapping[str, Any]
    model: ModelSpec
    par: Parallelism
    ds: Mapping[str, Any]
    """The ``deepspeed:`` block (a file's contents merged in), as DeepSpeed would read it."""
    scheme: Scheme
    schemes: Mapping[str, Scheme]
    bad: Bad
    splits_stages: bool = False
    """The scenario's trainer splits the pipeline's stages itself (``Trainer.splits_stages``)."""
    trainer: str = "commgate"
    """The scenario's trainer (``trainer:``): a rule about commgate's own workloads skips the others."""

    @property
    def declared(self) -> Mapping[str, Any]:
        """The ``parallelism`` block as written (which options the user gave)."""
        block = self.doc.get("parallelism", {})
        return block if isinstance(block, Mapping) else {}

    @property
    def checked(self) -> bool:
        """Whether the model is asserted (``expectations.model.check``, on unless turned off)."""
        return bool(self.doc.get("expectations", {}).get("model", {}).get("check", True))

    def names(self, which: Callable[[Scheme], bool]) -> str:
        """The schemes ``which`` holds for, quoted, for a hint: ``'pp' or '3d'``."""
        quoted = [repr(n) for n, s in self.schemes.items() if which(s)]
        return " or ".join(quoted) if len(quoted) < 3 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


Rule = Callable[[Check], None]
"""One consistency rule: reports through ``check.bad`` what the scenario gets wrong (nothing when right)."""
