"""A model whose inner module returns a mapping its parent reads by attribute, as Hugging Face's ``ModelOutput``
(an ``OrderedDict`` with fields) is read: ``LlamaForCausalLM`` takes ``outputs.last_hidden_state`` from its
inner model's output. The ZeRO-3 trace marks the tensors of every module's output; the mapping must stay
what it was."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Output(OrderedDict):  # type: ignore[type-arg]
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(hidden=self.proj(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x).hidden).sum()


def build(scenario: Any) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    return Model(), lambda seed: (torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)),)
