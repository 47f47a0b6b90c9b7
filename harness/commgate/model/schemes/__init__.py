"""The parallelism schemes commgate knows: one ``Scheme`` record each (``commgate.model.schemes.scheme``),
the one place where a scheme's facts live. Everything else is derived from ``SCHEMES``: the scenario
schema's ``scheme`` enum, the consistency rules (the axes and blocks a scheme needs and allows, its
components' own ``rules``), the CLI's ``--scheme`` choices, the time model's workload kind and the
components whose collectives make up its per-collective model. The workload that runs it is the run
layer's registry (``commgate.run.workloads.WORKLOADS``), keyed by the scheme's name.

Adding a scheme: its component module(s) here (collectives, paper terms, residuals, rules), its workload
module under ``commgate.run.workloads``, one record below and one line in ``WORKLOADS``.
"""

from __future__ import annotations

from commgate.model.schemes.context import ContextParallel
from commgate.model.schemes.ddp import DistributedDataParallel
from commgate.model.schemes.deepspeed_zero import DeepSpeedZero3, DeepSpeedZero12
from commgate.model.schemes.fsdp import FullyShard
from commgate.model.schemes.moe import ExpertParallel, MoEDataParallel
from commgate.model.schemes.pipeline import PipelineDataParallel, PipelineParallel
from commgate.model.schemes.scheme import Component, Rule, Scheme
from commgate.model.schemes.tensor import TensorParallel

__all__ = ["RULES", "SCHEMES", "Component", "Scheme"]

_DDP, _Z12, _Z3, _TP = DistributedDataParallel(), DeepSpeedZero12(), DeepSpeedZero3(), TensorParallel()
_PP, _PDP, _CP = PipelineParallel(), PipelineDataParallel(), ContextParallel()

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            name="ddp",
            summary="torch DistributedDataParallel",
            components=(_DDP,),
            deepspeed=False,
            zero=False,
            autocast=True,
            user_module=True,
        ),
        Scheme(name="zero1", summary="DeepSpeed ZeRO stage 1", components=(_Z12,), zero_stage=1, user_module=True),
        Scheme(name="zero2", summary="DeepSpeed ZeRO stage 2", components=(_Z12,), zero_stage=2, user_module=True),
        Scheme(name="zero3", summary="DeepSpeed ZeRO stage 3", components=(_Z3,), zero_stage=3, user_module=True),
        Scheme(
            name="zero++",
            summary="DeepSpeed ZeRO++: stage 3 with hpZ, qwZ, qgZ",
            components=(_Z3,),
            zero_stage=3,
            zero_plus_plus=True,
        ),
        Scheme(
            name="fsdp",
            summary="torch FSDP2 (fully_shard), one parameter group per transformer block; with tp, 2-D over DTensor; "
            "with cp, ring attention and sharding over dp x cp; with pp, in torch.distributed.pipelining's stages",
            components=(TensorParallel(fsdp=True), _CP, _PP, FullyShard()),
            deepspeed=False,
            zero=False,
            fsdp=True,
            optional_tensor=True,
            pipeline_engines=("torch",),
            optional_context=True,
        ),
        Scheme(
            name="tp",
            summary="tensor parallelism on torch DTensor (DDP over dp)",
            components=(_TP, _DDP),
            deepspeed=False,
            min_dp=1,
            tensor=True,
        ),
        Scheme(
            name="cp",
            summary="context parallelism: torch's ring attention over cp ranks, DTensor TP inside, DDP over dp x cp",
            components=(_TP, _CP, _DDP),
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
            pipeline=True,
            pipeline_engines=("deepspeed", "torch", "megatron"),
            min_dp=1,
        ),
        Scheme(
            name="3d",
            summary="pipeline x data x tensor: DeepSpeed's pipeline engine with DTensor inside each stage "
            "(torchtitan: its pipeline with TP in the stages, dp = 1)",
            components=(_TP, _PP, _PDP),
            tensor=True,
            min_dp=1,
            pipeline=True,
            pipeline_engines=("deepspeed", "megatron", "torch"),
        ),
        Scheme(
            name="moe",
            summary="DeepSpeed MoE with expert parallelism",
            components=(ExpertParallel(), MoEDataParallel()),
            moe=True,
        ),
    )
}

RULES: tuple[Rule, ...] = tuple(
    dict.fromkeys(rule for s in SCHEMES.values() for component in s.components for rule in component.rules)
)
"""Every component's consistency rules, once each (a rule reports only where its feature is used)."""
