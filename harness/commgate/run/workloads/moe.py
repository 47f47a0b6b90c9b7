"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``, top-k gating, expert parallelism) in the GPT decoder:
every ``every``-th layer's MLP becomes ``experts`` expert MLPs, of which each rank holds experts/ep,
behind a gate; tokens travel to their experts and back by all-to-all over the expert-parallel group.
Trained by DeepSpeed's engine (ZeRO stage from the scenario, 0 by default)."""

from __future__ import annotations

import os

import torch
from torch import nn

from commgate.model.scenario import Scenario
from commgate.run.workloads.gpt import DTYPES, GPT, batch, mlp
from commgate.run.workloads.zero import ZeroWorkload, client_optimizer, ds_config


class _MoEMLP(nn.Module):
    """Adapts DeepSpeed's MoE layer (which returns output, aux loss, counts) to the decoder's MLP slot."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _aux, _counts = self.moe(x)
        return out


class MoEWorkload(ZeroWorkload):
    """Built here; steps like any DeepSpeed engine (``ZeroWorkload.step``)."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", auto_mpi_discovery=False)
        cfg = scenario.parallelism.moe
        assert cfg is not None
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)
        model = GPT(scenario.model, checkpointing=scenario.parallelism.activation_checkpointing)
        for i, layer in enumerate(model.layers):
            if (i + 1) % cfg.every == 0:
                layer.mlp = _MoEMLP(
                    MoE(
                        hidden_size=scenario.model.h,
                        expert=mlp(scenario.model),
                        num_experts=cfg.experts,
                        ep_size=cfg.ep,
                        k=cfg.top_k,
                        capacity_factor=cfg.capacity_factor,
                        eval_capacity_factor=cfg.capacity_factor,
                        min_capacity=cfg.min_capacity,
                        drop_tokens=True,
                    )
                )
        model = model.to(device=device, dtype=DTYPES[scenario.model.dtype])
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"name": "parameters", "params": list(model.parameters())}
        )
        config = ds_config(scenario)
        optimizer = client_optimizer(groups, config)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=groups, config=config)
        m, b = scenario.model, scenario.parallelism.micro_batch
        self.inputs = lambda seed: (batch(m, b, seed=seed, device=device),)
