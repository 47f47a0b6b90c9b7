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


def test_hugging_faces_zero3_config_is_modelled_and_a_real_run_reconciles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hugging Face's own ZeRO-3 JSON under commgate's workload: its ``"auto"`` prefetch and persistence keys
    run at DeepSpeed's defaults, which the model replays; the import wrote a baseline-only scenario saying they
    were "not modelled" and "left to DeepSpeed's defaults" at once (found by an adversarial pass)."""
    from commgate.judge.reconcile import reconcile
    from commgate.run.launcher import launch_local

    out = tmp_path / "z3.yaml"
    argv = ["import", "--hf", str(HF / "tiny-llama.config.json"), "--deepspeed", str(HF / "ds_config_zero3.json")]
    assert main([*argv, "--dp", "2", "--cpu", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "not modelled" not in err and "baseline only" not in err, err
    doc = yaml.safe_load(out.read_text())
    assert "expectations" not in doc and doc["deepspeed"]["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    (s,) = load_file(out)
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert rec.ok and all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops


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
    out = tmp_path / "refused.yaml"
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
    out = tmp_path / "s-cpu.yaml"
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
    assert "ds.json: zero_optimization.stage: 'x' is not a whole number" in err and "Traceback" not in err
    assert not out.exists()


def test_import_says_the_warnings_validate_would(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSpeed key DeepSpeed does not know, or a parameter offload at ZeRO-2, was written into the scenario
    without a word from ``import`` (``validate`` warned of them later; found by an adversarial pass)."""
    ds, out = tmp_path / "ds.json", tmp_path / "s.yaml"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}, "not_a_key": 3}))
    assert (
        main(["import", "--hf", str(HF / "tinyllama-1.1b.json"), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)])
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: deepspeed.not_a_key: DeepSpeed has no such key (it would be ignored)" in err
    assert "warning: deepspeed.zero_optimization.offload_param: parameter offload is ZeRO-3's" in err


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


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``commgate import argv`` fails with (exit status 2, nothing written)."""
    assert main(["import", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("commgate: error: "), err
    return err.removeprefix("commgate: error: ").rstrip("\n")


NEOX_SMALL = "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nseq-length: 128\n"


def test_a_zero_stage_deepspeed_has_not_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 5 in the DeepSpeed JSON, 7 in the NeoX config, a number past a float's 53 bits: one line naming the
    file that states it, the key, the value as written, and the stages there are."""
    neox, ds, out = tmp_path / "base.yml", tmp_path / "d.json", tmp_path / "x.yaml"
    neox.write_text(NEOX_SMALL)
    ds.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    assert refused(["--neox", str(neox), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)], capsys) == (
        f"{ds}: zero_optimization.stage: 5 is not a ZeRO stage: give 0, 1, 2 or 3"
    )
    for stage in ("7", "99999999999999999999999"):
        neox.write_text(NEOX_SMALL + f"zero_optimization: {{stage: {stage}}}\n")
        assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
            f"{neox}: zero_optimization.stage: {stage} is not a ZeRO stage: give 0, 1, 2 or 3"
        )
    ds.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}}))  # the stage is the NeoX config's
    assert refused(["--neox", str(neox), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)], capsys).startswith(
        f"{neox}: zero_optimization.stage: 99999999999999999999999 is not"
    )
    assert not out.exists()


