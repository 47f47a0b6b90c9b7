"""torch FSDP2 (``fully_shard``) around the GPT decoder, wrapped as torchtitan wraps it: every transformer
block, then the root; with context parallelism on torchtitan's (dp, cp, tp) mesh, sharded over dp x cp and
every micro-batch's sequences split over cp (``commgate.run.workloads.cp``). Gradient accumulation syncs
(reduce-scatters) on the last micro-batch only, and with ``reshard_after_backward: false`` keeps the
parameters gathered between micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from commgate.model.scenario import Scenario
from commgate.model.schemes.fsdp import built_on_meta
from commgate.run.interpose import optimizer_phase
from commgate.run.workloads.cp import sequence_split, use_ring
from commgate.run.workloads.gpt import DTYPES, GPT, batch, build
from commgate.run.workloads.torchpp import TorchPipelineWorkload
from commgate.run.workloads.tp import parallelize


class FSDPWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.s, self.rank = scenario, rank
        torch.manual_seed(0)  # the same initial weights everywhere: fully_shard keeps each rank's own shard
        par = scenario.parallelism
        # emulated: built on the meta device and sharded there, so that a full-size model never exists whole
        meta = built_on_meta(scenario)
        model: torch.nn.Module
        self.inputs: Callable[[int], tuple[torch.Tensor, ...]]
        if meta:
            m, b = scenario.model, par.micro_batch
            with torch.device("meta"):
                model = GPT(m, checkpointing=par.activation_checkpointing).to(dtype=DTYPES[m.dtype])
            self.inputs = lambda seed: (batch(m, b, seed=seed, device=device),)
        else:
            model, self.inputs = build(scenario, device, checkpointing=par.activation_checkpointing)
        assert isinstance(model, GPT)  # a user's module is not run under FSDP2 (the scenario rules say so)
        self.dp_rank = rank // (par.cp * par.tp)  # the ranks of a tensor- or context-parallel group read the same data
        self.cp_mesh = None
        if par.cp > 1:  # torchtitan's (dp, cp, tp) mesh: ring attention over cp, sharding over dp x cp
            mesh_3d = init_device_mesh(device.type, (par.dp, par.cp, par.tp), mesh_dim_names=("dp", "cp", "tp"))
            use_ring(device, par.cp_rotate)
            if par.tp > 1:
                parallelize(model, mesh_3d["tp"])
            self.cp_mesh = mesh_3d["cp"]
            mesh = mesh_3d["dp", "cp"]._flatten("dp_cp")
        elif par.dp_replicate > 1:  # HSDP: replicate over the first dimension, shard over the second
            mesh = init_device_mesh(device.type, (par.dp_replicate, par.dp), mesh_dim_names=("replicate", "shard"))
        elif par.tp > 1:  # 2-D, as torchtitan: DTensor tensor parallelism inside, FSDP2 over the data-parallel ranks
            mesh_2d = init_device_mesh(device.type, (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
            parallelize(model, mesh_2d["tp"], sequence_parallel=par.sequence_parallel)
            mesh = mesh_2d["dp"]
        else:
            mesh = init_device_mesh(device.type, (par.dp,))
        self.sharded = shard_blocks(model, scenario, mesh)
        if meta:  # each rank's shards only, filled locally (DTensor's own random init would sync a seed)
            model.to_empty(device=device)
            with torch.no_grad():
                for p in model.parameters():
                    cast(DTensor, p).to_local().normal_(0.0, 0.02)
        self.model = model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, k: int) -> float:
        par = self.s.parallelism
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            last = i == par.micro_batches - 1
            self.sharded.set_requires_gradient_sync(last)
            if not par.fsdp.reshard_after_backward:
                self.sharded.set_reshard_after_backward(last)
            inputs = self.inputs(1000 * k + 10 * i + self.dp_rank)
            with (
                loss_parallel() if par.tp > 1 else contextlib.nullcontext(),
                sequence_split(self.cp_mesh, *inputs) if self.cp_mesh else contextlib.nullcontext(inputs) as split,
            ):
                loss = self.model(*split)
                loss.float().backward()
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())


def shard_blocks(module: nn.Module, scenario: Scenario, mesh: DeviceMesh) -> FSDPModule:
    """``fully_shard`` as torchtitan wraps the decoder (or one pipeline stage of it): each block, then the
    module itself, with the scenario's mixed-precision policy and resharding."""
    f = scenario.parallelism.fsdp
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[f.param_dtype] if f.param_dtype else None,
        reduce_dtype=DTYPES[f.reduce_dtype] if f.reduce_dtype else None,
    )
    for layer in cast(nn.ModuleList, module.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=f.reshard_after_forward)
    return fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=f.reshard_after_forward)


def fsdp_workload(scenario: Scenario, *, rank: int, device: torch.device) -> FSDPWorkload | TorchPipelineWorkload:
    """FSDP2 alone (with TP, CP, HSDP), or inside torch.distributed.pipelining's stages when pp > 1."""
    if scenario.parallelism.pp > 1:
        return TorchPipelineWorkload(scenario, rank=rank, device=device, shard=shard_blocks)
    return FSDPWorkload(scenario, rank=rank, device=device)
