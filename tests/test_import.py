"""``commgate import``: scenarios written from GPT-NeoX, DeepSpeed and Hugging Face configs validate,
predict, list what they ignore, and (``--cpu``) run and reconcile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from commgate.cli import main
from commgate.model.loader import load_file
from commgate.model.predict import predict

NEOX = Path(__file__).parent / "data" / "neox" / "13B.yml"
DS = Path(__file__).parent / "data" / "deepspeed" / "hf-zero2.json"


def test_gpt_neox_13b_at_full_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "13b.yaml"
    assert main(["import", "--neox", str(NEOX), "--dp", "1024", "-o", str(out)]) == 0
    (s,) = load_file(out)
    m, par = s.model, s.parallelism
    assert (m.L, m.h, m.a, m.s, m.V, m.position, m.tied_embeddings, m.dtype) == (
        40, 5120, 40, 2048, 50304, "rotary", False, "fp16"
    )  # fmt: skip
    assert (par.scheme, par.dp, par.micro_batch, par.activation_checkpointing) == ("zero1", 1024, 4, True)
    assert predict(s).comparison()
    err = capsys.readouterr().err
    assert "overlap_comm" not in err  # ZeRO-1 with overlap_comm on: modelled, kept
    assert s.deepspeed_config["zero_optimization"]["overlap_comm"] is True
    assert "init_method ignored" in err


def test_the_cpu_variant_runs_and_reconciles(tmp_path: Path) -> None:
    from commgate.judge.reconcile import reconcile
    from commgate.run.launcher import launch_local

    out = tmp_path / "13b-cpu.yaml"
    assert main(["import", "--neox", str(NEOX), "--dp", "2", "--cpu", "-o", str(out)]) == 0
    out.write_text(out.read_text() + "steps: 1\n")  # 40 layers: one measured step is enough here
    (s,) = load_file(out)
    assert (s.model.L, s.model.h, s.model.a, s.model.V, s.model.dtype) == (40, 320, 40, 1024, "fp32")
    assert reconcile(predict(s), launch_local(s, workdir=tmp_path)).ok


def test_hugging_face_and_deepspeed_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({
        "model_type": "gpt_neox", "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
        "intermediate_size": 2048, "vocab_size": 50304, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "rotary_pct": 0.25,
    }))  # fmt: skip
    out = tmp_path / "s.yaml"
    assert main(["import", "--hf", str(hf), "--deepspeed", str(DS), "--dp", "4", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["parallelism"]["scheme"] == "zero2" and doc["deepspeed"]["zero_optimization"]["overlap_comm"] is True
    (s,) = load_file(out)
    assert (s.model.h, s.model.ffn, s.parallelism.zero.bucket_elements) == (512, 2048, 200_000_000)
    err = capsys.readouterr().err
    assert "rotary_pct ignored" in err
    assert 'optimizer.params.eps, optimizer.params.weight_decay: "auto" is Hugging Face' in err
    assert "import with --trainer hf" in err
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    assert main(["import", "--hf", str(hf), "-o", str(out)]) == 2
    assert "num_attention_heads missing" in capsys.readouterr().err
    hf.write_text(json.dumps({"model_type": "bert", "hidden_size": 4096}))
    assert main(["import", "--hf", str(hf), "-o", str(out)]) == 2
    assert "model_type 'bert'" in capsys.readouterr().err


HF = Path(__file__).parent / "data" / "hf"


@pytest.mark.parametrize(
    ("config", "expected"),
    [  # published parameter counts: TinyLlama 1,100,048,384; Mistral 7B 7,241,732,096; Qwen2.5 0.5B 494,032,768
        ("tinyllama-1.1b.json", (22, 2048, 32, 4, 5632, 32000, False, "bf16", 1_100_048_384)),
        ("mistral-7b.json", (32, 4096, 32, 8, 14336, 32000, False, "bf16", 7_241_732_096)),
        ("qwen2.5-0.5b.json", (24, 896, 14, 2, 4864, 151936, True, "bf16", 494_032_768)),
    ],
)
def test_llama_family_hugging_face_configs(
    config: str, expected: tuple[object, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.yaml"
    assert main(["import", "--hf", str(HF / config), "--dp", "8", "-o", str(out)]) == 0
    (s,) = load_file(out)
    m = s.model
    count = predict(s).param_count
    assert (m.L, m.h, m.a, m.kv, m.ffn, m.V, m.tied_embeddings, m.dtype, count) == expected
    assert (m.architecture, m.position, s.parallelism.scheme) == ("llama", "rotary", "ddp")
    assert m.qkv_bias == config.startswith("qwen")
    assert "rope_theta ignored" in capsys.readouterr().err
    # the reduced variant keeps the layers, heads and key/value heads, the MLP's ratio to h, and splits over tp
    assert main(["import", "--hf", str(HF / config), "--tp", "2", "--cpu", "-o", str(out)]) == 0
    (small,) = load_file(out)
    r = small.model
    assert (r.L, r.a, r.kv, r.h, r.architecture) == (m.L, m.a, m.kv, 8 * m.a, "llama")
    assert r.ffn % 4 == 0 and abs(r.ffn / r.h - m.ffn / m.h) < 4 / r.h


def test_llama_with_biases_or_another_head_dimension_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = json.loads((HF / "tinyllama-1.1b.json").read_text())
    hf, out = tmp_path / "config.json", tmp_path / "s.yaml"
    for change, message in (({"attention_bias": True}, "attention_bias: true"), ({"head_dim": 128}, "head_dim 128")):
        hf.write_text(json.dumps(base | change))
        assert main(["import", "--hf", str(hf), "-o", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_value_that_is_not_a_number_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NeoX key outside its braces keeps its trailing comma ('2,'), a stage can be a word: one line each."""
    neox, ds, out = tmp_path / "n.yml", tmp_path / "ds.json", tmp_path / "s.yaml"
    neox.write_text("num-layers: 2,\nhidden-size: 64\n")
    assert main(["import", "--neox", str(neox), "-o", str(out)]) == 2
    assert "n.yml: num-layers: '2,' is not a whole number" in capsys.readouterr().err
    ds.write_text(json.dumps({"zero_optimization": {"stage": "x"}}))
    assert main(["import", "--hf", str(HF / "tinyllama-1.1b.json"), "--deepspeed", str(ds), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "deepspeed zero_optimization.stage: 'x' is not a whole number" in err and "Traceback" not in err
    assert not out.exists()


def test_nothing_imported_is_silent(tmp_path: Path) -> None:
    """What the configs set that the scenario does not take as such is in the written file (its ``notes``
    field), in the loaded scenario's remarks and in a run's findings; a DeepSpeed key the model does not
    follow is kept, and the scenario gates against its baseline only, saying why."""
    from commgate.pipeline import Options, run_scenario
    from test_pipeline import Stub, silent

    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({
        "model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 128, "rotary_pct": 0.25,
    }))  # fmt: skip
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}}))
    out = tmp_path / "s.yaml"
    assert main(["import", "--hf", str(hf), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)]) == 0
    text = out.read_text()
    doc = yaml.safe_load(text)
    assert doc["deepspeed"]["zero_optimization"]["stage3_use_all_reduce_for_fetch_params"] is True
    assert doc["expectations"] == {"model": {"check": False}}
    kept = next(n for n in doc["notes"] if "stage3_use_all_reduce_for_fetch_params" in n)
    assert "not modelled yet" in kept and "its notes" in text.splitlines()[0]
    assert any("rotary_pct ignored" in n for n in doc["notes"])
    (s,) = load_file(out)
    assert [f"imported: {n}" for n in doc["notes"]] == list(s.remarks[len(s.warnings) :])
    result = run_scenario(s, Stub(capture=silent(s)), Options(baseline_dir=tmp_path, gate=False))
    assert result is not None
    assert {f"imported: {n}" for n in doc["notes"]} <= {f.title for f in result.findings if f.kind == "config"}


def test_imports_of_one_config_into_several_files_do_not_collide(tmp_path: Path) -> None:
    """Each written scenario is named after its file (``--name`` overrides): three imports of one Hugging Face
    config.json at three data-parallel degrees validate together, with three names."""
    hf = HF / "tinyllama-1.1b.json"
    for dp in (8, 16, 32):
        assert main(["import", "--hf", str(hf), "--dp", str(dp), "-o", str(tmp_path / f"tinyllama-dp{dp}.yaml")]) == 0
    names = sorted(load_file(f)[0].id for f in tmp_path.glob("*.yaml"))
    assert names == ["tinyllama-dp16", "tinyllama-dp32", "tinyllama-dp8"]
    assert main(["validate", str(tmp_path)]) == 0
    assert main(["import", "--hf", str(hf), "--dp", "2", "--name", "mine", "-o", str(tmp_path / "x.yaml")]) == 0
    assert load_file(tmp_path / "x.yaml")[0].id == "mine"