def test_neox_parallel_degrees_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A negative degree is refused; pipe-parallel-size 0 (GPT-NeoX's model without its pipeline wrapper) is
    pp 1, saying so."""
    neox, out = tmp_path / "n.yml", tmp_path / "x.yaml"
    neox.write_text(NEOX_SMALL + "pipe-parallel-size: 0\nmodel-parallel-size: -2\n")
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox}: model-parallel-size: -2 is not 1 or more: give 1 (no tensor parallelism) or more"
    )
    neox.write_text(NEOX_SMALL + "pipe-parallel-size: -1\n")
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox}: pipe-parallel-size: -1 is not 0 or more: give 0 (no pipeline) or the stage count"
    )
    neox.write_text(NEOX_SMALL.replace("num-layers: 2", "num-layers: 0"))
    assert (
        refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == f"{neox}: num-layers: 0 is not 1 or more"
    )
    neox.write_text(NEOX_SMALL + "pipe-parallel-size: 0\n")
    assert main(["import", "--neox", str(neox), "--dp", "2", "-o", str(out)]) == 0
    note = f"{neox}: pipe-parallel-size 0 (GPT-NeoX's model without its pipeline wrapper): pp 1"
    assert f"note: {note}" in capsys.readouterr().err
    doc = yaml.safe_load(out.read_text())
    assert doc["parallelism"]["pp"] == 1 and note in doc["notes"]


def test_a_key_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON and YAML keep the last of a key given twice, silently: a DeepSpeed JSON, a NeoX config (YAML or
    JSON) and a config.json with one are refused, naming the key (its place) and both values or lines."""
    neox, ds, hf, out = tmp_path / "n.yml", tmp_path / "d.json", tmp_path / "config.json", tmp_path / "x.yaml"
    neox.write_text(NEOX_SMALL)
    ds.write_text('{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}')
    assert refused(["--neox", str(neox), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)], capsys) == (
        f'{ds}: zero_optimization: given twice ({{"stage": 2}}, then {{"stage": 3}}); JSON keeps only the last '
        "silently: give it once"
    )
    ds.write_text('{"zero_optimization": {"stage": 2, "overlap_comm": true, "stage": 3}}')
    assert refused(["--neox", str(neox), "--deepspeed", str(ds), "--dp", "2", "-o", str(out)], capsys) == (
        f"{ds}: zero_optimization.stage: given twice (2, then 3); JSON keeps only the last silently: give it once"
    )
    neox.write_text("num-layers: 2\nhidden-size: 64\nnum-layers: 4\nnum-attention-heads: 4\nseq-length: 128\n")
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox}:3: num-layers: duplicate key 'num-layers' (first on line 1); YAML would keep only the last: "
        "give it once"
    )
    neox_json = tmp_path / "n.json"
    neox_json.write_text(
        '{"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 128, "num-layers": 4}'
    )
    assert refused(["--neox", str(neox_json), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox_json}: num-layers: given twice (2, then 4); JSON keeps only the last silently: give it once"
    )
    text = (HF / "tinyllama-1.1b.json").read_text()
    hf.write_text(text.replace('"hidden_size": 2048,', '"hidden_size": 2048, "hidden_size": 1024,'))
    assert refused(["--hf", str(hf), "--dp", "2", "-o", str(out)], capsys) == (
        f"{hf}: hidden_size: given twice (2048, then 1024); JSON keeps only the last silently: give it once"
    )
    assert not out.exists()


