"""Megatron-style tensor parallelism with torch DTensor (``parallelize_module``) on the decoder.

Per layer the fused QKV and the MLP input projection are column-parallel, the attention output and
MLP output projections row-parallel. Llama-style layers (separate Q, K, V; SwiGLU gate, up, down) are
sharded as torchtitan shards them: the attention's and the MLP's input is made a replicated DTensor once
(``PrepareModuleInput``), so that the column-parallel projections reading it share one input-gradient
all-reduce in the backward; Q, K, V, gate and up column-parallel (whole query and key/value heads per
rank), output and down row-parallel. the token embedding is vocabulary-parallel (row-wise on its
vocabulary dimension) and the output layer column-parallel with a vocabulary-parallel cross-entropy
(``loss_parallel``). LayerNorms and learned positions stay replicated. With activation checkpointing
each layer is recomputed in the backward. With dp > 1 the replicas are kept in sync by ``DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from commgate.core.errors import CommgateError
from commgate.model.scenario import ModelSpec, Scenario
from commgate.run.interpose import optimizer_phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch


def layer_plan(m: ModelSpec, prefix: str = "") -> dict[str, ParallelStyle]:
    """One transformer layer: QKV and MLP input column-parallel, their outputs row-parallel."""
    if m.llama:
        shared = {"input_layouts": (Replicate(),), "desired_input_layouts": (Replicate(),), "use_local_output": False}
        return {
            f"{prefix}attention": PrepareModuleInput(**shared),  # type: ignore[arg-type]
            f"{prefix}attention.q": ColwiseParallel(),
            f"{prefix}attention.k": ColwiseParallel(),
            f"{prefix}attention.v": ColwiseParallel(),
            f"{prefix}attention.dense": RowwiseParallel(),
            f"{prefix}mlp": PrepareModuleInput(**shared),  # type: ignore[arg-type]
            f"{prefix}mlp.gate": ColwiseParallel(),
            f"{prefix}mlp.up": ColwiseParallel(),
            f"{prefix}mlp.down": RowwiseParallel(),
        }
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


def sequence_parallel_plan(m: ModelSpec, prefix: str = "") -> dict[str, ParallelStyle]:
    """One layer with Megatron-style sequence parallelism (torchtitan's plan): the norms run on sequence
    shards (``SequenceParallel``); the attention's and the MLP's input is all-gathered from them
    (``PrepareModuleInput`` Shard(1) -> Replicate) and their row-parallel output reduce-scattered back."""
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    out: dict[str, ParallelStyle] = {
        f"{prefix}input_norm": SequenceParallel(),
        f"{prefix}attention": PrepareModuleInput(**gather),  # type: ignore[arg-type]
        f"{prefix}post_attention_norm": SequenceParallel(),
        f"{prefix}mlp": PrepareModuleInput(**gather),  # type: ignore[arg-type]
    }
    for name, style in layer_plan(m, prefix).items():
        if isinstance(style, RowwiseParallel):
            out[name] = RowwiseParallel(output_layouts=Shard(1))
        elif isinstance(style, ColwiseParallel):
            out[name] = style
    return out


def plan(model: GPT, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    out = embedding_plan("embed.") | head_plan()
    if sequence_parallel:
        # the embedding's output (word all-reduced, learned positions added to the whole sequence) is cut
        # into sequence shards where the first layer reads it: a local split, no communication
        out["layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        out["final_norm"] = SequenceParallel()
        out["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for i in range(len(model.layers)):
        layer = sequence_parallel_plan if sequence_parallel else layer_plan
        out |= layer(model.spec, f"layers.{i}.")
    return out


def parallelize(model: GPT, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """``model`` sharded over ``mesh`` by ``plan``. A tied output layer is Megatron's: a column-parallel head
    whose weight is the vocabulary-parallel word embedding's, both sharded on the vocabulary (one DTensor,
    distributed once; each use adds to its gradient on the rank, so the shared weight costs no collective
    of its own within the tensor-parallel group)."""
    styles = plan(model, sequence_parallel=sequence_parallel)
    if model.head is not None:  # untied: the plan as it is (embedding, head, layers: their distribution order)
        parallelize_module(model, mesh, styles)
        return
    head = styles.pop("head")
    parallelize_module(model, mesh, styles)
    tied = nn.Linear(model.spec.h, model.spec.V, bias=False, device="meta")
    tied.weight = model.embed.word.weight  # a DTensor sharded as the head wants it: not distributed again
    model.head = tied
    parallelize_module(model, mesh, {"head": head})
    tied.weight = model.embed.word.weight  # the style wrapped it in a Parameter of its own: tie it back


class TPWorkload:
    """tp ranks per model replica; with dp > 1, ``DistributedDataParallel`` over the replicas (a
    (dp, tp) device mesh, tensor-parallel ranks adjacent), reducing each rank's local shards."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        par = scenario.parallelism
        if par.pp != 1:
            raise CommgateError("the DTensor tensor-parallel workload runs without pipeline stages (use scheme 3d)")
        self.s, self.rank, self.device = scenario, rank, device
        self.dp_rank = rank // par.tp
        torch.manual_seed(0)
        model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])
        for layer in model.layers:
            layer.checkpointed = par.activation_checkpointing  # type: ignore[assignment]
        if par.dp > 1:
            mesh = init_device_mesh(device.type, (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
            parallelize(model, mesh["tp"], sequence_parallel=par.sequence_parallel)
            localize(model)
            self.engine: nn.Module = DistributedDataParallel(
                model, process_group=mesh["dp"].get_group(), bucket_cap_mb=par.ddp_bucket_mb
            )
        else:
            mesh_tp = init_device_mesh(device.type, (par.tp,))
            parallelize(model, mesh_tp, sequence_parallel=par.sequence_parallel)
            self.engine = model
        self.optimizer = torch.optim.AdamW(self.engine.parameters(), lr=1e-4, foreach=False)

    def step(self, k: int) -> float:
        par, m = self.s.parallelism, self.s.model
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            last = i == par.micro_batches - 1
            accumulate = (
                self.engine.no_sync() if isinstance(self.engine, DistributedDataParallel) and not last else None
            )
            # the same data on a tp group, its own on each data-parallel replica
            tokens = batch(m, par.micro_batch, seed=1000 * k + 10 * i + self.dp_rank, device=self.device)
            with accumulate or contextlib.nullcontext(), loss_parallel():
                loss = self.engine(tokens)
                loss.backward()
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())


def localize(module: nn.Module) -> None:
    """Hand ``module``'s DTensor parameters to a data-parallel engine (DDP, DeepSpeed) as their local
    shards: each becomes a plain ``Parameter`` holding the shard, wrapped back into its DTensor whenever
    the module reads it (``_FromLocal``), so the engine reduces the shards' gradients. (torch's own
    transform for DDP, ``_pre_dp_module_transform``, swaps in new parameter objects at every forward, so
    an engine holding the first ones never sees their gradients.)"""
    shards: dict[int, nn.Parameter] = {}  # a tied parameter: one local shard for every module holding it
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if isinstance(param, DTensor):
                _localize(sub, name, param, shards)


class _FromLocal(nn.Module):
    """A parametrization: the module sees the DTensor, the engine the local shard it wraps (the same
    ``Parameter`` object throughout, so that the engine's gradient reduction and optimizer find it)."""

    def __init__(self, param: DTensor) -> None:
        super().__init__()
        self.mesh, self.placements = param.device_mesh, param.placements
        self.shape, self.stride = param.shape, param.stride()

    def forward(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def _localize(module: nn.Module, name: str, param: DTensor, shards: dict[int, nn.Parameter]) -> None:
    from torch.nn.utils import parametrize

    delattr(module, name)
    if id(param) not in shards:
        shards[id(param)] = nn.Parameter(param.to_local().detach().clone())
    module.register_parameter(name, shards[id(param)])
    parametrize.register_parametrization(module, name, _FromLocal(param), unsafe=True)  # shapes differ
