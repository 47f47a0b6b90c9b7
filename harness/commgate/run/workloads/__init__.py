"""Training workloads run under capture, one module per framework (torch is imported by those modules only).

A workload is built once per rank as ``Workload(scenario, rank=..., device=...)`` — engine
construction is the *init* phase — and ``step(k)`` runs training step k (all micro-batches and the
optimizer). ``commgate.run.interpose.optimizer_phase()`` marks the optimizer's calls.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario


class Workload(Protocol):
    def step(self, k: int) -> float: ...


REGISTRY: dict[str, str] = {
    "ddp": "commgate.run.workloads.ddp:DDPWorkload",
    "zero1": "commgate.run.workloads.zero:ZeroWorkload",
    "zero2": "commgate.run.workloads.zero:ZeroWorkload",
    "zero3": "commgate.run.workloads.zero:ZeroWorkload",
    "zero++": "commgate.run.workloads.zero:ZeroWorkload",
    "tp": "commgate.run.workloads.tp:TPWorkload",
    "pp": "commgate.run.workloads.pp:PipelineWorkload",
    "3d": "commgate.run.workloads.pp:PipelineWorkload",
    "moe": "commgate.run.workloads.moe:MoEWorkload",
}


def skip_reason(scenario: Scenario, *, gpus: bool) -> str | None:
    """Why ``scenario`` cannot run here (``gpus``: whether this machine has any), or None."""
    par = scenario.parallelism
    if not gpus and ("gpu" in scenario.markers or scenario.backend == "nccl"):
        return "needs GPUs (marker gpu or backend nccl); this machine has none"
    if scenario.workload is not None:
        return None
    if par.scheme not in REGISTRY:
        return f"no runnable workload for scheme {par.scheme!r} yet"
    if par.scheme == "zero++" and (par.zero.qwz or par.zero.qgz) and (not gpus or scenario.backend == "gloo"):
        return "ZeRO++ qwZ/qgZ run on GPUs only: DeepSpeed's quantizer has no CPU kernel (hpZ alone runs on CPU)"
    return None


def resolve(scheme: str, workload: str | None = None) -> Any:
    """The workload class (or a user's ``module:function``) for a scheme."""
    target = workload or REGISTRY.get(scheme)
    if target is None:
        raise CommgateError(
            f"scheme {scheme!r} has no runnable workload yet (runnable: {', '.join(sorted(REGISTRY))}); "
            "`commgate predict` covers it"
        )
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
