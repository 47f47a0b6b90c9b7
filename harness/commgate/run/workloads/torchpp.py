"""``torch.distributed.pipelining`` around the GPT decoder: pp x virtual_stages stages (stage k on rank
k mod pp, as torch's looped schedules place them), L / (pp x virtual_stages) layers each, the embedding
on the first and the final norm and output layer on the last; m micro-batches per step through the
scenario's schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble). Every stage is given its
input and output shapes, so no shape inference runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

from commgate.model.scenario import TORCH_SCHEDULES, Scenario
from commgate.run.interpose import optimizer_phase, phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch


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
            x = layer(x)
        if self.final_norm is not None and self.head is not None:
            x = self.head(self.final_norm(x))
        return x


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class TorchPipelineWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        par, m = scenario.parallelism, scenario.model
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)
        model = GPT(m).to(device=device, dtype=DTYPES[m.dtype])
        n = par.pp * par.pipeline.virtual_stages
        b, dtype = par.micro_batch, DTYPES[m.dtype]
        hidden = torch.empty(b, m.s, m.h, dtype=dtype, device=device)
        self.stages = []
        for index in range(rank, n, par.pp):
            module = _Stage(model, index, n)
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
        tokens = batch(self.s.model, par.micro_batch * par.micro_batches, seed=1000 * k, device=self.device)
        losses: list[torch.Tensor] = []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        with phase("pipeline"):
            self.schedule.step(*args, **kwargs)
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else 0.0