def test_hugging_face_values_of_another_type_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A string where transformers holds a boolean or a number ("false" is true in Python), a size of 0: one
    line each, naming the key and the value as the file writes it."""
    base = json.loads((HF / "tinyllama-1.1b.json").read_text())
    hf, out = tmp_path / "config.json", tmp_path / "x.yaml"
    for change, message in (
        (
            {"tie_word_embeddings": "false"},
            'tie_word_embeddings: "false" is not a boolean: give true or false (no quotes)',
        ),
        ({"attention_bias": "false"}, 'attention_bias: "false" is not a boolean: give true or false (no quotes)'),
        ({"hidden_size": "64"}, 'hidden_size: "64" is not a whole number of 1 or more: give one (no quotes)'),
        ({"num_hidden_layers": 0}, "num_hidden_layers: 0 is not a whole number of 1 or more: give one (no quotes)"),
        (
            {"intermediate_size": 5632.5},
            "intermediate_size: 5632.5 is not a whole number of 1 or more: give one (no quotes)",
        ),
        ({"head_dim": "x"}, 'head_dim: "x" is not a whole number of 1 or more: give one (no quotes)'),
        ({"torch_dtype": 16}, "torch_dtype: 16 is not a dtype's name: give one, such as bfloat16"),
    ):
        hf.write_text(json.dumps(base | change))
        assert refused(["--hf", str(hf), "--dp", "2", "-o", str(out)], capsys) == f"{hf}: {message}"
    hf.write_text(json.dumps(base | {"max_position_embeddings": "x"}))
    assert refused(["--trainer", "hf", "--hf", str(hf), "--dp", "2", "-o", str(out)], capsys) == (
        f'{hf}: max_position_embeddings: "x" is not a whole number of 1 or more: give one'
    )
    assert not out.exists()


def test_hugging_face_dtypes_and_defaults_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dtype commgate does not model is named; transformers 5's ``dtype`` is read (before ``torch_dtype``,
    as transformers does); a key left out is what transformers builds (LlamaConfig's intermediate_size 11008,
    MistralConfig's num_key_value_heads 8), each one said."""
    base = json.loads((HF / "tinyllama-1.1b.json").read_text())
    hf = tmp_path / "config.json"

    def imported(cfg: dict[str, object]) -> tuple[dict[str, object], list[str]]:
        out = tmp_path / f"x{len(list(tmp_path.glob('x*.yaml')))}.yaml"
        hf.write_text(json.dumps(cfg))
        assert main(["import", "--hf", str(hf), "--dp", "2", "-o", str(out)]) == 0
        capsys.readouterr()
        doc = yaml.safe_load(out.read_text())
        return doc["model"], doc["notes"]

    model, notes = imported(base | {"torch_dtype": "float8"})
    assert "dtype" not in model
    assert (
        f"{hf}: torch_dtype 'float8' is not modelled (commgate models float32, float16, bfloat16): dtype fp32 "
        "unless a DeepSpeed fp16/bf16 block sets one"
    ) in notes
    model, notes = imported(base | {"dtype": "float16"})
    assert (
        model["dtype"] == "fp16" and f"{hf}: dtype fp16 from dtype (a DeepSpeed fp16/bf16 block overrides it)" in notes
    )
    model, notes = imported({k: v for k, v in base.items() if k != "intermediate_size"})
    assert model["ffn_hidden"] == 11008
    assert f"{hf}: intermediate_size absent: 11008, transformers' default for llama; state it if yours differs" in notes
    model, notes = imported({k: v for k, v in base.items() if k != "num_key_value_heads"})
    assert model["kv_heads"] == 32 and not any("num_key_value_heads" in n for n in notes)  # None: as many as heads
    mistral = json.loads((HF / "mistral-7b.json").read_text())
    model, notes = imported({k: v for k, v in mistral.items() if k != "num_key_value_heads"})
    assert model["kv_heads"] == 8
    assert f"{hf}: num_key_value_heads absent: 8, transformers' default for mistral; state it if yours differs" in notes


def test_what_is_missing_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NeoX config without its dimensions names them (not "give --neox", which was given); a DeepSpeed
    config alone says it has none; no input at all lists every input, --torchtitan too."""
    neox, ds, out = tmp_path / "n.yml", tmp_path / "d.json", tmp_path / "x.yaml"
    neox.write_text("hidden-size: 64\nnum-attention-heads: 4\n")
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox}: num-layers, seq-length missing: a GPT-NeoX config states num-layers, hidden-size, "
        "num-attention-heads, seq-length (or give --hf, a config.json, for the model)"
    )
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert refused(["--deepspeed", str(ds), "--dp", "2", "-o", str(out)], capsys) == (
        f"{ds}: a DeepSpeed config has no model dimensions: give --neox or --hf too"
    )
    assert refused(["-o", str(out)], capsys) == (
        "commgate import needs at least one of --neox, --deepspeed, --hf (or --torchtitan alone)"
    )
    # with --hf, the config.json has the model: the NeoX config gives the parallelism
    neox.write_text("model-parallel-size: 2\n")
    assert (
        main(["import", "--neox", str(neox), "--hf", str(HF / "tinyllama-1.1b.json"), "--dp", "2", "-o", str(out)]) == 0
    )
    assert yaml.safe_load(out.read_text())["parallelism"]["tp"] == 2


@pytest.mark.parametrize(
    ("precision", "block", "dtype"),
    [("fp16", "fp16", "fp16"), ("bfloat16", "bf16", "bf16"), ("fp32", None, "fp32")],
)
def test_neox_precision_enables_the_deepspeed_block_it_implies(
    precision: str, block: str | None, dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-NeoX's ``precision: fp16`` with no fp16 block runs fp16 (``NeoXArgs.calculate_derived`` enables
    the block); the importer listed the key as used and wrote fp32 (found by an adversarial pass)."""
    neox, out = tmp_path / "n.yml", tmp_path / f"{precision}.yaml"
    neox.write_text(NEOX_SMALL + f"precision: {precision}\n")
    assert main(["import", "--neox", str(neox), "--dp", "2", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["model"].get("dtype", "fp32") == dtype
    assert (block is None) == (block not in doc.get("deepspeed", {}))
    said = f"{neox}: precision {precision}: DeepSpeed's {block} block enabled, as GPT-NeoX derives it"
    assert (said in capsys.readouterr().err) == (block is not None)
    neox.write_text(NEOX_SMALL + "precision: float8\n")
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(tmp_path / "x.yaml")], capsys) == (
        f"{neox}: precision: 'float8' is not one of GPT-NeoX's: fp32, fp16, bfloat16"
    )


