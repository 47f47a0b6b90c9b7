"""The transformer being trained: its dimensions, presets, and the inventory of its parameter tensors.

The inventory is the single truth for parameter counts. It lists every tensor of the decoder with the
way Megatron-style tensor parallelism splits it and the pipeline stage that holds it, for two
architectures:

- ``gpt-neox`` (the default, the seed paper's): token embedding, optional learned positions,
  L x [LayerNorm, fused QKV, attention output, LayerNorm, MLP h->ffn->h with biases], final LayerNorm,
  untied output layer;
- ``llama``: token embedding, L x [RMSNorm, separate Q, K, V projections (grouped-query attention:
  ``kv_heads`` key/value heads), attention output, RMSNorm, SwiGLU MLP (gate, up h->ffn, down
  ffn->h)], final RMSNorm, output layer (untied unless tied); rotary positions, no biases but, with
  ``qkv_bias`` (Qwen2), those of the Q, K and V projections.

The paper's Eq. 1 (and its Llama counterpart) live in ``commgate.model.paper``; the difference between
Eq. 1 and the inventory is a named term (biases, LayerNorm counting).

Naming: ``L`` layers, ``h`` hidden, ``a`` heads, ``V`` vocabulary, ``s`` sequence, ``x`` MLP expansion,
as in the seed paper's Table I.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Literal

from commgate.model.scenario import ITEMSIZE, ModelSpec, Parallelism


def dtype_name(torch_dtype: object) -> str:
    """commgate's name for a torch dtype (the capture's, a buffer's): float32 is fp32, float16 fp16,
    bfloat16 bf16, any other its torch name (int64, bool, ...)."""
    name = str(torch_dtype).removeprefix("torch.")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(name, name)


WIRE_ITEMSIZE: dict[str, Fraction] = {  # bytes per element of every dtype a collective carries
    **{k: Fraction(v) for k, v in ITEMSIZE.items()},
    "float64": Fraction(8),
    "int64": Fraction(8),
    "int32": Fraction(4),
    "int16": Fraction(2),
    "int8": Fraction(1),
    "bool": Fraction(1),
    "uint8": Fraction(1),
    "none": Fraction(0),
    "int4": Fraction(1, 2),
}


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


# Llama-family shapes, from the models' published Hugging Face config.json files: (L, h, a, kv_heads,
# ffn_hidden, V, s, tied). Trained in bf16 with rotary positions and no biases.
_LLAMA: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "llama3.2-1B": (16, 2048, 32, 8, 8192, 128256, 8192, True),
    "tinyllama-1.1B": (22, 2048, 32, 4, 5632, 32000, 2048, False),
    "llama2-7B": (32, 4096, 32, 32, 11008, 32000, 4096, False),
    "llama3-8B": (32, 4096, 32, 8, 14336, 128256, 8192, False),
    "llama2-70B": (80, 8192, 64, 8, 28672, 32000, 4096, False),
    "llama3-70B": (80, 8192, 64, 8, 28672, 128256, 8192, False),
    "llama3-405B": (126, 16384, 128, 8, 53248, 128256, 8192, False),
}

# Qwen2.5 shapes, from the models' published config.json files (Llama-style with biases on the Q, K and V
# projections): (L, h, a, kv_heads, ffn_hidden, V, s, tied); s is the 4096 tokens of a typical run (the
# models' context is 32768).
_QWEN: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "qwen2.5-0.5B": (24, 896, 14, 2, 4864, 151936, 4096, True),
    "qwen2.5-7B": (28, 3584, 28, 4, 18944, 152064, 4096, False),
    "qwen2.5-72B": (80, 8192, 64, 8, 29568, 152064, 4096, False),
}


def _presets() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for name, (L, h, a) in _FULL.items():
        out[name] = ModelSpec(L=L, h=h, a=a, V=50304, s=2048, dtype="fp16", preset=name)
        out[f"{name}-cpu"] = ModelSpec(
            L=L, h=REDUCED_HEAD_DIM * a, a=a, V=REDUCED_V, s=REDUCED_S, dtype="fp32", preset=f"{name}-cpu"
        )
    for name, (L, h, a, kv, ffn, V, s, tied) in (*_LLAMA.items(), *_QWEN.items()):
        llama = ModelSpec(
            L=L, h=h, a=a, kv_heads=kv, ffn_hidden=ffn, V=V, s=s, tied_embeddings=tied, architecture="llama",
            position="rotary", dtype="bf16", preset=name, qkv_bias=name in _QWEN,
        )  # fmt: skip
        out[name] = llama
        # the MLP keeps its ratio to h (the head dimension shrinks to 8, so ffn by the same factor)
        out[f"{name}-cpu"] = replace(
            llama, h=REDUCED_HEAD_DIM * a, ffn_hidden=ffn * REDUCED_HEAD_DIM // (h // a), V=REDUCED_V,
            s=REDUCED_S, dtype="fp32", preset=f"{name}-cpu",
        )  # fmt: skip
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
    frozen: bool = False
    """``requires_grad`` off (a user's module): broadcast, partitioned and gathered as any parameter, never
    reduced, and left out of the optimizer."""

    numel: int = field(init=False, repr=False, compare=False)
    """Elements (the shape's product, computed once)."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))
        fields = (self.name, self.shape, self.shard.value, self.block, self.layer, self.expert, self.frozen)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        """Computed once: a model's parameter tuple keys the ZeRO-3 replay's caches, and each lookup hashes
        every parameter (the generated hash would hash the ``Shard`` enum in Python each time)."""
        return self._hash

    def __setstate__(self, state: list[object]) -> None:
        """Unpickled: the fields set, the hash computed again (a string's hash differs between processes)."""
        for f, value in zip(fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def numel_per_tp_rank(self, t: int) -> int:
        if self.shard is Shard.REPLICATED or t == 1:
            return self.numel
        return self.numel // t


class Params(tuple[ParamTensor, ...]):
    """A model's parameters, in module order: a tuple that hashes once. It keys the ZeRO-3 replay's caches,
    looked up dozens of times a predict, and hashing 485 parameters costs about 27 µs each time."""

    def __hash__(self) -> int:
        cached: int | None = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached

    def __reduce__(self) -> tuple[type[Params], tuple[tuple[ParamTensor, ...]]]:
        """Pickled as its parameters alone: a string's hash differs between processes."""
        return Params, (tuple(self),)


def stage_of_layer(layer: int, L: int, p: int) -> int:
    """Pipeline stage holding ``layer`` when L layers are split uniformly over p stages."""
    return layer // (L // p)


@functools.cache
def inventory(m: ModelSpec, *, experts: int = 0, moe_every: int = 1) -> tuple[ParamTensor, ...]:
    """Every parameter tensor, in module order.

    With ``experts > 0`` every ``moe_every``-th layer (the last of each group, as DeepSpeed's
    examples do) replaces its MLP by a top-k gate and ``experts`` expert MLPs.
    """
    h, ffn, bias = m.h, m.ffn, not m.llama
    kv = m.kv * (m.h // m.a)  # key/value width (grouped-query attention)
    out: list[ParamTensor] = [
        ParamTensor(name="embed.word.weight", shape=(m.V, h), shard=Shard.VOCAB, block="embedding")
    ]
    if m.position == "learned":
        out.append(ParamTensor(name="embed.position.weight", shape=(m.s, h), shard=Shard.REPLICATED, block="embedding"))

    def linear(
        t: Callable[..., None],
        name: str,
        n_out: int,
        n_in: int,
        shard: Shard,
        expert: bool = False,
        *,
        biased: bool = bias,
    ) -> None:
        shard = Shard.REPLICATED if expert else shard  # an expert is whole on the ranks that hold it
        t(f"{name}.weight", (n_out, n_in), shard, expert)
        if biased:  # a row-parallel layer's bias stays whole on each tensor-parallel rank
            t(f"{name}.bias", (n_out,), Shard.REPLICATED if shard is Shard.ROW else shard, expert)

    def mlp(t: Callable[..., None], prefix: str, expert: bool = False) -> None:
        if m.llama:
            linear(t, prefix + "gate", ffn, h, Shard.COLUMN, expert)
            linear(t, prefix + "up", ffn, h, Shard.COLUMN, expert)
            linear(t, prefix + "down", h, ffn, Shard.ROW, expert)
        else:
            linear(t, prefix + "fc_in", ffn, h, Shard.COLUMN, expert)
            linear(t, prefix + "fc_out", h, ffn, Shard.ROW, expert)

    def norm(t: Callable[..., None], name: str) -> None:
        t(f"{name}.weight", (h,), Shard.REPLICATED)
        if bias:  # LayerNorm; Llama's RMSNorm has a weight only
            t(f"{name}.bias", (h,), Shard.REPLICATED)

    for i in range(m.L):
        p = f"layers.{i}."

        def t(name: str, shape: tuple[int, ...], shard: Shard, expert: bool = False, _p: str = p, _i: int = i) -> None:
            out.append(ParamTensor(name=_p + name, shape=shape, shard=shard, block="layer", layer=_i, expert=expert))

        norm(t, "input_norm")
        if m.llama:
            linear(t, "attention.q", h, h, Shard.COLUMN, biased=m.qkv_bias)
            linear(t, "attention.k", kv, h, Shard.COLUMN, biased=m.qkv_bias)
            linear(t, "attention.v", kv, h, Shard.COLUMN, biased=m.qkv_bias)
        else:
            linear(t, "attention.qkv", 3 * h, h, Shard.COLUMN)
        linear(t, "attention.dense", h, h, Shard.ROW)
        norm(t, "post_attention_norm")
        if experts and (i + 1) % moe_every == 0:
            t("moe.gate.weight", (experts, h), Shard.REPLICATED)
            for e in range(experts):
                mlp(t, f"moe.experts.{e}.", True)
        else:
            mlp(t, "mlp.")

    def final(name: str, shape: tuple[int, ...], shard: Shard, _expert: bool = False) -> None:
        out.append(ParamTensor(name=name, shape=shape, shard=shard, block="final"))

    norm(final, "final_norm")
    if not m.tied_embeddings:
        out.append(ParamTensor(name="head.weight", shape=(m.V, h), shard=Shard.VOCAB, block="final"))
    return Params(out)


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


def layer_flops(m: ModelSpec, b: int) -> float:
    """Forward FLOPs of one transformer layer on a micro-batch (Megatron-LM's count: 24bsh^2 + 4bs^2h)."""
    return 24 * b * m.s * m.h**2 + 4 * b * m.s**2 * m.h


def logit_flops(m: ModelSpec, b: int) -> float:
    return 2 * b * m.s * m.h * m.V


def step_flops(m: ModelSpec, par: Parallelism) -> float:
    """Training FLOPs per step on one rank of the busiest pipeline stage: forward x 3 (x 4 with activation
    checkpointing, which re-runs the forward), divided over the TP group and the context-parallel group (each
    rank computes s/cp of the tokens; torch's load balancing evens out the causal attention)."""
    layers = -(-m.L // par.pp)  # the fullest stage
    fwd = layers * layer_flops(m, par.micro_batch)
    if par.pp == 1 or m.L % par.pp == 0:
        fwd += logit_flops(m, par.micro_batch)  # the last stage computes the logits as well
    passes = 4 if par.activation_checkpointing else 3
    return passes * fwd * par.micro_batches / (par.tp * par.cp)
