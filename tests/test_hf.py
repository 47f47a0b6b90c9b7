"""Trainer ``hf``: a Hugging Face ``transformers.Trainer`` job under the gate, as its user runs it.

* the ``"auto"`` values of Hugging Face's own DeepSpeed test configs, resolved for real model configs, against
  the table of what Trainer makes of each (``docs/trainers.md``);
* what a scenario cannot say, one line each;
* one test per CPU workaround (``commgate.run.trainers.hf``, W1-W7; W5's patch in ``tests/test_hf_fsdp.py``),
  each failing when upstream changes so that it is no longer needed or no longer works;
* real runs on 2 CPU gloo ranks (DDP, "auto" ZeRO-2 and ZeRO-3, gradient accumulation 2): every call key
  matched, no byte unexplained, the resolved values shown, the job checked against the scenario after the
  run; and a planted substitution (``ACCELERATE_USE_CPU=true``, which drops DeepSpeed) caught, its cause named.

Skipped, with the reason, where transformers or accelerate cannot be imported (``pip install 'commgate[hf]'``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("transformers", reason="trainer hf needs transformers: pip install 'commgate[hf]'")
pytest.importorskip("accelerate", reason="trainer hf needs accelerate: pip install 'commgate[hf]'")

from commgate.core.errors import CommgateError, ScenarioError
from commgate.model.loader import load_file, load_text
from commgate.model.predict import predict
from commgate.model.trainers import hf

DATA = Path(__file__).parent / "data" / "hf"
SUITE = Path(__file__).resolve().parents[1] / "scenarios"
TINY = DATA / "tiny-llama.config.json"


def scenario(config: Path, ds: Path | None, args: dict[str, Any], *, dp: int = 2, extra: str = "") -> str:
    block = {"config": str(config), "training_args": args} | ({"deepspeed": str(ds)} if ds else {})
    return (
        f"schema_version: 1\nname: t\ntrainer: hf\nhf: {yaml.safe_dump(block, default_flow_style=True).strip()}\n"
        "model: {s: 32}\n"
        f"parallelism: {{dp: {dp}}}\nsteps: 3\nwarmup_steps: 0\n{extra}"
    )


# ------------------------------------------------------------------------------------ the "auto" table


ARGS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "learning_rate": 3e-4,
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 0.5,
    "warmup_steps": 10,
    "bf16": True,
}


def expected(key: str, a: dict[str, Any], h: int, world: int, steps: int) -> Any:
    """What Trainer makes of ``key`` given as ``"auto"`` (the table of ``docs/trainers.md``)."""
    b, m = a["per_device_train_batch_size"], a["gradient_accumulation_steps"]
    return {
        "train_micro_batch_size_per_gpu": b,
        "gradient_accumulation_steps": m,
        "train_batch_size": world * b * m,
        "gradient_clipping": a["max_grad_norm"],
        "optimizer.params.lr": a["learning_rate"],
        "optimizer.params.betas": [a["adam_beta1"], a["adam_beta2"]],
        "optimizer.params.eps": a["adam_epsilon"],
        "optimizer.params.weight_decay": a["weight_decay"],
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": a["learning_rate"],
        "scheduler.params.warmup_num_steps": max(1, a["warmup_steps"]),
        "scheduler.params.total_num_steps": steps,
        "fp16.enabled": False,
        "bf16.enabled": a["bf16"],
        "zero_optimization.reduce_bucket_size": h * h,
        "zero_optimization.stage3_prefetch_bucket_size": 9 * h * h // 10,
        "zero_optimization.stage3_param_persistence_threshold": 10 * h,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }[key]


def autos(d: dict[str, Any], prefix: str = "") -> list[str]:
    return [
        k
        for key, v in d.items()
        for k in (autos(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key] if v == "auto" else [])
    ]


@pytest.mark.parametrize("ds", ["ds_config_zero2.json", "ds_config_zero3.json"])
@pytest.mark.parametrize("config", ["tinyllama-1.1b.json", "qwen2.5-0.5b.json", "tiny-llama.config.json"])
def test_every_auto_of_hugging_faces_configs_resolves_as_the_table_says(ds: str, config: str) -> None:
    """Hugging Face's own ZeRO-2 and ZeRO-3 test configs (verbatim; offload kept: predicted, not run), for
    Llama and Qwen2 configs, on 8 ranks: each ``"auto"`` is what the table says and nothing is left ``"auto"``.
    Where trainer hf models the job (not a tied embedding, nor bf16, under ZeRO-3), the scenario's ``deepspeed:``
    block is that resolution (less accelerate's infinite ``steps_per_print``) and every resolved key is shown
    with the prediction."""
    raw, cfg = json.loads((DATA / ds).read_text()), json.loads((DATA / config).read_text())
    zero3 = raw["zero_optimization"]["stage"] == 3
    args = ARGS | {"bf16": not zero3 or cfg.get("torch_dtype") == "bfloat16"}
    block = {"config": str(DATA / config), "deepspeed": str(DATA / ds), "training_args": args}
    r = hf._resolution(block, None, 8, 3)
    assert r.config is not None and r.hidden_size == cfg["hidden_size"]
    flat = hf._flat(r.config)
    for key in autos(raw):
        assert flat[key] == pytest.approx(expected(key, args, cfg["hidden_size"], 8, 3)), key
    assert "auto" not in json.dumps(r.config) and r.config["steps_per_print"] == float("inf")
    if zero3 and (args["bf16"] or cfg.get("tie_word_embeddings")):
        with pytest.raises(ScenarioError, match="under ZeRO-3"):  # refused: test_what_a_scenario_cannot_say
            load_text(scenario(DATA / config, DATA / ds, args, dp=8))
        return
    (s,) = load_text(scenario(DATA / config, DATA / ds, args, dp=8))
    assert s.deepspeed_config == hf.finite(r.config) and "steps_per_print" not in s.deepspeed_config
    shown = "\n".join(hf.derived(s))
    assert all(f'deepspeed.{key}: "auto" -> ' in shown for key in autos(raw))
    assert (s.parallelism.micro_batch, s.parallelism.micro_batches) == (4, 8)
    assert s.model.dtype == ("bf16" if args["bf16"] else "fp32")


def test_a_pinned_deepspeed_key_left_out_states_nothing() -> None:
    """An imported scenario pins what Trainer resolves (``total_num_steps`` from its steps); with its steps
    changed, the error said to leave the key out, and with it left out said the same of "(absent)" (found by
    an adversarial pass). A key the block leaves out is not compared; one it states still is."""
    resolved = {"deepspeed": {"scheduler": {"params": {"total_num_steps": 6, "warmup_num_steps": 0}}}}
    left_out = {"deepspeed": {"scheduler": {"params": {"warmup_num_steps": 0}}}}
    hf._agrees(left_out, resolved, {"deepspeed": "ds.json"})
    pinned = {"deepspeed": {"scheduler": {"params": {"total_num_steps": 4, "warmup_num_steps": 0}}}}
    with pytest.raises(CommgateError, match=r"total_num_steps is 4 in the scenario, Trainer resolves 6"):
        hf._agrees(pinned, resolved, {"deepspeed": "ds.json"})
    extra = {"deepspeed": {"scheduler": {"params": {"warmup_num_steps": 0, "warmup_max_lr": 1}}}}
    with pytest.raises(CommgateError, match=r"warmup_max_lr is 1 in the scenario, Trainer resolves \(absent\)"):
        hf._agrees(extra, resolved, {"deepspeed": "ds.json"})
    # every section's stale fields said at once (the first section's were counted alone: an adversarial pass)
    stale = {"parallelism": {"micro_batch": 4}} | pinned
    with pytest.raises(CommgateError) as info:
        hf._agrees(stale, resolved | {"parallelism": {"micro_batch": 8}}, {"deepspeed": "ds.json"})
    assert str(info.value).startswith(
        "deepspeed.scheduler.params.total_num_steps is 4 in the scenario, Trainer resolves 6 from hf.deepspeed ds.json "
        "(and 1 more: parallelism.micro_batch); leave it out"
    ), str(info.value)


def test_the_summary_says_logging_as_trainer_does_it() -> None:
    """``logging_strategy: "no"`` was summed up as "logging no every 500 step(s)" (found by an adversarial
    pass)."""
    (off,) = load_text(scenario(TINY, None, {"per_device_train_batch_size": 1, "logging_strategy": "no"}))
    (on,) = load_text(scenario(TINY, None, {"per_device_train_batch_size": 1, "logging_steps": 3}))
    assert "logging off (no)" in "\n".join(hf.derived(off)) and "every" not in "\n".join(hf.derived(off))
    assert "logging every 3 step(s)" in "\n".join(hf.derived(on))


def test_a_hidden_size_key_left_auto_in_a_zero2_config_is_filled_by_accelerate() -> None:
    """transformers fills the ZeRO-3 bucket keys for stage 3 only; accelerate fills them at any stage."""
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    ds |= {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    r = hf._resolved(json.dumps(ds), TINY.read_text(), 2, json.dumps(hf.arguments({}, 3)))
    by = {c.key: c.by for c in r.changes}
    assert r.config is not None and r.config["zero_optimization"]["stage3_prefetch_bucket_size"] == 9 * 64 * 64 // 10
    assert by["zero_optimization.stage3_prefetch_bucket_size"] == "accelerate Accelerator._prepare_deepspeed"
    assert by["zero_optimization.reduce_bucket_size"] == "Trainer: trainer_config_finalize"


# ---------------------------------------------------------------------------------- what it cannot say

TINY_ARGS = {"per_device_train_batch_size": 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            scenario(TINY, None, TINY_ARGS).replace("model: {s: 32}", "model: {s: 32, dtype: bf16}"),
            'model.dtype is "bf16" in the scenario, Trainer resolves "fp32" from hf; leave it out',
        ),
        (
            scenario(TINY, SUITE / "hf" / "ds_zero3.json", TINY_ARGS).replace("{dp: 2}", "{dp: 2, scheme: zero2}"),
            'parallelism.scheme is "zero2" in the scenario, Trainer resolves "zero3"',
        ),
        (scenario(TINY, None, TINY_ARGS).replace("model: {s: 32}", "model: {s: 32, L: 2}"), "model.L: trainer hf"),
        (scenario(TINY, None, TINY_ARGS).replace("model: {s: 32}", "model: {}"), "model.s: give the sequence"),
        (scenario(TINY, None, TINY_ARGS, extra="deepspeed: {}\n"), "deepspeed: trainer hf reads the DeepSpeed JSON"),
        (scenario(TINY, None, TINY_ARGS, extra="emulate: true\n"), "emulate: not supported"),
        # the schemes' advice ("use scheme 'fsdp', 'tp', 'cp' or '3d'") was none a Trainer job can take
        (scenario(TINY, None, TINY_ARGS).replace("{dp: 2}", "{dp: 2, tp: 2}"), "parallelism.tp: 2: trainer hf runs"),
        (
            scenario(TINY, None, TINY_ARGS).replace("{dp: 2}", "{dp: 2, pp: 2}"),
            "parallelism.pp: 2: trainer hf runs data",
        ),
        (scenario(TINY, None, TINY_ARGS).replace("{dp: 2}", "{dp: 2, dp_replicate: 2}"), "dp_replicate: 2: trainer hf"),
        (scenario(TINY, None, {"save_strategy": "steps"}), "save_strategy 'steps': checkpoint saving"),
        (scenario(TINY, None, {"eval_strategy": "steps"}), "eval_strategy 'steps': evaluation"),
        (scenario(TINY, None, {"gradient_checkpointing": True}), "activation checkpointing"),
        (scenario(DATA / "nope.json", None, TINY_ARGS), "hf.config .*nope.json: cannot be read"),
        ("no-optimizer", "no optimizer section: Trainer's own AdamW keeps two parameter groups"),
        ("stage-0", "zero_optimization.stage 0: trainer hf runs ZeRO stages 1-3"),
        ("auto-allgather", "accelerate refuse it: `zero_optimization.allgather_bucket_size` not found in kwargs"),
        ("mismatch", "ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=1"),
        ("tied-zero3", "tie_word_embeddings under ZeRO-3"),
        ("hpz", r"ZeRO\+\+ \(zero_optimization's zero_hpz_partition_size > 1.*not modelled for trainer 'hf'"),
        (
            scenario(TINY, SUITE / "hf" / "ds_zero3.json", {"bf16": True}),
            "hf.training_args.bf16: true under ZeRO-3 is not modelled yet",
        ),
        (scenario(TINY, None, {"logging_strategy": "epoch"}), 'hf.training_args.logging_strategy: "epoch" is not'),
        (scenario(TINY, None, {"seed": -5}), r"hf.training_args.seed: -5 is out of range, expected a value >= 0$"),
    ],
    ids=[
        "model-dtype",
        "scheme",
        "dimensions",
        "no-s",
        "deepspeed-block",
        "emulate",
        "tp",
        "pp",
        "dp-replicate",
        "save",
        "eval",
        "checkpointing",
        "no-config",
        "no-optimizer",
        "stage-0",
        "auto-allgather",
        "mismatch",
        "tied-zero3",
        "hpz",
        "bf16-zero3",
        "logging-epoch",
        "seed-negative",  # Trainer's set_seed raises in numpy (found by an adversarial pass)
    ],
)
def test_what_a_scenario_cannot_say_is_one_line_naming_it(text: str, message: str, tmp_path: Path) -> None:
    configs = {
        "no-optimizer": ({"zero_optimization": {"stage": 2}}, TINY),
        "stage-0": ({"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {}}}, TINY),
        "auto-allgather": ({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}, TINY),
        "mismatch": ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}, TINY),
        "tied-zero3": ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {}}}, None),
        "hpz": (  # it named parallelism.scheme zero++, which a Trainer job cannot set (found by the HF campaign)
            {
                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
                "optimizer": {"type": "AdamW", "params": {}},
                "train_micro_batch_size_per_gpu": "auto",  # else DeepSpeed's batch check refuses it first
            },
            TINY,
        ),
    }
    if text in configs:
        ds, config = configs[text]
        if config is None:
            config = tmp_path / "tied.json"
            config.write_text(json.dumps(json.loads(TINY.read_text()) | {"tie_word_embeddings": True}))
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        text = scenario(config, tmp_path / "ds.json", TINY_ARGS)
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert len(info.value.problems) == 1 and "\n" not in str(info.value.problems[0]), info.value.problems


# ------------------------------------------------------------------------------------------ workarounds


def upstream(code: str, tmp_path: Path, **env: str) -> Any:
    """``code`` run in a fresh process that joined a one-rank gloo group (accelerate's state is per process),
    with ``env`` added; what it prints, as JSON."""
    head = (
        "import json, os, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    clean |= {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"} | env
    proc = subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(code)], env=clean, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
STATE = "from accelerate.state import PartialState\nprint(json.dumps(str(PartialState(cpu={cpu}).distributed_type)))"


def test_w1_accelerate_runs_distributed_only_with_the_rank_environment(tmp_path: Path) -> None:
    """W1: the process group alone does not make a distributed run (``accelerate/state.py:800-808``)."""
    assert upstream(STATE.format(cpu=True), tmp_path) == "DistributedType.NO"
    assert upstream(STATE.format(cpu=True), tmp_path, **RANK_ENV) == "DistributedType.MULTI_CPU"


def test_w2_a_cpu_host_runs_distributed_only_with_use_cpu(tmp_path: Path) -> None:
    """W2: without ``use_cpu`` a host with no accelerator gets no backend (``state.py:800-815``); with it,
    ``TrainingArguments`` makes the CPU run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU host finds its accelerator without use_cpu")
    assert upstream(STATE.format(cpu=False), tmp_path, **RANK_ENV) == "DistributedType.NO"
    code = (
        "from transformers import TrainingArguments\nfrom accelerate.state import PartialState\n"
        f"TrainingArguments(output_dir='{tmp_path}', use_cpu=True, report_to='none')\n"
        "print(json.dumps(str(PartialState().distributed_type)))"
    )
    assert upstream(code, tmp_path, **RANK_ENV) == "DistributedType.MULTI_CPU"


DEEPSPEED_STATE = """
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DeepSpeedPlugin
PartialState(cpu=True)  # as TrainingArguments(use_cpu=True) makes it
plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
print(json.dumps(str(Accelerator(deepspeed_plugin=plugin).distributed_type)))  # as Trainer makes it
"""


def test_w3_accelerate_use_cpu_in_the_environment_drops_deepspeed(tmp_path: Path) -> None:
    """W3: ``ACCELERATE_USE_CPU=true`` forces ``cpu`` (``state.py:915-916``) and DeepSpeed is kept only
    without it (``state.py:974``); Trainer's own ``Accelerator`` keeps it (the ``verify`` check catches the
    drop: ``test_a_planted_substitution_fails_the_run_naming_its_cause``)."""
    assert upstream(DEEPSPEED_STATE, tmp_path, **RANK_ENV) == "DistributedType.DEEPSPEED"
    dropped = upstream(DEEPSPEED_STATE, tmp_path, **RANK_ENV, ACCELERATE_USE_CPU="true")
    assert dropped == "DistributedType.MULTI_CPU"


def test_w4_deepspeeds_comm_is_left_to_join_and_adopts_the_group(tmp_path: Path) -> None:
    """W4: accelerate's CPU path leaves DeepSpeed's comm uninitialised (``state.py:201``); initialised by
    the adapter, it adopts the process group (no second group)."""
    code = """
    import deepspeed
    from accelerate.state import PartialState
    PartialState(cpu=True)
    before, group = deepspeed.comm.is_initialized(), dist.distributed_c10d._get_default_group()
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    same = dist.distributed_c10d._get_default_group() is group
    print(json.dumps([before, deepspeed.comm.is_initialized(), same, deepspeed.comm.get_world_size()]))
    """
    assert upstream(code, tmp_path, **RANK_ENV) == [False, True, True, 1]


def test_w5_an_fsdp_plugin_is_dropped_on_cpu_ranks(tmp_path: Path) -> None:
    """W5: accelerate keeps an FSDP plugin for GPU types only (``state.py:986-1016``): without the adapter's
    ``_keep_fsdp_plugin`` (``tests/test_hf_fsdp.py``) FSDP would run as DDP. Fails once upstream keeps it."""
    code = """
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    PartialState(cpu=True)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    print(json.dumps([str(accelerator.distributed_type), "fsdp_plugin" in accelerator.state.__dict__]))
    """
    assert upstream(code, tmp_path, **RANK_ENV) == ["DistributedType.MULTI_CPU", False]


def test_w6_torch_adam_spares_the_cpu_op_build(tmp_path: Path) -> None:
    """W6: a config optimizer ``AdamW`` is DeepSpeed's FusedAdam op (compiled on first use on CPU), torch's
    AdamW with ``"torch_adam": true`` (``runtime/engine.py:2378-2409``)."""
    code = """
    import types
    from deepspeed.runtime.engine import DeepSpeedEngine
    engine = types.SimpleNamespace(zero_use_cpu_optimizer=lambda: False)
    def cls(params):
        return DeepSpeedEngine.get_optimizer_configuration(engine, params, True)[0]
    print(json.dumps([f"{c.__module__}.{c.__name__}" for c in (cls({"torch_adam": True}), cls({}))]))
    """
    assert upstream(code, tmp_path) == ["torch.optim.adamw.AdamW", "deepspeed.ops.adam.fused_adam.FusedAdam"]


def test_w7_trainer_fetches_a_step_before_its_step_begins(tmp_path: Path) -> None:
    """W7: ``get_batch_samples`` (and its token-count gather) runs before ``on_step_begin``
    (``trainer.py:1873`` vs ``:1894``), so the adapter begins a step there."""
    code = f"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    events = []
    class Seen(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            events.append("on_step_begin")
    args = TrainingArguments(output_dir="{tmp_path}", use_cpu=True, report_to="none", max_steps=2,
                             per_device_train_batch_size=1, save_strategy="no", disable_tqdm=True)
    config = AutoConfig.for_model(**json.load(open("{TINY}")))
    data = [{{"input_ids": torch.arange(8), "labels": torch.arange(8)}}] * 4
    trainer = Trainer(model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=data, callbacks=[Seen()])
    fetch = trainer.get_batch_samples
    trainer.get_batch_samples = lambda *a, **k: (events.append("get_batch_samples"), fetch(*a, **k))[1]
    trainer.train()
    print(json.dumps(events))
    """
    assert upstream(code, tmp_path) == ["get_batch_samples", "on_step_begin"] * 2


# ------------------------------------------------------------------------------------------ real runs


def run(text_or_file: str | Path, tmp_path: Path, **runner: Any) -> Any:
    from commgate.pipeline import Options, run_scenario
    from commgate.run.runners import LocalRanks

    (s,) = load_file(text_or_file) if isinstance(text_or_file, Path) else load_text(text_or_file)
    return run_scenario(s, LocalRanks(deadline_s=600, **runner), Options(baseline_dir=tmp_path, gate=False))


def reconciled(result: Any) -> None:
    """Passed: every call key matched, nothing unexplained (against the model and Eqs. 2-3), the resolved
    values in the summary."""
    assert result.status == "passed", result.reason
    rec = result.reconciliation
    assert rec is not None and not rec.mismatches and rec.keys, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    assert all(c.unexplained_bytes == 0 for c in result.prediction.comparison())
    shown = result.summary()
    assert all(f"    hf: {line}" in shown for line in hf.derived(result.prediction.scenario))


@pytest.mark.parametrize("file", sorted(SUITE.glob("hf-*.yaml")), ids=lambda f: f.stem)
def test_the_default_suites_auto_configs_reconcile_on_real_runs(file: Path, tmp_path: Path) -> None:
    """``scenarios/hf-zero2.yaml`` (gradient accumulation 2, logging every second step) and
    ``scenarios/hf-zero3.yaml``: Hugging Face's own configs, "auto" resolved; ``scenarios/hf-fsdp2.yaml``:
    FSDP2 through accelerate's plugin (W5), accelerate's groups shown. Trainer itself trains."""
    result = run(file, tmp_path)
    reconciled(result)
    fsdp = result.prediction.scenario.parallelism.scheme == "fsdp"
    assert ("    hf: fsdp: FSDP2 through accelerate's plugin" if fsdp else '"auto" -> ') in result.summary()


def test_a_model_that_adds_into_a_modules_output_in_place_predicts_and_reconciles(tmp_path: Path) -> None:
    """Falcon's parallel attention adds the attention's output into the MLP's in place
    (``mlp_output += attention_output``). commgate's meta-device trace marked a module's output by returning it
    as-is from an autograd function, a view, and autograd refused the in-place add: predict and import failed
    with torch's advice to clone, which the user cannot take (found by an adversarial pass). Under ZeRO-3, where
    the trace's module order is what is predicted, a real run reconciles."""
    ds = SUITE / "hf" / "ds_zero3.json"
    result = run(scenario(DATA / "mini-falcon.config.json", ds, {"per_device_train_batch_size": 1}), tmp_path)
    reconciled(result)
    assert any(r.source.startswith("ZeRO-3 module parameter all-gather") for r in result.prediction.collectives)


@pytest.mark.parametrize(
    "args",
    [
        {"per_device_train_batch_size": 1, "logging_steps": 1},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "logging_steps": 2},
        {"per_device_train_batch_size": 1, "ddp_find_unused_parameters": False, "include_num_input_tokens_seen": True},
    ],
    ids=["defaults", "accumulation-2", "no-unused-tokens-seen"],
)
def test_ddp_as_trainer_runs_it_reconciles(args: dict[str, Any], tmp_path: Path) -> None:
    """No DeepSpeed config: Trainer's DDP, with ``find_unused_parameters`` as Trainer sets it (on for a model
    without activation checkpointing: the initial buckets, the used-parameter map each step) or off (the
    bucket rebuild), the token counts gathered each step (and each micro-batch when they are tracked)."""
    reconciled(run(scenario(TINY, None, args), tmp_path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_hidden_layers": "2"}, "Field 'num_hidden_layers' expected int, got str"),
        ({"tie_word_embeddings": "yes"}, "Field 'tie_word_embeddings' expected bool, got str"),
        ({"num_attention_heads": 5}, "is not a multiple of the number of attention heads"),
        ({"model_type": None}, "no model_type: give a causal language model's config.json"),
        ({"model_type": "my_model"}, "Unrecognized model identifier: my_model"),
        # from_config builds float64 parameters, taken as fp32: half the bytes (found by an adversarial pass)
        ({"torch_dtype": "float64"}, "torch_dtype float64 is not modelled: transformers' from_config builds the"),
        ({"dtype": "float64"}, 'set "torch_dtype" (or "dtype") to "float32"'),
        # beyond the limits of a scenario's own model fields: a 6.6e21-parameter config predicted (same pass)
        ({"hidden_size": 2**30}, "hidden_size 1,073,741,824 is more than commgate takes (1,048,576, as model.h)"),
        ({"vocab_size": 10**9}, "vocab_size 1,000,000,000 is more than commgate takes (100,000,000, as model.V)"),
    ],
    ids=[
        "str-int",
        "str-bool",
        "heads",
        "no-model-type",
        "custom-type",
        "float64",
        "dtype-float64",
        "huge-h",
        "huge-V",
    ],
)
def test_a_config_json_transformers_refuses_is_one_short_line_naming_it(
    edit: dict[str, Any], message: str, tmp_path: Path
) -> None:
    """transformers' own validation of a config.json (strict fields, its architecture check, unknown model
    types) is one line naming the file, at most a few hundred characters (it was a 47-line traceback, or
    an 11.7 KB line under ``hf.training_args``; found by an adversarial pass)."""
    cfg = {k: v for k, v in (json.loads(TINY.read_text()) | edit).items() if v is not None}
    config = tmp_path / "bad.config.json"
    config.write_text(json.dumps(cfg))
    with pytest.raises(ScenarioError) as info:
        load_text(scenario(config, None, {"per_device_train_batch_size": 1}))
    text = str(info.value)
    assert "\n" not in text and message in text and "bad.config.json" in text and len(text) < 700, text


def test_a_model_that_fails_its_trace_is_named_by_the_config_the_user_wrote() -> None:
    """An error from the model's meta-device trace named ``model.module 'transformers:...'``, a field a Trainer
    job does not have (found by the Hugging Face campaign): it names ``hf.config`` and the class. The case is
    fp32 Qwen2-MoE, whose experts' ``torch._grouped_mm`` has a meta kernel that wants bf16 although the CPU
    kernel runs fp32 (a known gap, docs/trainers.md)."""
    with pytest.raises(ScenarioError) as info:  # said as it loads, where the model is measured
        load_text(scenario(DATA / "mini-qwen2moe.config.json", None, TINY_ARGS))
    (problem,) = info.value.problems
    message = problem.message
    assert problem.path == "$.hf"
    assert message.startswith(f"hf.config {DATA / 'mini-qwen2moe.config.json'} (transformers:Qwen2MoeForCausalLM): ")
    assert "its forward and backward on the meta device (no weights) raised" in message and "\n" not in message


def test_a_layer_class_the_model_does_not_have_is_refused_at_load() -> None:
    """``fsdp_config.transformer_layer_cls_to_wrap`` of another family: refused at load naming the model's own
    decoder layers (predict and the run used to crash in accelerate's wrapping with a traceback)."""
    args = {"per_device_train_batch_size": 1, "fsdp": True}
    args |= {"fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["MistralDecoderLayer"]}}
    with pytest.raises(ScenarioError, match=r"'MistralDecoderLayer': LlamaForCausalLM has no such layer; its decoder"):
        load_text(scenario(TINY, None, args))


def test_a_sequence_beyond_learned_positions_is_refused_at_load(tmp_path: Path) -> None:
    """GPT-2's learned positions (``n_positions``): a longer ``model.s`` failed on the ranks with "index out
    of range" and a traceback; it is refused at load naming both."""
    config = tmp_path / "gpt2.config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 2}))
    with pytest.raises(
        ScenarioError, match=r"model.s: 32 is longer than the model's learned positions \(n_positions 16"
    ):
        load_text(scenario(config, None, {"per_device_train_batch_size": 1}))
    # OPT names its limit max_position_embeddings, its table 2 longer (an offset): it passed validate and ran
    # into the ranks' traceback (found by an adversarial pass); a rotary model's max_position_embeddings is no limit
    opt = {"model_type": "opt", "vocab_size": 256, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2}
    config.write_text(json.dumps(opt | {"num_attention_heads": 4, "max_position_embeddings": 16}))
    with pytest.raises(
        ScenarioError, match=r"model.s: 32 is longer .* \(model.decoder.embed_positions holds 16; max_po"
    ):
        load_text(scenario(config, None, {"per_device_train_batch_size": 1}))
    config.write_text(json.dumps(opt | {"num_attention_heads": 4, "max_position_embeddings": 32}))
    load_text(scenario(config, None, {"per_device_train_batch_size": 1}))
    config.write_text(json.dumps(json.loads(TINY.read_text()) | {"max_position_embeddings": 16}))
    (rotary,) = load_text(scenario(config, None, {"per_device_train_batch_size": 1}))
    assert rotary.model.s == 32


def test_a_position_table_that_cannot_be_read_is_left_to_the_models_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The look for a learned position table builds the model on the meta device; where that raises, it says
    nothing (no traceback at load), and the model's own measurement as the scenario loads names what fails."""
    import transformers

    def fails(*args: object, **kwargs: object) -> None:
        raise ValueError("a config transformers cannot build")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", fails)
    cfg = hf._config_of(json.loads(TINY.read_text()) | {"max_position_embeddings": 16}, TINY)
    assert hf._learned_positions(cfg) is None


def test_a_gpu_only_deepspeed_optimizer_is_skipped_on_cpu_saying_why(tmp_path: Path) -> None:
    """Lamb passed validation and then failed on the ranks with FusedLamb's "not implemented on CPU backend"
    and a traceback; a CPU run is now skipped naming it (a GPU machine runs it)."""
    from commgate.run.workloads import skip_reason

    ds = json.loads((SUITE / "hf" / "ds_zero2.json").read_text())
    ds["optimizer"] = {"type": "Lamb", "params": {"lr": "auto", "weight_decay": "auto"}}
    (tmp_path / "lamb.json").write_text(json.dumps(ds))
    (s,) = load_text(scenario(TINY, tmp_path / "lamb.json", {"per_device_train_batch_size": 1}))
    assert "FusedLamb has no CPU kernel" in (skip_reason(s, gpus=False) or "")
    assert skip_reason(replace(s, backend="nccl"), gpus=True) is None
    # Lion too (found by an adversarial pass), unless the optimizer is offloaded: DeepSpeedCPULion then
    ds["optimizer"] = {"type": "Lion", "params": {"lr": "auto"}}
    (tmp_path / "lion.json").write_text(json.dumps(ds))
    (lion,) = load_text(scenario(TINY, tmp_path / "lion.json", {"per_device_train_batch_size": 1}))
    assert "FusedLion has no CPU kernel" in (skip_reason(lion, gpus=False) or "")
    ds["zero_optimization"] = ds.get("zero_optimization", {}) | {"offload_optimizer": {"device": "cpu"}}
    (tmp_path / "lion.json").write_text(json.dumps(ds))
    (offloaded,) = load_text(scenario(TINY, tmp_path / "lion.json", {"per_device_train_batch_size": 1}))
    assert skip_reason(offloaded, gpus=False) is None


def test_ddp_autocast_over_a_16_bit_model_is_refused_naming_the_trainer_fields(tmp_path: Path) -> None:
    """``bf16: true`` without DeepSpeed on a model shipped in fp16: refused naming hf.training_args.bf16 and
    the config (it named model.autocast and model.dtype, fields a trainer hf scenario does not hold)."""
    config = tmp_path / "fp16.config.json"
    config.write_text(json.dumps(json.loads(TINY.read_text()) | {"torch_dtype": "float16"}))
    with pytest.raises(ScenarioError, match=r"hf.training_args.bf16: true with hf.config .*fp16 parameters"):
        load_text(scenario(config, None, {"per_device_train_batch_size": 1, "bf16": True}))


def test_a_trainer_jobs_deepspeed_optimizer_is_not_warned_of_as_commgates_own() -> None:
    """The client-optimizer warning describes commgate's own workloads; Trainer builds the config's optimizer."""
    (s,) = load_text(scenario(TINY, SUITE / "hf" / "ds_zero2.json", {"per_device_train_batch_size": 1}))
    assert not [w for w in s.warnings if "commgate's own workloads step torch's AdamW" in w], s.warnings


def test_ddp_of_a_model_shipped_in_bf16_reconciles(tmp_path: Path) -> None:
    """A config.json with ``torch_dtype: bfloat16`` (as TinyLlama, Llama 3.x, Qwen2 and Mistral ship): its
    parameters come bf16 out of ``from_config``, RoPE's ``inv_freq`` stays fp32, and DDP broadcasts it apart
    (the model is read as the trainer builds it, not cast; found by an adversarial pass)."""
    cfg = json.loads(TINY.read_text()) | {"torch_dtype": "bfloat16"}
    config = tmp_path / "bf16.config.json"
    config.write_text(json.dumps(cfg))
    s = load_text(scenario(config, None, {"per_device_train_batch_size": 1, "logging_steps": 1}))[0]
    assert s.model.dtype == "bf16"
    assert {b.dtype for b in hf_buffers(s)} == {"fp32"}  # inv_freq: fp32 in a bf16 model
    reconciled(run(scenario(config, None, {"per_device_train_batch_size": 1, "logging_steps": 1}), tmp_path))


MINI_NEOX = DATA / "mini-pythia.config.json"


def test_ddp_autocast_readies_each_linears_weight_gradient_before_its_bias_as_a_rank_does(tmp_path: Path) -> None:
    """Trainer's ``bf16`` under DDP is CPU autocast over fp32 parameters, which casts each linear layer's
    weight before its bias, so the weight's gradient is ready first; the meta-device trace (where autocast
    does nothing) had each bias first, and DDP's rebuilt buckets then each carried one bias too many or too
    few (measured on Pythia-70m: 4,096 B between two buckets; found by the Hugging Face campaign). The
    trace now runs on fake CPU tensors under the same autocast: its order is the one a real CPU model
    gives, it differs from the meta order in the buckets of 1 MB, and the run reconciles."""
    import torch
    from commgate.model import usermodule
    from commgate.model.expectation import Context
    from commgate.model.schemes.ddp import rebuilt_buckets

    args = {"per_device_train_batch_size": 1, "logging_steps": 1, "bf16": True, "ddp_find_unused_parameters": False}
    text = scenario(MINI_NEOX, None, args | {"ddp_bucket_cap_mb": 1})
    (s,) = load_text(text)
    traced = usermodule.describe(s).ready
    model, inputs = usermodule.build(s, torch.device("cpu"))
    real: list[str] = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, _n=n: real.append(_n))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*inputs(0))
    loss.backward()
    assert traced == tuple(real)
    assert traced.index("gpt_neox.layers.1.mlp.dense_4h_to_h.weight") < traced.index(
        "gpt_neox.layers.1.mlp.dense_4h_to_h.bias"
    )
    meta, _ = usermodule._trace(*usermodule.build(s, torch.device("meta")), "meta")
    by_name = {p.name: p for p in Context(scenario=s).params}
    buckets = [rebuilt_buckets(tuple(by_name[n] for n in order), 4, 1) for order in (meta, traced)]
    assert buckets[0] != buckets[1] and sum(buckets[0]) == sum(buckets[1])  # the model would miss without it
    reconciled(run(text, tmp_path))


def hf_buffers(s: Any) -> tuple[Any, ...]:
    from commgate.model.usermodule import describe

    return describe(s).buffers


@pytest.mark.parametrize("ds", [SUITE / "hf" / "ds_zero2.json", None], ids=["zero2", "ddp"])
def test_bf16_reconciles(ds: Path | None, tmp_path: Path) -> None:
    """``bf16: true``: DeepSpeed's bf16 parameters under ZeRO-2 (with its overflow check); under DDP, autocast
    over fp32 parameters, in buckets of ``ddp_bucket_cap_mb``."""
    args = {"per_device_train_batch_size": 1, "logging_steps": 1, "bf16": True, "ddp_bucket_cap_mb": 1}
    result = run(scenario(TINY, ds, args), tmp_path)
    reconciled(result)
    m = result.prediction.scenario.model
    assert (m.dtype, m.autocast) == (("bf16", None) if ds else ("fp32", "bf16"))


def test_zero3_with_accumulation_reconciles(tmp_path: Path) -> None:
    ds = SUITE / "hf" / "ds_zero3.json"
    args = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "logging_steps": 1}
    reconciled(run(scenario(TINY, ds, args), tmp_path))