def test_an_alias_bomb_in_a_config_is_refused_not_expanded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPT-NeoX YAML of nine anchors of nine aliases each ran for minutes at 100% CPU in the importer's
    duplicate-key check (found by an adversarial pass); scenario files were bounded, the importer was not."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    neox = tmp_path / "bomb.yml"
    neox.write_text("\n".join(lines) + "\n" + NEOX_SMALL)
    out = tmp_path / "x.yaml"
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys) == (
        f"{neox}:1: $: the document expands to more than 100,000 YAML nodes (aliases expanded); not a config"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (NEOX_SMALL.replace("num-layers: 2", "num-layers: 2.5"), "num-layers: 2.5 is not a whole number"),
        (NEOX_SMALL + "no-weight-tying: 'false'\n", "no-weight-tying: 'false' is not a boolean; write true or false"),
        (NEOX_SMALL + "num_layers: 4\n", "num-layers and num_layers: one key to GPT-NeoX, given twice: give it once"),
        (NEOX_SMALL + "num-kv-heads: 2\n", "num-kv-heads: 2 (grouped-query attention) changes the parameter count"),
    ],
    ids=["float", "string-bool", "two-spellings", "kv-heads"],
)
def test_a_neox_value_the_importer_cannot_follow_is_refused_not_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    """``num-layers: 40.5`` was written as L 40, ``no-weight-tying: "false"`` as untied (the opposite), both
    spellings of a key kept the last, ``num-kv-heads`` was "ignored (no communication effect)" though it
    changes the parameter count (found by an adversarial pass)."""
    neox, out = tmp_path / "n.yml", tmp_path / "x.yaml"
    neox.write_text(text)
    assert refused(["--neox", str(neox), "--dp", "2", "-o", str(out)], capsys).startswith(f"{neox}: {says}")
    assert not out.exists()


