"""Megatron-style tensor parallelism with torch DTensor (``parallelize_module``) on the GPT decoder.

Per layer the fused QKV and the MLP input projection are column-parallel, the attention output and
MLP output projections row-parallel; the token embedding is vocabulary-parallel (row-wise on its
vocabulary dimension) and the output layer column-parallel with a vocabulary-parallel cross-entropy
(``loss_parallel``). LayerNorms and learned positions stay replicated. With activation checkpointing
each layer is recomputed in the backward. Data parallelism over tp groups is not run yet (dp = 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from harness.errors import CommgateError
from harness.interpose import optimizer_phase
from harness.scenario import Scenario
from harness.workloads.gpt import DTYPES, GPT, batch


def layer_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """One transformer layer: QKV and MLP input column-parallel, their outputs row-parallel."""
    return {
        f"{prefix}attention.qkv": ColwiseParallel(),
        f"{prefix}attention.dense": RowwiseParallel(),
        f"{prefix}mlp.fc_in": ColwiseParallel(),
        f"{prefix}mlp.fc_out": RowwiseParallel(),
    }


def embedding_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """The token embedding, vocabulary-parallel (row-wise on its vocabulary dimension)."""
    return {f"{prefix}word": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}


def head_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """The output layer, column-parallel, its logits left sharded for ``loss_parallel``."""
    return {f"{prefix}head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def plan(model: GPT) -> dict[str, ParallelStyle]:
    out = embedding_plan("embed.") | head_plan()
    for i in range(len(model.layers)):
        out |= layer_plan(f"layers.{i}.")
    return out


class TPWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        par = scenario.parallelism
        if par.dp != 1 or par.pp != 1:
            raise CommgateError("the DTensor tensor-parallel workload runs tp only (dp = pp = 1) so far")
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)
        model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])
        if scenario.model.tied_embeddings:
            raise CommgateError("tensor parallelism with tied embeddings is not supported by this workload")
        for layer in model.layers:
            layer.checkpointed = par.activation_checkpointing  # type: ignore[assignment]
        self.mesh = init_device_mesh(device.type, (par.tp,))
        parallelize_module(model, self.mesh, plan(model))  # in place
        self.model = model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)

    def step(self, k: int) -> float:
        par, m = self.s.parallelism, self.s.model
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            tokens = batch(m, par.micro_batch, seed=1000 * k + 10 * i, device=self.device)  # same data on the tp group
            logits = self.model.logits(tokens[:, :-1])
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()  # type: ignore[no-untyped-call]
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
