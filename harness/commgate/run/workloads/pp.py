"""DeepSpeed's pipeline engine (``deepspeed.pipe.PipelineModule``, as GPT-NeoX uses it) around the GPT
decoder's pieces: the embedding on the first stage, L/p transformer layers per stage (GPT-NeoX's
``type:`` partitioning on the layer class), the final norm and output layer on the last; ``m`` micro-
batches per step through the engine's 1F1B schedule (``train_batch``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from commgate.core.errors import CommgateError
from commgate.model.scenario import ModelSpec, Scenario
from commgate.run.interpose import phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch
from commgate.run.workloads.zero import client_optimizer, ds_config


class _Head(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.final_norm, self.head = model.final_norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head(self.final_norm(x))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    # with tensor parallelism a replicated DTensor: the engine reduces the loss as a plain tensor
    return loss.to_local() if isinstance(loss, DTensor) else loss


class PipelineWorkload:
    """pp x dp (scheme ``pp``), and with tensor parallelism inside each stage pp x dp x tp (scheme ``3d``):
    the engine's topology gets a model-parallel axis, and each stage's layers are sharded Megatron style
    with DTensor over that axis (``commgate.run.workloads.tp``), their parameters then handed to the engine as
    local shards (torch's own DTensor-to-data-parallel transform), so that the engine's data-parallel
    gradient all-reduce moves each rank's shards."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        import deepspeed
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        par = scenario.parallelism
        if scenario.model.tied_embeddings:
            raise CommgateError("the pipeline workload does not tie embeddings across stages")
        self.s, self.rank, self.device = scenario, rank, device
        # deepspeed.comm adopts the process group already initialised through the capturing backend
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", auto_mpi_discovery=False)
        torch.manual_seed(0)
        model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])
        layers = [model.embed, *model.layers, _Head(model)]
        self.module = PipelineModule(
            layers=layers,
            topology=PipeModelDataParallelTopology(num_pp=par.pp, num_mp=par.tp, num_dp=par.dp),
            loss_fn=_loss,
            partition_method="type:Layer",
            activation_checkpoint_interval=1 if par.activation_checkpointing else 0,
            # as GPT-NeoX: the transformer layers only (the engine's reentrant checkpoint of the
            # embedding, whose input needs no gradient, would cut the graph)
            checkpointable_layers=["Layer"],
        )
        if par.tp > 1:
            _shard_stage(self.module, scenario.model, device)
        config, params = ds_config(scenario), list(self.module.parameters())
        optimizer = client_optimizer(params, config)
        self.engine, *_ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, model_parameters=params, config=config
        )

    def _data(self, k: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        par = self.s.parallelism
        dp_rank = self.engine.grid.get_data_parallel_rank()
        for i in range(par.micro_batches):
            tokens = batch(self.s.model, par.micro_batch, seed=1000 * k + 10 * i + dp_rank, device=self.device)
            yield tokens[:, :-1], tokens[:, 1:]

    def step(self, k: int) -> float:
        # vocabulary-parallel cross-entropy on the last stage; the engine runs its backward inside
        with phase("pipeline"), loss_parallel() if self.s.parallelism.tp > 1 else contextlib.nullcontext():
            return float(self.engine.train_batch(data_iter=self._data(k)))


def _shard_stage(module: Any, m: ModelSpec, device: torch.device) -> None:  # a deepspeed.pipe.PipelineModule
    """Shard this stage's layers over the engine's model-parallel group with DTensor, Megatron style, and
    hand their parameters to the engine as local shards (``commgate.run.workloads.tp.localize``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commgate.run.workloads.gpt import Embedding, Layer
    from commgate.run.workloads.tp import embedding_plan, head_plan, layer_plan, localize

    mesh = DeviceMesh.from_group(module._grid.get_slice_parallel_group(), device.type)
    for layer in module.forward_funcs:
        if isinstance(layer, Layer):
            parallelize_module(layer, mesh, layer_plan(m))
        elif isinstance(layer, Embedding):
            parallelize_module(layer, mesh, embedding_plan())
        elif isinstance(layer, _Head):
            parallelize_module(layer, mesh, head_plan())
    localize(module)


def pipeline_workload(scenario: Scenario, *, rank: int, device: torch.device) -> Any:
    """The scenario's pipeline engine: DeepSpeed's (``PipelineWorkload``) or ``torch.distributed.pipelining``
    (``commgate.run.workloads.torchpp``)."""
    if scenario.parallelism.pipeline.engine == "torch":
        from commgate.run.workloads.torchpp import TorchPipelineWorkload

        return TorchPipelineWorkload(scenario, rank=rank, device=device)
    return PipelineWorkload(scenario, rank=rank, device=device)
