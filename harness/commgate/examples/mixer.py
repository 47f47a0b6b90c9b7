"""An example of your own model under the gate (``model: {module: "commgate.examples.mixer:build"}``):
a small MLP-Mixer-style sequence classifier that shares nothing with the built-in decoder — token and
channel mixing MLPs, a learned class query and positional table (plain parameters, no module), an input
projection whose weight is used twice, and a forward whose module order differs from registration
order. commgate predicts its DDP and ZeRO communication from the module alone, built on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from commgate.model.scenario import Scenario

FEATURES, TOKENS, WIDTH, CLASSES, BLOCKS = 24, 16, 48, 10, 3


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.channel = nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )
        self.token = nn.Linear(TOKENS, TOKENS)  # registered after the channel MLP, applied before it
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token(self.norm(x).transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = x + self.channel(x)
        return out


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(BLOCKS))
        self.project = nn.Linear(FEATURES, WIDTH)
        self.positions = nn.Parameter(torch.randn(TOKENS, WIDTH))
        self.query = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.project(features.to(self.project.weight.dtype)) + self.positions
        for block in self.blocks:
            x = block(x)
        pooled = torch.softmax((x * self.query).sum(-1), dim=-1).unsqueeze(-1) * x
        # the input projection's weight again, on the pooled features (shared, not a second module)
        logits = self.head(pooled.sum(1) + pooled.mean(1) @ self.project.weight @ self.project.weight.t())
        return F.cross_entropy(logits.float(), labels)


def build(scenario: Scenario) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    """The model, and one micro-batch of ``micro_batch`` sequences per seed."""
    b = scenario.parallelism.micro_batch

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(b, TOKENS, FEATURES, generator=g), torch.randint(0, CLASSES, (b,), generator=g)

    return Mixer(), inputs
