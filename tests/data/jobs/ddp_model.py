"""The model of ``ddp_train.py`` for a scenario's ``model.module`` (``ddp_model:build``): the script's own
class, and its inputs (4 rows of 64 features a micro-batch)."""

from collections.abc import Callable
from typing import Any

import torch
from ddp_train import MLP


def build(scenario: Any) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(scenario.parallelism.micro_batch, 64, generator=torch.Generator().manual_seed(seed)),)

    return MLP(), inputs