BATCHLESS = {
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
}
"""A DeepSpeed JSON as users write it for Trainer, without its batch keys (found by an adversarial pass)."""


def batchless(tmp_path: Path, **keys: Any) -> Path:
    (tmp_path / "ds.json").write_text(json.dumps(BATCHLESS | keys))
    return tmp_path / "ds.json"


def test_a_json_without_gradient_accumulation_steps_runs_at_trainers_accumulation(tmp_path: Path) -> None:
    """accelerate's DeepSpeedPlugin sets an absent ``gradient_accumulation_steps`` to 1; Trainer still runs
    ``training_args.gradient_accumulation_steps`` micro-batches a step and sets DeepSpeed's boundary itself.
    commgate refused the job, saying the JSON's 1 (a key it does not hold) contradicts m = 2; the real run
    reconciles at m = 2, its summary saying where the 1 comes from."""
    ds = batchless(tmp_path, train_micro_batch_size_per_gpu="auto")
    args = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "logging_steps": 1}
    result = run(scenario(TINY, ds, args), tmp_path)
    reconciled(result)
    assert result.prediction.scenario.parallelism.micro_batches == 2
    assert "DeepSpeed's config holds gradient_accumulation_steps 1, which sets only its batch check" in result.summary()


@pytest.mark.parametrize(
    ("keys", "args", "message"),
    [
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
            {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
            r"train_batch_size 8 != 2 \* 1 \* 2 .*DeepSpeed refuses the config Trainer hands it; gradient_accumulation_"
            r"steps is 1 because .*ds.json leaves it out .*add \"gradient_accumulation_steps\": \"auto\" to .*ds.json$",
        ),
        (
            {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
            {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
            r"transformers or accelerate refuse it: .*ds train_batch_size=6 vs hf train_batch_size \(calculated\)=8",
        ),
        ({}, {"per_device_train_batch_size": 2}, r"neither train_batch_size nor train_micro_batch_size_per_gpu"),
    ],
    ids=["accumulation-left-out", "stated-wrong", "no-batch-key"],
)
def test_a_batch_deepspeed_refuses_is_one_line_naming_the_json(
    keys: dict[str, Any], args: dict[str, Any], message: str, tmp_path: Path
) -> None:
    """DeepSpeed's own batch check (``_batch_assertion``), on the config Trainer hands it, before any rank
    starts: the job would fail in ``deepspeed.initialize``. Before, the first case said the JSON's
    ``gradient_accumulation_steps: 1`` contradicts m = 2 and, in a second line, that the batch does not
    add up at m = 1."""
    with pytest.raises(ScenarioError) as err:
        load_text(scenario(TINY, batchless(tmp_path, **keys), args))
    (problem,) = err.value.problems
    assert problem.message.startswith(f"hf.deepspeed {tmp_path / 'ds.json'}: ")
    assert re.search(message, problem.message), problem.message


def test_a_planted_substitution_fails_the_run_naming_its_cause(tmp_path: Path) -> None:
    """``ACCELERATE_USE_CPU=true`` in the ranks' environment (as ``accelerate launch --cpu`` sets it) makes
    accelerate drop DeepSpeed: the job trains as DDP. The gate does not inherit the substitution: the run
    fails, naming what ran, what the scenario says and why."""
    from commgate.run.inject import Faults, parse

    faults = parse(["env=ACCELERATE_USE_CPU=true"])
    assert faults == Faults(env=(("ACCELERATE_USE_CPU", "true"),))
    result = run(SUITE / "hf-zero2.yaml", tmp_path, faults=faults)
    assert result.status == "error" and "Traceback" not in result.reason
    assert "it ran without DeepSpeed (accelerate's MULTI_CPU, DistributedDataParallel)" in result.reason
    assert "ACCELERATE_USE_CPU=true in the rank's environment makes accelerate drop DeepSpeed" in result.reason


def test_the_prediction_needs_no_run_and_names_trainers_own_calls() -> None:
    """``commgate predict`` of a Trainer job: Trainer's own gathers are rows of their own, outside the paper."""
    (s,) = load_file(SUITE / "hf-zero2.yaml")
    p = predict(s)
    assert "Trainer: the step's token count" in {src for src, _ in p.not_in_paper()}
    trainer = [r for r in p.collectives if r.source.startswith("Trainer: ")]
    assert trainer and all(r.paper_term is None for r in trainer)
    logged = [r.at_step for r in trainer if r.source == "Trainer: logging (loss, flos)"]
    assert logged == [k for k in range(s.warmup_steps + s.steps) if (k + 1) % 2 == 0]


# ------------------------------------------------------------------------------------------- import


def test_import_writes_the_trainer_arguments_a_deepspeed_json_pins(tmp_path: Path) -> None:
    """A DeepSpeed JSON's explicit batch, accumulation, lr, betas and clipping are the TrainingArguments
    Trainer requires to match (it refuses a mismatch): import writes them; ``bf16: auto`` with a model shipped
    in bf16 is Trainer's ``--bf16``, said in a note. Before, both were refused (the repository's own TinyLlama
    with its ZeRO-2 JSON could not be imported)."""
    from commgate.cli import main

    ds = json.loads((DATA / "ds_config_zero2.json").read_text())
    ds |= {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5}
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "job.yaml"
    argv = ["import", "--trainer", "hf", "--hf", str(DATA / "tinyllama-1.1b.json"), "--deepspeed"]
    assert main([*argv, str(tmp_path / "ds.json"), "--dp", "2", "-o", str(out)]) == 0
    args = yaml.safe_load(out.read_text())["hf"]["training_args"]
    assert {k: args[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16")} == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "bf16": True,
    }
    assert (args["learning_rate"], args["adam_beta2"], args["max_grad_norm"]) == (1e-4, 0.95, 0.5)
    assert any("written as Trainer's --bf16" in n for n in yaml.safe_load(out.read_text())["notes"])
    (s,) = load_file(out)
    assert s.model.dtype == "bf16" and s.parallelism.micro_batches == 4
    # the sequence length to edit is said once, in the file's head, not by every run after it was edited
    assert "max_position_embeddings: set it to the sequence length" in out.read_text().split("\nschema_version")[0]
    assert not [w for w in (*s.warnings, *s.notes) if "max_position_embeddings" in w]


def test_import_reads_the_positions_as_transformers_does(tmp_path: Path) -> None:
    """GPT-2's config.json names them ``n_positions`` (transformers' ``attribute_map``): the import took 2048 and
    refused its own scenario against the model's 64 learned positions, with no flag to set s (found by an
    adversarial pass). A shrunk GPT-2 config, as Hugging Face's ``gpt2`` writes its keys."""
    from commgate.cli import main

    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_embd": 64}
    gpt2 |= {"n_layer": 2, "n_head": 4, "n_positions": 64, "n_ctx": 64, "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    out = tmp_path / "gpt2.yaml"
    assert main(["import", "--trainer", "hf", "--hf", str(tmp_path / "gpt2.json"), "--dp", "2", "-o", str(out)]) == 0
    (s,) = load_file(out)
    assert s.model.s == 64
    assert "gpt2.json's max_position_embeddings as transformers reads it (64)" in out.read_text()


def test_an_import_the_rules_refuse_says_nothing_was_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DeepSpeed key the model does not follow: the import writes nothing and says so, naming the key (it
    named the unwritten scenario file as if it held the problem)."""
    from commgate.cli import main

    ds = json.loads((DATA / "ds_config_zero2.json").read_text())
    ds["zero_optimization"]["round_robin_gradients"] = True
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "job.yaml"
    argv = ["import", "--trainer", "hf", "--hf", str(TINY), "--deepspeed", str(tmp_path / "ds.json"), "--dp", "2"]
    assert main([*argv, "-o", str(out)]) == 2
    *_, err = capsys.readouterr().err.strip().splitlines()
    # the key named in the DeepSpeed JSON it is in (it was $.deepspeed... of the scenario, which holds no such key)
    refused = f"{out} not written: the imported scenario is refused: {tmp_path / 'ds.json'}: $.zero_optimization.round"
    assert refused in err
    assert not out.exists()


def test_commgate_import_writes_the_job_and_what_trainer_resolves(tmp_path: Path) -> None:
    """``commgate import --hf config.json --deepspeed ds.json --trainer hf``: the inputs named as they are (paths
    relative to the written file), a comment per resolved key, and the resolved fields themselves, which the
    loader checks: the written file loads, and once the DeepSpeed JSON changes, names what no longer holds."""
    from commgate.cli import main

    ds = tmp_path / "configs" / "ds.json"
    ds.parent.mkdir()
    ds.write_text((DATA / "ds_config_zero3.json").read_text())
    out = tmp_path / "scenarios" / "job.yaml"
    argv = ["import", "--hf", str(TINY), "--deepspeed", str(ds), "--trainer", "hf", "--dp", "2", "-o", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    doc = yaml.safe_load(text)
    assert (doc["trainer"], doc["hf"]["deepspeed"], doc["parallelism"]["scheme"]) == (
        "hf",
        "../configs/ds.json",
        "zero3",
    )
    h = json.loads(TINY.read_text())["hidden_size"]
    assert doc["deepspeed"]["zero_optimization"]["reduce_bucket_size"] == h * h
    comments = [line for line in text.splitlines() if line.startswith("#   deepspeed.")]
    assert {c.split(":")[0].removeprefix("#   deepspeed.") for c in comments} >= set(autos(json.loads(ds.read_text())))
    (s,) = load_file(out)
    assert s.deepspeed_config == doc["deepspeed"] and s.trainer_config["training_args"] == doc["hf"]["training_args"]
    changed = json.loads(ds.read_text())
    changed["zero_optimization"]["reduce_bucket_size"] = 1000
    ds.write_text(json.dumps(changed))
    with pytest.raises(
        ScenarioError, match=r"deepspeed.zero_optimization.reduce_bucket_size is 4096 in the scenario, "
    ):
        load_file(out)


def test_commgate_import_for_trainer_hf_refuses_what_it_does_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commgate.cli import main

    out = tmp_path / "job.yaml"
    assert main(["import", "--hf", str(TINY), "--trainer", "hf", "--tp", "2", "-o", str(out)]) == 2
    assert "--trainer hf takes --hf (a config.json), --deepspeed and --dp; not --tp\n" in capsys.readouterr().err
    ds = str(SUITE / "hf" / "ds_zero2.json")
    assert main(["import", "--deepspeed", ds, "--trainer", "hf", "--dp", "2", "-o", str(out)]) == 2
    assert "--trainer hf: give --hf CONFIG.json, the model's Hugging Face config" in capsys.readouterr().err
    tt = ["import", "--torchtitan", "llama3:llama3_debugmodel", "--trainer", "hf", "--dp", "2", "-o", str(out)]
    assert main(tt) == 2
    assert (
        "--torchtitan imports a torchtitan job (trainer torchtitan); leave out --trainer hf" in capsys.readouterr().err
    )
    assert not out.exists()


def test_a_stray_launcher_variable_does_not_change_what_a_scenario_resolves_to() -> None:
    """``WORLD_SIZE=3 commgate run -k ddp`` failed on the Hugging Face scenarios -k had left out: accelerate,
    asked to resolve their "auto" values, read the stray variable and wanted MASTER_ADDR (found by an
    adversarial pass). The resolution is of the scenario's ranks, whatever the environment says."""
    root = Path(__file__).resolve().parents[1]
    files = [str(root / "scenarios" / f) for f in ("hf-zero2.yaml", "hf-zero3.yaml", "hf-fsdp2.yaml")]
    stray = {"WORLD_SIZE": "3", "LOCAL_RANK": "1", "RANK": "1"}
    proc = subprocess.run([sys.executable, "-m", "commgate", "predict", *files], capture_output=True, text=True,
                          env=os.environ | stray)  # fmt: skip
    clean = subprocess.run([sys.executable, "-m", "commgate", "predict", *files], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == clean.stdout, proc.stderr[-2000:]
