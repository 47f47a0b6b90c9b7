"""The transformer being trained: its dimensions, presets, and the inventory of its parameter tensors.

The inventory is the single truth for parameter counts. It lists every tensor of a GPT-NeoX-shaped
decoder (token embedding, optional learned positions, L x [LayerNorm, QKV, attention output,
LayerNorm, MLP h->xh->h], final LayerNorm, untied output layer) with the way Megatron-style tensor
parallelism splits it and the pipeline stage that holds it. The paper's Eq. 1 lives in
``commgate.model.paper``; the difference between the two is a named term (biases, LayerNorm counting).

Naming: ``L`` layers, ``h`` hidden, ``a`` heads, ``V`` vocabulary, ``s`` sequence, ``x`` MLP expansion,
as in the seed paper's Table I.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace
from typing import Literal

Position = Literal["learned", "rotary", "none"]
DType = Literal["fp32", "fp16", "bf16"]

ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Dimensions of a GPT-NeoX-shaped decoder."""

    L: int
    """Transformer layers."""
    h: int
    """Hidden size."""
    a: int
    """Attention heads."""
    V: int
    """Vocabulary size (padded)."""
    s: int
    """Sequence length."""
    x: int = 4
    """MLP expansion factor."""
    tied_embeddings: bool = False
    position: Position = "learned"
    dtype: DType = "fp32"
    preset: str | None = None
    """Name of the preset these dimensions came from, if any (informational)."""

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


# GPT-NeoX's configs as used in the seed paper (Section IV): s=2048, V=50304 (padded), untied
# embeddings. The paper's Eq. 1 counts learned positions (sh), so the presets do too.
_FULL: dict[str, tuple[int, int, int]] = {
    "19M": (6, 512, 8),
    "125M": (12, 768, 12),
    "350M": (24, 1024, 16),
    "760M": (24, 1536, 16),
    "1.3B": (24, 2048, 16),
    "2.7B": (32, 2560, 32),
    "6.7B": (32, 4096, 32),
    "13B": (40, 5120, 40),
    "20B": (44, 6144, 64),
}

# Reduced scale for CPU runs: the same layers, heads, expansion, untied embeddings and positions
# (so every collective's *count* per step and every divisibility constraint is the full model's),
# with head dimension 8 (h = 8a), V = 1024 and s = 128 (so every collective's *size* shrinks).
REDUCED_HEAD_DIM = 8
REDUCED_V = 1024
REDUCED_S = 128


def _presets() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for name, (L, h, a) in _FULL.items():
        out[name] = ModelSpec(L=L, h=h, a=a, V=50304, s=2048, dtype="fp16", preset=name)
        out[f"{name}-cpu"] = ModelSpec(
            L=L, h=REDUCED_HEAD_DIM * a, a=a, V=REDUCED_V, s=REDUCED_S, dtype="fp32", preset=f"{name}-cpu"
        )
    return out


PRESETS: dict[str, ModelSpec] = _presets()


def preset(name: str, **overrides: object) -> ModelSpec:
    """The preset ``name`` with some fields replaced (e.g. ``s=512``)."""
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


class Shard(enum.Enum):
    """How Megatron-style tensor parallelism splits a tensor over ``t`` ranks."""

    REPLICATED = "replicated"
    COLUMN = "column"  # output features split: weight rows and the bias
    ROW = "row"  # input features split: weight columns (its bias stays replicated)
    VOCAB = "vocab"  # vocabulary rows split (embedding, output layer)


