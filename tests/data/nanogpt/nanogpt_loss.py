"""nanoGPT's model for a scenario's ``model.module`` (``nanogpt_loss:build``), at the tiny size the test
trains (``CONFIG``, passed to ``train.py`` as ``--key=value``): nanoGPT's own ``GPT``, whose forward here
returns the loss alone (commgate's hook wants the loss; parameters and their order are ``GPT``'s)."""

from collections.abc import Callable
from typing import Any

CONFIG = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "bias": False, "dropout": 0.0}
VOCAB = 50304
"""nanoGPT's vocabulary when the data directory has no meta.pkl (GPT-2's 50257, rounded up)."""


def build(scenario: Any) -> tuple[Any, Callable[[int], tuple[Any, ...]]]:
    import torch
    from model import GPT, GPTConfig

    class GPTLoss(GPT):  # type: ignore[misc]
        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return super().forward(idx, targets)[1]

    b, s = scenario.parallelism.micro_batch, CONFIG["block_size"]

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)

    return GPTLoss(GPTConfig(**CONFIG, vocab_size=VOCAB)), inputs
