"""DeepSpeed ZeRO stages 1-3 (``deepspeed.initialize`` with a real ZeRO config) around the GPT decoder.

The process group is already initialised (through the capturing backend); DeepSpeed's comm layer
adopts it. The client optimizer (``client_optimizer``) is torch's AdamW, which ZeRO partitions, except
under ZeRO-Offload, where DeepSpeed needs a CPU optimizer: the config's own or DeepSpeedCPUAdam (a C++
op DeepSpeed compiles on first use, minutes, once per environment).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from commgate.model import dsconfig
from commgate.model.scenario import Scenario
from commgate.model.schemes.deepspeed_zero import built_partitioned
from commgate.run.interpose import optimizer_phase, phase
from commgate.run.workloads.gpt import GPT, batch, build


def ds_config(s: Scenario) -> dict[str, Any]:
    par, z = s.parallelism, s.parallelism.zero
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.micro_batches,
        "zero_optimization": {
            "stage": z.stage,
            "reduce_bucket_size": z.bucket_elements,
            "allgather_bucket_size": z.bucket_elements,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if s.model.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif s.model.dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    if par.pp > 1 and par.tp > 1:
        # Each tensor-parallel rank sends its stage's whole activation to its peer in the next stage.
        # (DeepSpeed's default, sending 1/t and all-gathering it there, aborts in gloo on CPU.)
        cfg["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if z.hpz > 1 or z.qwz or z.qgz:
        cfg["zero_optimization"] |= {
            "zero_hpz_partition_size": z.hpz,
            "zero_quantized_weights": z.qwz,
            "zero_quantized_gradients": z.qgz,
        }
    return merged(cfg, s.deepspeed_config)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base``, mappings key by key (the scenario's ``deepspeed:`` block over
    commgate's own keys; the block's contradictions with the scenario were refused when it loaded).
    ``"auto"`` values are left out."""
    out = dict(base)
    for k, v in over.items():
        if v == "auto":  # Hugging Face's placeholder for what the trainer fills in: here commgate's value
            continue
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def client_optimizer(params: Any, config: dict[str, Any]) -> torch.optim.Optimizer | None:
    """The optimizer of ``params`` (parameters or groups) handed to ``deepspeed.initialize``. Under
    ZeRO-Offload DeepSpeed needs a CPU optimizer: the config's own where it names one (None here: DeepSpeed
    builds it, DeepSpeedCPUAdam), else DeepSpeedCPUAdam. Otherwise torch's AdamW, which DeepSpeed takes
    over a config's optimizer section (an optimizer sends nothing of its own; DeepSpeed's FusedAdam would
    be a CPU op to build first, minutes: the scenario's warnings say so, ``loader``)."""
    if not dsconfig.offloads_optimizer(config):
        return torch.optim.AdamW(params, lr=1e-4)
    if "optimizer" in config:
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-4)


class ZeroWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        import deepspeed

        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)
        config = ds_config(scenario)
        model: torch.nn.Module
        self.inputs: Callable[[int], tuple[torch.Tensor, ...]]
        if built_partitioned(scenario):
            # partitioned as it is built, so that a full-size model never exists whole. The dtype comes from
            # the config: given as an argument, DeepSpeed 0.19's Init ignores it on CPU (``_set_dtype``:
            # ``dtype or torch.float16 if fp16 supported else bfloat16 ...`` takes bf16 whatever was given)
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = GPT(scenario.model, checkpointing=scenario.parallelism.activation_checkpointing)
            b = scenario.parallelism.micro_batch
            self.inputs = lambda seed: (batch(scenario.model, b, seed=seed, device=device),)
        else:
            model, self.inputs = build(scenario, device, checkpointing=scenario.parallelism.activation_checkpointing)
        params = list(model.parameters())
        optimizer = client_optimizer(params, config)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=params, config=config)

    def step(self, k: int) -> float:
        par = self.s.parallelism
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            loss = self.engine(*self.inputs(1000 * k + 10 * i + self.rank))
            with phase("backward"):
                self.engine.backward(loss)
            if i == par.micro_batches - 1:
                with optimizer_phase():
                    self.engine.step()
            else:
                self.engine.step()
        return float(loss.detach())
