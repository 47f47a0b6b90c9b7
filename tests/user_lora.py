"""A user's module with frozen parameters and buffers, for the tests (``model: {module:
"user_lora:build"}``, with ``tests/`` on the path): a small LoRA-style classifier whose embedding and
base projections are frozen (``requires_grad`` off), trained through low-rank adapters, with a float
buffer (cast to the scenario's dtype with the module), a boolean mask and an int64 counter."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from commgate.model.scenario import Scenario
from torch import nn

VOCAB, WIDTH, TOKENS, RANK, LAYERS = 64, 32, 12, 4, 3


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(RANK, WIDTH) * 0.02)
        self.up = nn.Parameter(torch.zeros(WIDTH, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.down.t()) @ self.up.t()
        return out


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.embed.requires_grad_(False)
        self.layers = nn.ModuleList(LoRALinear() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH), persistent=False)
        self.register_buffer("mask", torch.ones(TOKENS, dtype=torch.bool))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        x = self.norm(x) * self.mask[: x.shape[1], None].to(x.dtype)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), labels.flatten())


def build(scenario: Scenario) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    b = scenario.parallelism.micro_batch

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB, (b, TOKENS), generator=g), torch.randint(0, VOCAB, (b, TOKENS), generator=g)

    return Tiny(), inputs
