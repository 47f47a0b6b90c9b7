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
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from commgate.model.scenario import ModelSpec, Scenario
from commgate.run.interpose import phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch
from commgate.run.workloads.zero import client_optimizer, ds_config


class _Head(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.final_norm, self.head = model.final_norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(x)) if self.head is not None else self.final_norm(x)


class _Word(nn.Module):
    """The word embedding alone, the module a tied pipeline holds on its first and its last stage
    (DeepSpeed's ``TiedLayerSpec``, as GPT-NeoX and Megatron tie them)."""

    def __init__(self, m: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.word = nn.Embedding(m.V, m.h, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens)


class _Positions(nn.Module):
    """A tied pipeline's learned positions, on the first stage after the word embedding."""

    def __init__(self, position: nn.Embedding) -> None:
        super().__init__()
        self.position = position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.position(torch.arange(x.shape[1], device=x.device))


def _tied_logits(word: _Word, x: torch.Tensor) -> torch.Tensor:
    """The last stage's output layer: the tied word embedding's weight; sharded on the vocabulary (3-D),
    Megatron's parallel logits: the input replicated over the tensor-parallel group (its gradient
    all-reduced there in the backward), the logits sharded on the vocabulary for ``loss_parallel``."""
    weight = word.word.weight
    if isinstance(weight, DTensor):
        x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
    return x @ weight.t()


def _layers(model: GPT, device: torch.device) -> list[Any]:
    """The pipeline's layers: the embedding, the transformer layers, the final norm and the output layer;
    tied, the word embedding is one ``TiedLayerSpec`` on both ends (the engine broadcasts its weight at
    construction and all-reduces its gradient between the two stages every step)."""
    from deepspeed.pipe import TiedLayerSpec

    m = model.spec
    if not m.tied_embeddings:
        return [model.embed, *model.layers, _Head(model)]
    dtype = model.final_norm.weight.dtype
    word = TiedLayerSpec("embed", _Word, m, dtype, device, tied_weight_attr="word.weight")
    positions = [_Positions(model.embed.position)] if model.embed.position is not None else []
    head = TiedLayerSpec("embed", _Word, m, dtype, device, forward_fn=_tied_logits, tied_weight_attr="word.weight")
    return [word, *positions, *model.layers, _Head(model), head]


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
        self.s, self.rank, self.device = scenario, rank, device
        # deepspeed.comm adopts the process group already initialised through the capturing backend
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", auto_mpi_discovery=False)
        torch.manual_seed(0)
        model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])
        self.module = PipelineModule(
            layers=_layers(model, device),
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
        elif isinstance(layer, _Head) and layer.head is not None:
            parallelize_module(layer, mesh, head_plan())
    for word in module.tied_modules.values():  # the tied word embedding, vocabulary-parallel on both ends
        parallelize_module(word, mesh, embedding_plan())
    localize(module)
    for comm in module.tied_comms.values():  # the engine all-reduces the local shard's gradient, not the view
        comm["weight_attr"] = ["word.parametrizations.weight.original"]


def pipeline_workload(scenario: Scenario, *, rank: int, device: torch.device) -> Any:
    """The scenario's pipeline engine: DeepSpeed's (``PipelineWorkload``) or ``torch.distributed.pipelining``
    (``commgate.run.workloads.torchpp``)."""
    if scenario.parallelism.pipeline.engine == "torch":
        from commgate.run.workloads.torchpp import TorchPipelineWorkload

        return TorchPipelineWorkload(scenario, rank=rank, device=device)
    return PipelineWorkload(scenario, rank=rank, device=device)
