"""The model presets as the published models are: Llama 3 (8B, 70B, 405B) and Qwen2.5 (0.5B, 7B, 72B) at
their parameter counts, Qwen2's biases on the Q, K and V projections in the inventory, and a Qwen-style
model (``architecture: llama, qkv_bias: true``) reconciled on real runs where the biases are sharded
(tensor parallelism), partitioned (ZeRO-3) and sharded by FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.transformer import PRESETS, Shard, inventory, param_count


@pytest.mark.parametrize(
    ("name", "count"),
    [
        # the parameters of the Hugging Face checkpoints (their safetensors' total)
        ("llama3-8B", 8_030_261_248),
        ("llama3-70B", 70_553_706_496),
        ("llama3-405B", 405_853_388_800),
        ("qwen2.5-0.5B", 494_032_768),
        ("qwen2.5-7B", 7_615_616_512),
        ("qwen2.5-72B", 72_706_203_648),
    ],
)
def test_presets_have_the_published_parameter_counts(name: str, count: int) -> None:
    assert param_count(PRESETS[name]) == count


def test_qwen_layers_carry_q_k_v_biases_sharded_with_their_heads() -> None:
    m = PRESETS["qwen2.5-0.5B-cpu"]
    biases = {p.name.rsplit(".", 2)[-2]: p for p in inventory(m) if p.layer == 0 and p.name.endswith(".bias")}
    assert sorted(biases) == ["k", "q", "v"]
    assert all(p.shard is Shard.COLUMN for p in biases.values())
    assert biases["k"].numel == m.kv * (m.h // m.a)
    assert not any(p.name.endswith(".bias") for p in inventory(PRESETS["llama3-8B-cpu"]))


def test_qkv_bias_needs_the_llama_layout() -> None:
    doc = "schema_version: 1\nname: q\nmodel: {preset: 19M-cpu, qkv_bias: true}\nparallelism: {scheme: ddp, dp: 2}\n"
    with pytest.raises(ScenarioError, match="qkv_bias: true: Q, K and V biases are Qwen2's Llama-style layout"):
        load_text(doc)


QWEN = (
    "schema_version: 1\nname: qwen-{name}\n"
    "model: {{architecture: llama, qkv_bias: true, L: 2, h: 32, a: 4, kv_heads: 2, ffn_hidden: 88, V: 128, s: 32}}\n"
    "parallelism: {{scheme: {scheme}, {par}}}\nsteps: 2\n"
)


@pytest.mark.parametrize(
    ("scheme", "par"),
    [("tp", "dp: 1, tp: 2"), ("zero3", "dp: 2"), ("fsdp", "dp: 2")],
)
def test_a_qwen_style_model_reconciles_on_real_runs(scheme: str, par: str, tmp_path: Path) -> None:
    from commgate.run.launcher import launch_local

    (s,) = load_text(QWEN.format(name=scheme, scheme=scheme, par=par))
    prediction = predict(s)
    assert all(c.unexplained_bytes == 0 for c in prediction.comparison())
    rec = reconcile(prediction, launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
