"""The parallelism schemes commgate knows: one ``Scheme`` record each, the one place where a scheme is
defined. Everything else is derived from ``SCHEMES``: the scenario schema's ``scheme`` enum, the
scenario consistency rules, the CLI's ``--scheme`` choices, the workload that runs it and the components
whose collectives make up its per-collective model.

A scheme is a tuple of components; each component (one module each) contributes the collectives it
issues, the paper equation that idealises them, and the named residuals between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Residual
from commgate.model.schemes.context import ContextParallel
from commgate.model.schemes.ddp import DistributedDataParallel
from commgate.model.schemes.deepspeed_zero import DeepSpeedZero3, DeepSpeedZero12
from commgate.model.schemes.fsdp import FullyShard
from commgate.model.schemes.moe import ExpertParallel, MoEDataParallel
from commgate.model.schemes.pipeline import PipelineDataParallel, PipelineParallel
from commgate.model.schemes.tensor import TensorParallel


class Component(Protocol):
    def collectives(self, ctx: Context) -> list[ExpectedCollective]: ...

    def paper_terms(self, ctx: Context) -> list[PaperTerm]: ...

    def residuals(self, ctx: Context) -> list[Residual]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Scheme:
    name: str
    summary: str
    """One line for ``--help`` and the docs."""
    components: tuple[Component, ...]
    workload: str
    """``module:attribute`` of the training workload that runs it (imported only when it runs)."""
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
    """Needs pp >= 2 (else pp must be 1)."""
    min_dp: int = 2
    """The smallest data-parallel degree: 2 where data parallelism is the scheme, 1 where it is optional."""
    zero_plus_plus: bool = False
    """Needs (and alone allows) ZeRO++ options: hpz, qwz, qgz."""
    moe: bool = False
    """Needs (and alone allows) a ``moe`` block."""
    fsdp: bool = False
    """Alone allows an ``fsdp`` block (torch FSDP2 options)."""
    context: bool = False
    """Needs cp >= 2: context parallelism by torch's ring attention."""
    optional_pipeline: bool = False
    """Allows pp >= 2 without needing it (FSDP2 inside torch.distributed.pipelining's stages)."""
    optional_context: bool = False
    """Allows cp >= 2 without needing it (FSDP2 sharding over dp x cp, as torchtitan composes them)."""


_DDP, _Z12, _Z3, _TP = DistributedDataParallel(), DeepSpeedZero12(), DeepSpeedZero3(), TensorParallel()
_PP, _PDP, _CP = PipelineParallel(), PipelineDataParallel(), ContextParallel()
_WL = "commgate.run.workloads"
_ZERO_WL = f"{_WL}.zero:ZeroWorkload"

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            name="ddp",
            summary="torch DistributedDataParallel",
            components=(_DDP,),
            workload=f"{_WL}.ddp:DDPWorkload",
            deepspeed=False,
            zero=False,
        ),
        Scheme(name="zero1", summary="DeepSpeed ZeRO stage 1", components=(_Z12,), workload=_ZERO_WL, zero_stage=1),
        Scheme(name="zero2", summary="DeepSpeed ZeRO stage 2", components=(_Z12,), workload=_ZERO_WL, zero_stage=2),
        Scheme(name="zero3", summary="DeepSpeed ZeRO stage 3", components=(_Z3,), workload=_ZERO_WL, zero_stage=3),
        Scheme(
            name="zero++",
            summary="DeepSpeed ZeRO++: stage 3 with hpZ, qwZ, qgZ",
            components=(_Z3,),
            workload=_ZERO_WL,
            zero_stage=3,
            zero_plus_plus=True,
        ),
        Scheme(
            name="fsdp",
            summary="torch FSDP2 (fully_shard), one parameter group per transformer block; with tp, 2-D over DTensor; "
            "with cp, ring attention and sharding over dp x cp; with pp, in torch.distributed.pipelining's stages",
            components=(_TP, _CP, _PP, FullyShard()),
            workload=f"{_WL}.fsdp:fsdp_workload",
            deepspeed=False,
            zero=False,
            fsdp=True,
            optional_tensor=True,
            optional_pipeline=True,
            optional_context=True,
        ),
        Scheme(
            name="tp",
            summary="tensor parallelism on torch DTensor (DDP over dp)",
            components=(_TP, _DDP),
            workload=f"{_WL}.tp:TPWorkload",
            deepspeed=False,
            min_dp=1,
            tensor=True,
        ),
        Scheme(
            name="cp",
            summary="context parallelism: torch's ring attention over cp ranks, DTensor TP inside, DDP over dp x cp",
            components=(_TP, _CP, _DDP),
            workload=f"{_WL}.cp:CPWorkload",
            deepspeed=False,
            zero=False,
            min_dp=1,
            optional_tensor=True,
            context=True,
        ),
        Scheme(
            name="pp",
            summary="pipeline parallelism: DeepSpeed's engine, or torch.distributed.pipelining's schedules",
            components=(_PP, _PDP),
            workload=f"{_WL}.pp:pipeline_workload",
            pipeline=True,
            min_dp=1,
        ),
        Scheme(
            name="3d",
            summary="pipeline x data x tensor: DeepSpeed's pipeline engine with DTensor inside each stage",
            components=(_TP, _PP, _PDP),
            workload=f"{_WL}.pp:PipelineWorkload",
            tensor=True,
            min_dp=1,
            pipeline=True,
        ),
        Scheme(
            name="moe",
            summary="DeepSpeed MoE with expert parallelism",
            components=(ExpertParallel(), MoEDataParallel()),
            workload=f"{_WL}.moe:MoEWorkload",
            moe=True,
        ),
    )
}
