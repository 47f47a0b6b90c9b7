"""``torch.distributed.pipelining`` around the GPT decoder: pp x virtual_stages stages (stage k on rank
k mod pp, as torch's looped schedules place them), L / (pp x virtual_stages) layers each, the embedding
on the first and the final norm and output layer on the last; m micro-batches per step through the
scenario's schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble). Every stage is given its
input and output shapes, so no shape inference runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from commgate.model.expectation import Context
from commgate.model.scenario import TORCH_SCHEDULES, ModelSpec, Scenario
from commgate.model.schemes.tensor import activation_dtype
from commgate.run.interpose import optimizer_phase, phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch
from commgate.run.workloads.tp import embedding_plan, head_plan, layer_plan


class _Stage(nn.Module):
    def __init__(self, model: GPT, index: int, stages: int) -> None:
        super().__init__()
        per = len(model.layers) // stages
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleList(model.layers[index * per : (index + 1) * per])
        self.final_norm = model.final_norm if index == stages - 1 else None
        self.head = model.head if index == stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if layer.checkpointed and torch.is_grad_enabled():  # as GPT.logits: torch's non-reentrant checkpoint
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        if self.final_norm is not None and self.head is not None:
            x = self.head(self.final_norm(x))
        return x


def _stage_plan(stage: _Stage, spec: ModelSpec) -> dict[str, ParallelStyle]:
    """The decoder's tensor-parallel plan (``commgate.run.workloads.tp``) for what one stage holds."""
    out = embedding_plan("embed.") if stage.embed is not None else {}
    if stage.head is not None:
        out |= head_plan()
    for j in range(len(stage.layers)):
        out |= layer_plan(spec, f"layers.{j}.")
    return out


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


Shard = Callable[[nn.Module, Scenario, DeviceMesh], object]
"""How a stage is sharded over its data-parallel ranks (``commgate.run.workloads.fsdp.shard_blocks``)."""


class TorchPipelineWorkload:
    """The stages of rank ``rank``; with ``shard`` (scheme fsdp) torchtitan's (pp, dp, tp) mesh: the
    tensor-parallel plan inside (tp > 1), each stage sharded over its data-parallel ranks by ``shard``."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device, shard: Shard | None = None) -> None:
        par, m = scenario.parallelism, scenario.model
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)
        model = GPT(m, checkpointing=par.activation_checkpointing).to(device=device, dtype=DTYPES[m.dtype])
        n = par.pp * par.pipeline.virtual_stages
        # what the stages compute in, so what crosses their boundaries: FSDP2's param_dtype, else the model's
        b, dtype = par.micro_batch, DTYPES[activation_dtype(Context(scenario=scenario))]
        hidden = torch.empty(b, m.s, m.h, dtype=dtype, device=device)
        self.stages = []
        pp_group, dp_mesh, tp_mesh, self.dp_rank = None, None, None, 0
        if shard is not None:  # torchtitan's (pp, dp, tp) mesh: TP inside each stage, FSDP2 over dp
            mesh = init_device_mesh(device.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
            tp_mesh = mesh["tp"]
            pp_group, dp_mesh = mesh["pp"].get_group(), mesh["dp"]
            self.dp_rank = mesh["dp"].get_local_rank()
            rank = mesh["pp"].get_local_rank()  # this rank's stage
        for index in range(rank, n, par.pp):
            module = _Stage(model, index, n)
            if par.tp > 1:  # this stage's parameters only: every rank distributes what it holds
                parallelize_module(module, tp_mesh, _stage_plan(module, m))
            if shard is not None and dp_mesh is not None:
                shard(module, scenario, dp_mesh)
            first, last = index == 0, index == n - 1
            inputs = torch.zeros(b, m.s, dtype=torch.long, device=device) if first else hidden
            outputs = torch.empty(b, m.s, m.V, dtype=dtype, device=device) if last else hidden
            stage = pipelining.PipelineStage(
                module,
                index,
                n,
                device,
                input_args=inputs,
                output_args=outputs,
                output_grads=None if last else hidden,
                input_grads=(None,) if first else hidden,
                group=pp_group,
            )
            self.stages.append(stage)
        indices = {stage.stage_index for stage in self.stages}
        self.first, self.last = 0 in indices, n - 1 in indices
        cls = getattr(pipelining, TORCH_SCHEDULES[par.pipeline.schedule])
        own = self.stages if par.pipeline.looped else self.stages[0]
        self.schedule = cls(own, n_microbatches=par.micro_batches, loss_fn=_loss)
        params = [p for s in self.stages for p in s.submod.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step(self, k: int) -> float:
        par = self.s.parallelism
        seed = 1000 * k + self.dp_rank  # each data-parallel replica its own
        tokens = batch(self.s.model, par.micro_batch * par.micro_batches, seed=seed, device=self.device)
        losses: list[torch.Tensor] = []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        with phase("pipeline"), loss_parallel() if par.tp > 1 else contextlib.nullcontext():
            self.schedule.step(*args, **kwargs)
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean().detach()) if losses else 0.0
