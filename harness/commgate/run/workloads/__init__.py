"""Training workloads run under capture, one module per framework (torch is imported by those modules only).

A workload is built once per rank as ``Workload(scenario, rank=..., device=...)`` — engine
construction is the *init* phase — and ``step(k)`` runs training step k (all micro-batches and the
optimizer). ``commgate.run.interpose.optimizer_phase()`` marks the optimizer's calls.

Which workload runs a scenario is this layer's registry: ``WORKLOADS`` (commgate's own trainer, by
scheme: one entry per ``commgate.model.schemes.SCHEMES`` record) and ``TRAINER_WORKLOADS`` (by trainer:
one entry per ``commgate.model.trainers.TRAINERS`` record). Each entry imports its module only when a
scenario runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from commgate.model.rules import emulation_refusal
from commgate.model.scenario import TORCH_SCHEDULES, Scenario
from commgate.model.schemes import SCHEMES
from commgate.model.trainers import TRAINERS
from commgate.model.usermodule import resolve as user_callable

if TYPE_CHECKING:
    import torch

    from commgate.run.steps import Steps


class Workload(Protocol):
    def step(self, k: int) -> float: ...


@runtime_checkable
class OwnLoop(Protocol):
    """A trainer that runs its own loop (Hugging Face's ``Trainer.train()``): built once per rank as a
    workload is, then ``run(steps)`` trains ``warmup_steps + steps`` optimizer steps, calling
    ``steps.begin(k)`` where step k begins and ``steps.close()`` after the last."""

    def run(self, steps: Steps) -> None: ...


class WorkloadFactory(Protocol):
    """A workload class, or a user's ``module:function`` (``workload:`` in the scenario)."""

    def __call__(self, scenario: Scenario, *, rank: int, device: torch.device) -> Workload | OwnLoop: ...


def _ddp() -> WorkloadFactory:
    from commgate.run.workloads.ddp import DDPWorkload

    return DDPWorkload


def _zero() -> WorkloadFactory:
    from commgate.run.workloads.zero import ZeroWorkload

    return ZeroWorkload


def _fsdp() -> WorkloadFactory:
    from commgate.run.workloads.fsdp import fsdp_workload

    return fsdp_workload


def _tp() -> WorkloadFactory:
    from commgate.run.workloads.tp import TPWorkload

    return TPWorkload


def _cp() -> WorkloadFactory:
    from commgate.run.workloads.cp import CPWorkload

    return CPWorkload


def _pp() -> WorkloadFactory:
    from commgate.run.workloads.pp import pipeline_workload

    return pipeline_workload


def _3d() -> WorkloadFactory:
    from commgate.run.workloads.pp import PipelineWorkload

    return PipelineWorkload


def _moe() -> WorkloadFactory:
    from commgate.run.workloads.moe import MoEWorkload

    return MoEWorkload


WORKLOADS: dict[str, Callable[[], WorkloadFactory]] = {
    "ddp": _ddp,
    "zero1": _zero,
    "zero2": _zero,
    "zero3": _zero,
    "zero++": _zero,
    "fsdp": _fsdp,
    "tp": _tp,
    "cp": _cp,
    "pp": _pp,
    "3d": _3d,
    "moe": _moe,
}
"""commgate's own workload of each scheme (``tests/test_architecture.py`` checks every scheme has one)."""


def _commgate(scenario: Scenario) -> WorkloadFactory:
    return WORKLOADS[scenario.parallelism.scheme]()


def _torchtitan(scenario: Scenario) -> WorkloadFactory:
    from commgate.run.trainers.torchtitan import TorchtitanWorkload

    return TorchtitanWorkload


def _hf(scenario: Scenario) -> WorkloadFactory:
    from commgate.run.trainers.hf import HFTrainerJob

    return HFTrainerJob


def _megatron(scenario: Scenario) -> WorkloadFactory:
    from commgate.run.trainers.megatron import MegatronWorkload

    return MegatronWorkload


TRAINER_WORKLOADS: dict[str, Callable[[Scenario], WorkloadFactory]] = {
    "commgate": _commgate,
    "torchtitan": _torchtitan,
    "hf": _hf,
    "megatron": _megatron,
}
"""What runs a scenario of each trainer (every ``TRAINERS`` record has one)."""


def _preload_torchtitan() -> None:
    from commgate.run.trainers.torchtitan import preload

    preload()


def _preload_hf() -> None:
    import commgate.run.trainers.hf  # noqa: F401  (transformers' Trainer, imported by the adapter)


def _preload_megatron() -> None:
    from commgate.run.trainers.megatron import preload

    preload()


PRELOADS: dict[str, Callable[[], None]] = {
    "torchtitan": _preload_torchtitan,
    "hf": _preload_hf,
    "megatron": _preload_megatron,
}
"""What a CPU rank of each trainer's job imports for a second or more, imported once in the ranks' forkserver
(``commgate.run.preload``) when the scenarios to run name the trainer; commgate's own workloads are preloaded
always (``commgate.run.launcher.PRELOAD``)."""


def resolve(scenario: Scenario) -> WorkloadFactory:
    """What builds and steps ``scenario`` on a rank: the user's ``workload:`` function, or its trainer's
    workload for its scheme."""
    TRAINERS[scenario.trainer].require()
    if scenario.workload is not None:
        factory: WorkloadFactory = user_callable(scenario.workload, "workload")
        return factory
    return TRAINER_WORKLOADS[scenario.trainer](scenario)


def skip_reason(scenario: Scenario, *, gpus: bool) -> str | None:
    """Why ``scenario`` cannot run here (``gpus``: whether this machine has any), or None."""
    par = scenario.parallelism
    if scenario.emulate and (why := emulation_refusal(scenario.backend, scenario.workload, scenario.trainer)):
        return f"not emulated: {why}"
    if not gpus and ("gpu" in scenario.markers or scenario.backend == "nccl"):
        return "needs GPUs (marker gpu or backend nccl); this machine has none"
    if scenario.workload is not None:
        return None
    section = scenario.deepspeed_config.get("optimizer")
    kind = str(section.get("type", "")) if isinstance(section, dict) else ""
    zo = scenario.deepspeed_config.get("zero_optimization")
    offload = zo.get("offload_optimizer") if isinstance(zo, dict) else None
    on_cpu = isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")  # zero_use_cpu_optimizer
    gpu_only = kind.lower() in GPU_ONLY_OPTIMIZERS and not (kind.lower() == "lion" and on_cpu)
    if gpu_only and (not gpus or scenario.backend == "gloo"):
        return f"deepspeed optimizer {kind!r}: {GPU_ONLY_OPTIMIZERS[kind.lower()]} (`commgate predict` models it)"
    if scenario.model.tied_embeddings and par.pp > 1 and par.pipeline.engine == "torch":
        why = "torch.distributed.pipelining ties no weights across stages; DeepSpeed's engine does (engine: deepspeed)"
        return f"{why} (`commgate predict` models it)"
    cpu = not gpus or scenario.backend == "gloo"
    if SCHEMES[par.scheme].deepspeed and scenario.model.dtype == "fp16" and cpu:
        return "DeepSpeed's fp16 runs on GPUs only (its CPU accelerator supports bf16 and fp32)"
    if par.pipeline.engine == "torch" and (missing := _missing_schedule(par.pipeline.schedule)):
        return missing
    if (par.zero.qwz or par.zero.qgz) and cpu:  # (ZeRO++ options: scheme zero++ alone allows them)
        return "ZeRO++ qwZ/qgZ run on GPUs only: DeepSpeed's quantizer has no CPU kernel (hpZ alone runs on CPU)"
    return None


GPU_ONLY_OPTIMIZERS = {
    "lamb": 'DeepSpeed\'s FusedLamb has no CPU kernel ("This op had not been implemented on CPU backend")',
    "onebitadam": "DeepSpeed's 1-bit Adam compresses with CUDA kernels",
    "onebitlamb": "DeepSpeed's 1-bit LAMB compresses with CUDA kernels",
    "zerooneadam": "DeepSpeed's 0/1 Adam compresses with CUDA kernels",
    "lion": "DeepSpeed's FusedLion has no CPU kernel (DeepSpeedCPULion runs with offload_optimizer on the cpu)",
}
"""DeepSpeed optimizers (``optimizer.type``, lower case) that run on GPUs only: a CPU run is skipped saying so
(Lion only without ``offload_optimizer`` on the CPU: ``engine.py``'s ``zero_use_cpu_optimizer`` takes
``DeepSpeedCPULion`` then). Lion was missing: a CPU run raised FusedLion's error with a traceback (found by an
adversarial pass)."""


def _missing_schedule(schedule: str) -> str | None:
    """Why the installed torch cannot run ``schedule`` (torch.distributed.pipelining lacks its class)."""
    try:
        from torch.distributed import pipelining
    except ImportError as exc:
        return f"this torch has no torch.distributed.pipelining ({exc})"
    name = TORCH_SCHEDULES[schedule]
    if not hasattr(pipelining, name):
        return f"pipeline.schedule {schedule}: this torch's torch.distributed.pipelining has no {name}"
    return None
