"""The per-collective model of each parallelism scheme: one registry entry per scheme.

A scheme is a tuple of components; each component (one module each) contributes the collectives it
issues, the paper equation that idealises them, and the named residuals between the two.
"""

from __future__ import annotations

from typing import Protocol

from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Residual
from commgate.model.schemes.ddp import DistributedDataParallel
from commgate.model.schemes.deepspeed_zero import DeepSpeedZero3, DeepSpeedZero12
from commgate.model.schemes.moe import ExpertParallel, MoEDataParallel
from commgate.model.schemes.pipeline import PipelineDataParallel, PipelineParallel
from commgate.model.schemes.tensor import TensorParallel


class Component(Protocol):
    def collectives(self, ctx: Context) -> list[ExpectedCollective]: ...

    def paper_terms(self, ctx: Context) -> list[PaperTerm]: ...

    def residuals(self, ctx: Context) -> list[Residual]: ...


SCHEMES: dict[str, tuple[Component, ...]] = {
    "ddp": (DistributedDataParallel(),),
    "zero1": (DeepSpeedZero12(),),
    "zero2": (DeepSpeedZero12(),),
    "zero3": (DeepSpeedZero3(),),
    "zero++": (DeepSpeedZero3(),),
    "tp": (TensorParallel(), DistributedDataParallel()),
    "pp": (PipelineParallel(), PipelineDataParallel()),
    "3d": (TensorParallel(), PipelineParallel(), PipelineDataParallel()),
    "moe": (ExpertParallel(), MoEDataParallel()),
}