Block = Literal["embedding", "layer", "final"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamTensor:
    """One parameter tensor of the model."""

    name: str
    shape: tuple[int, ...]
    shard: Shard
    block: Block
    layer: int | None = None
    expert: bool = False
    """Belongs to an MoE expert (reduced over the expert-data-parallel group)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def numel_per_tp_rank(self, t: int) -> int:
        if self.shard is Shard.REPLICATED or t == 1:
            return self.numel
        return self.numel // t


def stage_of_layer(layer: int, L: int, p: int) -> int:
    """Pipeline stage holding ``layer`` when L layers are split uniformly over p stages."""
    return layer // (L // p)


def forward_modules(m: ModelSpec) -> int:
    """How many modules of the built-in decoder (``commgate.run.workloads.gpt.GPT``) run a forward: the
    model, the embedding block with its word (and learned position) embedding, per layer the layer, two
    norms, attention with its two projections and the MLP with its two, the final norm and (untied) the
    output layer. Containers that never run (``nn.ModuleList``) are not counted. ZeRO-3's trace records
    each of them once in the forward and once in the backward."""
    return 3 + (m.position == "learned") + LAYER_MODULES * m.L + 1 + (not m.tied_embeddings)


LAYER_MODULES = 9
"""Modules of one decoder layer: the layer, two norms, attention with two projections, the MLP with two."""


@functools.cache
def inventory(m: ModelSpec, *, experts: int = 0, moe_every: int = 1) -> tuple[ParamTensor, ...]:
    """Every parameter tensor, in module order.

    With ``experts > 0`` every ``moe_every``-th layer (the last of each group, as DeepSpeed's
    examples do) replaces its MLP by a top-k gate and ``experts`` expert MLPs.
    """
    h, xh = m.h, m.x * m.h
    out: list[ParamTensor] = [
        ParamTensor(name="embed.word.weight", shape=(m.V, h), shard=Shard.VOCAB, block="embedding")
    ]
    if m.position == "learned":
        out.append(ParamTensor(name="embed.position.weight", shape=(m.s, h), shard=Shard.REPLICATED, block="embedding"))
    for i in range(m.L):
        p = f"layers.{i}."

        def t(name: str, shape: tuple[int, ...], shard: Shard, expert: bool = False, _p: str = p, _i: int = i) -> None:
            out.append(ParamTensor(name=_p + name, shape=shape, shard=shard, block="layer", layer=_i, expert=expert))

        t("input_norm.weight", (h,), Shard.REPLICATED)
        t("input_norm.bias", (h,), Shard.REPLICATED)
        t("attention.qkv.weight", (3 * h, h), Shard.COLUMN)
        t("attention.qkv.bias", (3 * h,), Shard.COLUMN)
        t("attention.dense.weight", (h, h), Shard.ROW)
        t("attention.dense.bias", (h,), Shard.REPLICATED)
        t("post_attention_norm.weight", (h,), Shard.REPLICATED)
        t("post_attention_norm.bias", (h,), Shard.REPLICATED)
        if experts and (i + 1) % moe_every == 0:
            t("moe.gate.weight", (experts, h), Shard.REPLICATED)
            for e in range(experts):
                t(f"moe.experts.{e}.fc_in.weight", (xh, h), Shard.REPLICATED, True)
                t(f"moe.experts.{e}.fc_in.bias", (xh,), Shard.REPLICATED, True)
                t(f"moe.experts.{e}.fc_out.weight", (h, xh), Shard.REPLICATED, True)
                t(f"moe.experts.{e}.fc_out.bias", (h,), Shard.REPLICATED, True)
        else:
            t("mlp.fc_in.weight", (xh, h), Shard.COLUMN)
            t("mlp.fc_in.bias", (xh,), Shard.COLUMN)
            t("mlp.fc_out.weight", (h, xh), Shard.ROW)
            t("mlp.fc_out.bias", (h,), Shard.REPLICATED)
    out.append(ParamTensor(name="final_norm.weight", shape=(h,), shard=Shard.REPLICATED, block="final"))
    out.append(ParamTensor(name="final_norm.bias", shape=(h,), shard=Shard.REPLICATED, block="final"))
    if not m.tied_embeddings:
        out.append(ParamTensor(name="head.weight", shape=(m.V, h), shard=Shard.VOCAB, block="final"))
    return tuple(out)


def param_count(m: ModelSpec, *, experts: int = 0, moe_every: int = 1) -> int:
    """Total parameters of the model as built (the inventory's sum)."""
    return sum(p.numel for p in inventory(m, experts=experts, moe_every=moe_every))


def param_stages(p: ParamTensor, *, L: int, pp: int, tied: bool) -> tuple[int, ...]:
    """Pipeline stages holding ``p``: embeddings on the first, final norm and output layer on the last,
    layers uniformly; a tied word embedding is on both ends (DeepSpeed's TiedLayerSpec)."""
    if p.block == "embedding":
        return (0, pp - 1) if (p.name == "embed.word.weight" and tied and pp > 1) else (0,)
    if p.block == "final":
        return (pp - 1,)
    assert p.layer is not None
    return (stage_of_layer(p.layer, L, pp),)


def stage_split(params: tuple[ParamTensor, ...], *, L: int, tp: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Per pipeline stage: (non-expert, expert) parameters of one tensor-parallel rank, in one pass."""
    tied = not any(p.name == "head.weight" for p in params)
    counts = [[0, 0] for _ in range(pp)]
    for p in params:
        for st in param_stages(p, L=L, pp=pp, tied=tied):
            counts[st][p.expert] += p.numel_per_tp_rank(tp)
    return tuple((d, e) for d, e in counts)
