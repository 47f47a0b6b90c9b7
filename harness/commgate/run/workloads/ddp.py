"""torch DistributedDataParallel around the GPT decoder or the scenario's own module (gradient accumulation
with ``no_sync``; ``model.autocast`` runs the forward under ``torch.autocast``)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from commgate.model.scenario import Scenario
from commgate.run.interpose import optimizer_phase
from commgate.run.workloads.gpt import DTYPES, build


class DDPWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)  # the same initial weights everywhere; DDP broadcasts rank 0's anyway
        model, self.inputs = build(scenario, device, checkpointing=scenario.parallelism.activation_checkpointing)
        self.engine = DistributedDataParallel(model, bucket_cap_mb=scenario.parallelism.ddp_bucket_mb)
        self.optimizer = torch.optim.AdamW(self.engine.parameters(), lr=1e-4)

    def step(self, k: int) -> float:
        par = self.s.parallelism
        loss = torch.zeros(())
        m = self.s.model
        for i in range(par.micro_batches):
            sync = i == par.micro_batches - 1
            with contextlib.nullcontext() if sync else self.engine.no_sync():
                # mixed precision by autocast: 16-bit compute, fp32 parameters and gradients
                with torch.autocast(
                    self.device.type, dtype=DTYPES[m.autocast or "bf16"], enabled=m.autocast is not None
                ):
                    loss = self.engine(*self.inputs(1000 * k + 10 * i + self.rank))
                loss.backward()
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
