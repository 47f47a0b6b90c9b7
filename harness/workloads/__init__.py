"""Training workloads run under capture, one module per framework (torch is imported by those modules only).

A workload is built once per rank as ``Workload(scenario, rank=..., device=...)`` — engine
construction is the *init* phase — and ``step(k)`` runs training step k (all micro-batches and the
optimizer). ``harness.interpose.optimizer_phase()`` marks the optimizer's calls.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from harness.errors import CommgateError


class Workload(Protocol):
    def step(self, k: int) -> float: ...


REGISTRY: dict[str, str] = {
    "ddp": "harness.workloads.ddp:DDPWorkload",
    "zero1": "harness.workloads.zero:ZeroWorkload",
    "zero2": "harness.workloads.zero:ZeroWorkload",
    "zero3": "harness.workloads.zero:ZeroWorkload",
    "tp": "harness.workloads.tp:TPWorkload",
    "pp": "harness.workloads.pp:PipelineWorkload",
    "3d": "harness.workloads.pp:PipelineWorkload",
    "moe": "harness.workloads.moe:MoEWorkload",
}


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
