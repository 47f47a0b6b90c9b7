"""DeepSpeed's pipeline engine (``deepspeed.pipe.PipelineModule``, as GPT-NeoX uses it) around the GPT
decoder's pieces: the embedding on the first stage, L/p transformer layers per stage (GPT-NeoX's
``type:`` partitioning on the layer class), the final norm and output layer on the last; ``m`` micro-
batches per step through the engine's 1F1B schedule (``train_batch``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from harness.errors import CommgateError
from harness.interpose import phase
from harness.scenario import Scenario
from harness.workloads.gpt import DTYPES, GPT, batch
from harness.workloads.zero import ds_config


class _Head(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.final_norm, self.head = model.final_norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head(self.final_norm(x))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class PipelineWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        import deepspeed
        from deepspeed.pipe import PipelineModule

        par = scenario.parallelism
        if par.tp != 1 or scenario.model.tied_embeddings:
            raise CommgateError("the pipeline workload runs pp x dp without tensor parallelism or tied embeddings")
        self.s, self.rank, self.device = scenario, rank, device
        # deepspeed.comm adopts the process group already initialised through the capturing backend
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", auto_mpi_discovery=False)
        torch.manual_seed(0)
        model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])
        layers = [model.embed, *model.layers, _Head(model)]
        self.module = PipelineModule(
            layers=layers,
            num_stages=par.pp,
            loss_fn=_loss,
            partition_method="type:Layer",
            activation_checkpoint_interval=1 if par.activation_checkpointing else 0,
        )
        optimizer = torch.optim.AdamW([p for p in self.module.parameters()], lr=1e-4)
        self.engine, *_ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=ds_config(scenario))

    def _data(self, k: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        par = self.s.parallelism
        dp_rank = self.engine.grid.get_data_parallel_rank()
        for i in range(par.micro_batches):
            tokens = batch(self.s.model, par.micro_batch, seed=1000 * k + 10 * i + dp_rank, device=self.device)
            yield tokens[:, :-1], tokens[:, 1:]

    def step(self, k: int) -> float:
        with phase("pipeline"):
            return float(self.engine.train_batch(data_iter=self._data(k)))
