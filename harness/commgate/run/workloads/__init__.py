"""Training workloads run under capture, one module per framework (torch is imported by those modules only).

A workload is built once per rank as ``Workload(scenario, rank=..., device=...)`` — engine
construction is the *init* phase — and ``step(k)`` runs training step k (all micro-batches and the
optimizer). ``commgate.run.interpose.optimizer_phase()`` marks the optimizer's calls.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from commgate.model.scenario import Scenario, emulation_refusal
from commgate.model.schemes import SCHEMES

if TYPE_CHECKING:
    import torch


class Workload(Protocol):
    def step(self, k: int) -> float: ...


class WorkloadFactory(Protocol):
    """A workload class, or a user's ``module:function`` (``workload:`` in the scenario)."""

    def __call__(self, scenario: Scenario, *, rank: int, device: torch.device) -> Workload: ...


def skip_reason(scenario: Scenario, *, gpus: bool) -> str | None:
    """Why ``scenario`` cannot run here (``gpus``: whether this machine has any), or None."""
    par = scenario.parallelism
    if scenario.emulate and (why := emulation_refusal(scenario.backend, scenario.workload)):
        return f"not emulated: {why}"
    if not gpus and ("gpu" in scenario.markers or scenario.backend == "nccl"):
        return "needs GPUs (marker gpu or backend nccl); this machine has none"
    if scenario.workload is not None:
        return None
    if scenario.model.tied_embeddings and (par.pp > 1 or par.tp > 1):
        return "the tensor- and pipeline-parallel workloads do not tie embeddings yet (`commgate predict` models it)"
    if SCHEMES[par.scheme].deepspeed and scenario.model.dtype == "fp16" and (not gpus or scenario.backend == "gloo"):
        return "DeepSpeed's fp16 runs on GPUs only (its CPU accelerator supports bf16 and fp32)"
    if par.pipeline.engine == "torch" and (missing := _missing_schedule(par.pipeline.schedule)):
        return missing
    if par.scheme == "zero++" and (par.zero.qwz or par.zero.qgz) and (not gpus or scenario.backend == "gloo"):
        return "ZeRO++ qwZ/qgZ run on GPUs only: DeepSpeed's quantizer has no CPU kernel (hpZ alone runs on CPU)"
    return None


def _missing_schedule(schedule: str) -> str | None:
    """Why the installed torch cannot run ``schedule`` (torch.distributed.pipelining lacks its class)."""
    from commgate.model.scenario import TORCH_SCHEDULES

    try:
        from torch.distributed import pipelining
    except ImportError as exc:
        return f"this torch has no torch.distributed.pipelining ({exc})"
    name = TORCH_SCHEDULES[schedule]
    if not hasattr(pipelining, name):
        return f"pipeline.schedule {schedule}: this torch's torch.distributed.pipelining has no {name}"
    return None


def resolve(scheme: str, workload: str | None = None) -> WorkloadFactory:
    """The workload class (or a user's ``module:function``) for a scheme."""
    module, _, attr = (workload or SCHEMES[scheme].workload).partition(":")
    factory: WorkloadFactory = getattr(importlib.import_module(module), attr)
    return factory
