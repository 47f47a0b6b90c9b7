"""torch DistributedDataParallel around the GPT decoder (gradient accumulation with ``no_sync``)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from commgate.model.scenario import Scenario
from commgate.run.interpose import optimizer_phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch


class DDPWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.s, self.rank, self.device = scenario, rank, device
        torch.manual_seed(0)  # the same initial weights everywhere; DDP broadcasts rank 0's anyway
        model = GPT(scenario.model, checkpointing=scenario.parallelism.activation_checkpointing).to(
            device=device, dtype=DTYPES[scenario.model.dtype]
        )
        self.engine = DistributedDataParallel(model, bucket_cap_mb=scenario.parallelism.ddp_bucket_mb)
        self.optimizer = torch.optim.AdamW(self.engine.parameters(), lr=1e-4)

    def step(self, k: int) -> float:
        par = self.s.parallelism
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            sync = i == par.micro_batches - 1
            with contextlib.nullcontext() if sync else self.engine.no_sync():
                tokens = batch(self.s.model, par.micro_batch, seed=1000 * k + 10 * i + self.rank, device=self.device)
                loss = self.engine(tokens)
                loss.backward()
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss)