def test_neox_pads_its_vocabulary_by_the_model_parallel_size_and_a_second_config_may_not_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-NeoX pads the tokenizer's vocabulary to make-vocab-size-divisible-by x model-parallel-size
    (``_vocab_size_with_padding``): V was 50304 whatever the degree; a Hugging Face config.json given with the
    NeoX one replaced its dimensions without a word (found by an adversarial pass)."""
    neox, out = tmp_path / "n.yml", tmp_path / "x.yaml"
    for extra, v in [("", 50304), ("model-parallel-size: 2\n", 50432), ("tokenizer-type: CharLevelTokenizer\n", 512)]:
        neox.write_text(NEOX_SMALL + extra + "padded-vocab-size: 1000\n")
        assert main(["import", "--neox", str(neox), "--dp", "2", "-o", str(out), "--force"]) == 0
        err = capsys.readouterr().err
        assert yaml.safe_load(out.read_text())["model"]["V"] == v
        assert f"padded-vocab-size not read: GPT-NeoX derives it from the tokenizer (V = {v})" in err
    hf = HF / "tinyllama-1.1b.json"
    assert refused(["--neox", str(neox), "--hf", str(hf), "--dp", "2", "-o", str(tmp_path / "y.yaml")], capsys) == (
        f"{neox} and {hf} describe different models (L 2 vs 22, h 64 vs 2048, a 4 vs 32); give the config of the "
        "model you train (--neox or --hf), not both"
    )


def test_a_neox_pipeline_with_zero1_is_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-NeoX's usual setup, pipe-parallel-size 2 with ZeRO stage 1, was refused: "stage: 1 contradicts
    scheme 'pp' (ZeRO stage 0)" (found by an adversarial pass): DeepSpeed's pipeline engine runs ZeRO-1."""
    from commgate.model.loader import load_file

    neox, out = tmp_path / "n.yml", tmp_path / "x.yaml"
    neox.write_text(NEOX_SMALL + "pipe-parallel-size: 2\nzero_optimization: {stage: 1}\n")
    assert main(["import", "--neox", str(neox), "--dp", "2", "-o", str(out)]) == 0, capsys.readouterr().err
    (s,) = load_file(out)
    assert (s.parallelism.scheme, s.parallelism.pp, s.parallelism.zero.stage) == ("pp", 2, 1)


@pytest.mark.parametrize(
    ("extra", "flags", "message"),
    [
        (
            "pipe-parallel-size: 0\nmodel-parallel-size: 2\nzero_optimization: {stage: 1}\n",
            [],
            "zero_optimization.stage: 1 with tensor parallelism of 2 and no pipeline is not modelled (commgate "
            "models ZeRO beside tensor parallelism only in DeepSpeed's pipeline engine, ZeRO-1 with 2 stages or "
            "more); give stage 0, or a pipeline (GPT-NeoX's pipe-parallel-size, or --pp) with stage 0 or 1",
        ),
        (
            "pipe-parallel-size: 1\nzero_optimization: {stage: 2}\n",
            ["--tp", "4"],
            "stage: 2 with tensor parallelism of 4",
        ),
        (
            "pipe-parallel-size: 2\nzero_optimization: {stage: 2}\n",
            [],
            "zero_optimization.stage: 2 with a pipeline of 2 stages: DeepSpeed's pipeline engine runs ZeRO stage 0 "
            "or 1 only (it refuses 2 and 3 as it starts); give stage 0 or 1",
        ),
    ],
    ids=["tp-zero1-no-pipeline", "tp-flag-zero2", "pipeline-zero2"],
)
def test_a_zero_stage_the_parallelism_cannot_run_is_one_line_that_does_not_go_round(
    extra: str, flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-NeoX with model parallelism and ZeRO-1 but no pipeline was refused with "use scheme zero1", which has
    no TP, and a pipeline with ZeRO-2 with "set parallelism.zero.stage: 2", which the pipeline refuses (found by
    an adversarial pass): one line naming the key and a change that imports."""
    neox, out = tmp_path / "n.yml", tmp_path / "x.yaml"
    neox.write_text(NEOX_SMALL + extra)
    got = refused(["--neox", str(neox), "--dp", "2", *flags, "-o", str(out)], capsys)
    assert got.startswith(f"{neox}: ") and message in got and "use scheme" not in got, got
    assert not out.exists()
    neox.write_text(NEOX_SMALL + extra.replace("stage: 2", "stage: 0").replace("stage: 1", "stage: 0"))
    assert main(["import", "--neox", str(neox), "--dp", "2", *flags, "-o", str(out)]) == 0, capsys.readouterr().err


def test_a_pipeline_scenario_with_zero2_is_told_the_stages_the_engine_runs() -> None:
    from commgate.core.errors import ScenarioError
    from commgate.model.loader import load_text

    text = "schema_version: 1\nname: x\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: pp, pp: 2, dp: 1}\n"
    with pytest.raises(ScenarioError) as info:
        load_text(text + "deepspeed: {zero_optimization: {stage: 3}}\n")
    assert "3 contradicts scheme 'pp' (ZeRO stage 0); DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only" in str(
        info.value
    ) and "set parallelism.zero.stage" not in str(info.value)
