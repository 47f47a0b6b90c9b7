"""Presets and the parameter inventory (the model as built) against Eq. 1 and hand counts."""

import pytest
from commgate.model.paper import eq1_param_count, llama_param_count
from commgate.model.scenario import ModelSpec
from commgate.model.transformer import PRESETS, Shard, inventory, param_count, stage_split

# (L, h, a) from GPT-NeoX's configs, as the seed paper uses them.
NEOX = {
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


@pytest.mark.parametrize("name", NEOX)
def test_full_presets_match_gpt_neox(name: str) -> None:
    m = PRESETS[name]
    assert (m.L, m.h, m.a) == NEOX[name]
    assert (m.s, m.V, m.tied_embeddings, m.position) == (2048, 50304, False, "learned")


@pytest.mark.parametrize("name", NEOX)
def test_reduced_presets_keep_structure(name: str) -> None:
    full, small = PRESETS[name], PRESETS[f"{name}-cpu"]
    assert (small.L, small.a, small.x, small.tied_embeddings, small.position) == (
        full.L,
        full.a,
        full.x,
        full.tied_embeddings,
        full.position,
    )
    assert small.h < full.h and small.V < full.V and small.s < full.s
    assert small.h % small.a == 0 and small.dtype == "fp32"


@pytest.mark.parametrize("name", [n for n, m in PRESETS.items() if not m.llama])
def test_model_as_built_differs_from_eq1_by_biases_and_layernorms(name: str) -> None:
    m = PRESETS[name]
    eq1 = eq1_param_count(V=m.V, h=m.h, s=m.s, L=m.L)
    # per layer the model has (9+x)h of biases and LayerNorm parameters, Eq. 1 counts 8h
    assert param_count(m) - eq1 == m.L * (1 + m.x) * m.h


def test_13b_parameter_count() -> None:
    assert param_count(PRESETS["13B"]) == 13_111_183_360


def test_tiny_model_counted_by_hand() -> None:
    m = ModelSpec(L=1, h=4, a=2, V=10, s=3)
    # embed 40, positions 12, layer: LN 8 + qkv 48+12 + dense 16+4 + LN 8 + fc_in 64+16 + fc_out 64+4 = 244,
    # final LN 8, head 40
    assert param_count(m) == 40 + 12 + 244 + 8 + 40
    assert param_count(ModelSpec(L=1, h=4, a=2, V=10, s=3, tied_embeddings=True, position="rotary")) == 344 - 40 - 12


def test_tensor_parallel_shards_by_hand() -> None:
    m = ModelSpec(L=1, h=4, a=2, V=10, s=3)
    params = inventory(m)
    # t=2: embed 20, positions 12, LN 8, qkv 24+6, dense 8+4, LN 8, fc_in 32+8, fc_out 32+4, final 8, head 20
    ((dense, experts),) = stage_split(params, L=1, tp=2, pp=1)
    assert (dense, experts) == (20 + 12 + 8 + 30 + 12 + 8 + 40 + 36 + 8 + 20, 0)
    assert {p.shard for p in params} == set(Shard)


def test_pipeline_stages_hold_embeddings_first_and_head_last() -> None:
    m = ModelSpec(L=2, h=4, a=2, V=10, s=3)
    per_layer = 244
    split = stage_split(inventory(m), L=2, tp=1, pp=2)
    assert split == ((40 + 12 + per_layer, 0), (per_layer + 8 + 40, 0))
    tied = ModelSpec(L=2, h=4, a=2, V=10, s=3, tied_embeddings=True)
    # DeepSpeed's TiedLayerSpec keeps a copy of the word embedding on the last stage too
    assert stage_split(inventory(tied), L=2, tp=1, pp=2) == ((40 + 12 + per_layer, 0), (per_layer + 8 + 40, 0))


def test_moe_layers_replace_the_mlp() -> None:
    m = ModelSpec(L=2, h=4, a=2, V=10, s=3)
    dense_mlp = 64 + 16 + 64 + 4
    moe = inventory(m, experts=3, moe_every=2)
    assert sum(p.numel for p in moe if p.expert) == 3 * dense_mlp
    assert param_count(m, experts=3, moe_every=2) == param_count(m) - dense_mlp + 3 * 4 + 3 * dense_mlp
    assert all(p.layer == 1 for p in moe if p.expert)


# Published parameter counts of the Llama-family models the presets are taken from.
PUBLISHED = {
    "llama3.2-1B": 1_235_814_400,
    "tinyllama-1.1B": 1_100_048_384,
    "llama2-7B": 6_738_415_616,
    "llama3-8B": 8_030_261_248,
    "llama2-70B": 68_976_648_192,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_llama_presets_have_the_published_parameter_counts(name: str) -> None:
    m = PRESETS[name]
    assert param_count(m) == PUBLISHED[name]
    # the counterpart of Eq. 1 is exact for a Llama-style model (no biases to leave out)
    assert llama_param_count(
        V=m.V, h=m.h, L=m.L, a=m.a, kv_heads=m.kv, ffn=m.ffn, tied_embeddings=m.tied_embeddings
    ) == param_count(m)
    small = PRESETS[f"{name}-cpu"]
    assert (small.L, small.a, small.kv, small.architecture, small.tied_embeddings) == (
        m.L, m.a, m.kv, "llama", m.tied_embeddings
    )  # fmt: skip
    assert small.ffn * m.h == m.ffn * small.h  # the MLP keeps its ratio to h


def test_llama_counted_by_hand() -> None:
    m = ModelSpec(L=1, h=8, a=4, V=10, s=3, architecture="llama", position="rotary", kv_heads=2, ffn_hidden=12)
    # embed 80; layer: RMSNorm 8, q 64, k 32 (2 heads of 2), v 32, dense 64, RMSNorm 8, gate 96, up 96,
    # down 96; final RMSNorm 8; head 80
    assert param_count(m) == 80 + (8 + 64 + 32 + 32 + 64 + 8 + 3 * 96) + 8 + 80
    names = [p.name for p in inventory(m)]
    assert not any(n.endswith(".bias") for n in names)
    assert "layers.0.attention.k.weight" in names and "layers.0.mlp.gate.weight" in names
    # t=2: every projection halves (whole heads per rank), norms stay whole
    ((dense, _),) = stage_split(inventory(m), L=1, tp=2, pp=1)
    assert dense == 40 + (8 + 32 + 16 + 16 + 32 + 8 + 3 * 48) + 8 + 40


def test_a_parameter_pickled_in_another_process_hashes_as_one_made_here() -> None:
    """``ParamTensor`` and a model's ``Params`` keep their hash; one pickled by a process with another string
    hash seed must not carry that process's hash here (it would miss every cache keyed by the model's
    parameters)."""
    import os
    import pickle
    import subprocess
    import sys

    from commgate.model.transformer import Params

    code = (
        "import pickle, sys; from commgate.model.transformer import PRESETS, inventory; "
        "params = inventory(PRESETS['125M']); hash(params); sys.stdout.buffer.write(pickle.dumps(params))"
    )
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    out = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {"PYTHONHASHSEED": seed}, capture_output=True, check=True
    ).stdout
    theirs, ours = pickle.loads(out), inventory(PRESETS["125M"])
    assert isinstance(theirs, Params) and theirs == ours
    assert hash(theirs) == hash(ours) == hash(tuple(ours))
    assert [hash(p) for p in theirs] == [hash(p) for p in ours]
    assert set(theirs) == set(ours) and {theirs: 1}[ours] == 1
