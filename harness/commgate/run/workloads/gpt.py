"""The decoder in plain torch, whose parameters are exactly ``commgate.model.transformer.inventory``.

GPT-NeoX-shaped (the default): token embedding, optional learned positions (or rotary, or none),
L x [LayerNorm, fused QKV, causal attention, output projection, LayerNorm, MLP h -> ffn -> h with
GELU], final LayerNorm and an untied output layer (or the embedding reused when tied). Residuals are
sequential pre-LayerNorm (GPT-NeoX's parallel residual changes no parameter and no collective).

Llama-style (``architecture: llama``), as Hugging Face's ``LlamaForCausalLM`` lays it out: RMSNorm,
separate Q, K, V projections with grouped-query attention (``kv_heads``) and rotary positions, the
output projection, RMSNorm, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), no biases.

Parameter names match the inventory's, so tests compare the two tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from commgate.model.scenario import ModelSpec, Scenario

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding over the last dimension of (batch, heads, seq, head_dim); ``positions``
    (seq,) are the tokens' places in the sequence (default 0 .. seq-1; a context-parallel rank's part)."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    where = torch.arange(s, device=x.device) if positions is None else positions
    angles = torch.outer(where.to(torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """GPT-NeoX's attention: one fused QKV projection."""

    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.head_dim, self.rotary = m.h // m.a, m.position == "rotary"
        self.qkv = nn.Linear(m.h, 3 * m.h)
        self.dense = nn.Linear(m.h, m.h)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # QKV outputs are laid out per head, [heads, 3, head_dim], as in GPT-NeoX: a column shard of
        # the fused projection then holds whole heads (tensor parallelism splits the heads).
        b, s, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # a, or a/t on a tensor-parallel shard
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        if self.rotary:
            q, k = rotary(q, positions), rotary(k, positions)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class GroupedQueryAttention(nn.Module):
    """Llama's attention: separate Q, K and V projections, ``kv_heads`` key/value heads each shared by
    a/kv_heads query heads, rotary positions, no biases (but Qwen2's on Q, K and V: ``qkv_bias``)."""

    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.head_dim = m.h // m.a
        self.q = nn.Linear(m.h, m.h, bias=m.qkv_bias)
        self.k = nn.Linear(m.h, m.kv * self.head_dim, bias=m.qkv_bias)
        self.v = nn.Linear(m.h, m.kv * self.head_dim, bias=m.qkv_bias)
        self.dense = nn.Linear(m.h, m.h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # on a tensor-parallel shard each projection holds whole heads: a/t query and kv/t key/value heads
        b, s = x.shape[0], x.shape[1]
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = rotary(q, positions), rotary(k, positions)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.dense(out.transpose(1, 2).reshape(b, s, q.shape[1] * self.head_dim))


class MLP(nn.Module):
    """GPT-NeoX's MLP: h -> ffn -> h with GELU."""

    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.fc_in = nn.Linear(m.h, m.ffn)
        self.fc_out = nn.Linear(m.ffn, m.h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.gate = nn.Linear(m.h, m.ffn, bias=False)
        self.up = nn.Linear(m.h, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, m.h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def mlp(m: ModelSpec) -> nn.Module:
    """The architecture's MLP (also the expert an MoE layer replicates)."""
    return SwiGLU(m) if m.llama else MLP(m)


def norm(m: ModelSpec) -> nn.Module:
    """The architecture's norm: LayerNorm (GPT-NeoX) or RMSNorm (Llama)."""
    return nn.RMSNorm(m.h) if m.llama else nn.LayerNorm(m.h)


class Layer(nn.Module):
    def __init__(self, m: ModelSpec, mlp_: nn.Module | None = None) -> None:
        super().__init__()
        self.checkpointed = False
        self.input_norm = norm(m)
        self.attention = GroupedQueryAttention(m) if m.llama else Attention(m)
        self.post_attention_norm = norm(m)
        self.mlp = mlp_ if mlp_ is not None else mlp(m)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.input_norm(x)
        # positions by keyword, and only when given: a tensor-parallel plan's PrepareModuleInput sees one input
        x = x + (self.attention(h) if positions is None else self.attention(h, positions=positions))
        return x + self.mlp(self.post_attention_norm(x))


class Embedding(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.word = nn.Embedding(m.V, m.h)
        self.position = nn.Embedding(m.s, m.h) if m.position == "learned" else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word(tokens)
        if self.position is not None:
            where = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
            x = x + self.position(where)
        return x


class GPT(nn.Module):
    """The decoder; ``forward(tokens)`` returns the next-token cross-entropy loss."""

    def __init__(self, m: ModelSpec, *, checkpointing: bool = False) -> None:
        """``checkpointing``: recompute each layer's activations in the backward (torch's non-reentrant
        checkpoint, which stops recomputing once the saved tensors are rebuilt)."""
        super().__init__()
        self.spec = m
        self.embed = Embedding(m)
        layers = [Layer(m) for _ in range(m.L)]
        for layer in layers:
            layer.checkpointed = checkpointing
        self.layers = nn.ModuleList(layers)
        self.final_norm = norm(m)
        self.head = None if m.tied_embeddings else nn.Linear(m.h, m.V, bias=False)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens) if positions is None else self.embed(tokens, positions)
        for layer in self.layers:
            args = (x,) if positions is None else (x, positions)
            if layer.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        x = self.final_norm(x)
        return self.head(x) if self.head is not None else x @ self.embed.word.weight.t()

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean next-token loss: of ``tokens`` (b, s + 1), or, given ``labels``, of inputs ``tokens`` and
        their ``labels`` at ``positions`` (a context-parallel rank's part of each sequence)."""
        if labels is None:
            tokens, labels = tokens[:, :-1], tokens[:, 1:]
        logits = self.logits(tokens, positions)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def batch(m: ModelSpec, b: int, *, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic token ids of shape (b, s + 1): s inputs and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.V, (b, m.s + 1), generator=g).to(device)


def build(
    scenario: Scenario, device: torch.device, *, checkpointing: bool = False
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    """The model a data-parallel workload trains and a function from a seed to one micro-batch's inputs
    on ``device``: the built-in decoder and its token batches, or the scenario's own module
    (``model.module``, ``commgate.model.usermodule``)."""
    m = scenario.model
    if m.module:
        from commgate.model.usermodule import build as user_build

        torch.manual_seed(0)
        model, inputs = user_build(scenario, device)
        model = model.to(device=device, dtype=DTYPES[m.dtype])
        return model, lambda seed: tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs(seed))
    b = scenario.parallelism.micro_batch
    model = GPT(m, checkpointing=checkpointing).to(device=device, dtype=DTYPES[m.dtype])
    return model, lambda seed: (batch(m, b, seed=seed, device=device),)
