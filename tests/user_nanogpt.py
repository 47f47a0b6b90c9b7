"""A user's model in the style of nanoGPT's ``model.py`` (karpathy/nanoGPT: GPT-2 blocks, learned
positions, and the token embedding tied to the output layer by ``self.wte.weight = self.lm_head.weight``,
so that one parameter is held by two modules). Written here for the tests, not copied; what matters to
commgate is the tie: DeepSpeed's ZeRO-3 coordinator gathers a parameter in each module that holds it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from commgate.model.scenario import Scenario
from torch import nn

V, T, H, LAYERS, HEADS = 1024, 32, 64, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.c_attn, self.c_proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.c_fc, self.c_out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(T, H)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))


def build(scenario: Scenario) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    b = scenario.parallelism.micro_batch

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, V, (b, T), generator=torch.Generator().manual_seed(seed)),)

    return GPT(), inputs
