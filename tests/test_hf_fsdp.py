"""Trainer ``hf`` with FSDP2 through accelerate's plugin (``fsdp``, ``fsdp_config: {version: 2}``):

* W5, the workaround that keeps the plugin on CPU ranks: accelerate still drops it without (the test fails
  once upstream keeps it), the patch is written against the installed ``AcceleratorState.__init__`` and,
  applied, keeps the plugin as the GPU branch does;
* accelerate's wrapping read on the meta device (each decoder layer, the input embeddings, the tail);
* what a scenario cannot say under FSDP, one line each;
* real runs on 2 CPU gloo ranks (bf16 mixed precision, gradient accumulation 2, no resharding after forward;
  the default suite's ``hf-fsdp2`` runs in ``tests/test_hf.py``): every call key matched, no byte unexplained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="trainer hf needs transformers: pip install 'commgate[hf]'")
pytest.importorskip("accelerate", reason="trainer hf needs accelerate: pip install 'commgate[hf]'")

from commgate.core.errors import ScenarioError
from commgate.model.loader import load_file, load_text
from commgate.model.trainers import hf
from test_hf import RANK_ENV, SUITE, TINY, reconciled, run, scenario, upstream

FSDP = {"per_device_train_batch_size": 1, "logging_steps": 1, "fsdp": True, "fsdp_config": {"fsdp_version": 2}}

KEEP = """
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from commgate.run.trainers.hf import _keep_fsdp_plugin
PartialState(cpu=True)
with _keep_fsdp_plugin():
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), mixed_precision="bf16")
policy = accelerator.state.fsdp_plugin.mixed_precision_policy
AcceleratorState()  # a later one copies PartialState's shared state back: the type must hold there too
print(json.dumps([str(accelerator.distributed_type), accelerator.is_fsdp2, str(policy.param_dtype)]))
"""


def test_w5_the_workaround_keeps_the_fsdp_plugin_on_cpu_ranks(tmp_path: Path) -> None:
    """W5: the patch applies to the ``AcceleratorState.__init__`` it was written against (its source digest),
    keeps the plugin (with its mixed precision) as the GPU branch does, and is put back after."""
    from accelerate.state import AcceleratorState
    from commgate.run.trainers.hf import W5_SOURCE, _keep_fsdp_plugin, source_digest

    assert source_digest(AcceleratorState.__init__) == W5_SOURCE, "accelerate changed: check W5 (state.py FSDP branch)"
    assert upstream(KEEP, tmp_path, **RANK_ENV) == ["DistributedType.FSDP", True, "torch.bfloat16"]
    before = AcceleratorState.__dict__["__init__"]
    with _keep_fsdp_plugin():
        assert AcceleratorState.__dict__["__init__"] is not before
    assert AcceleratorState.__dict__["__init__"] is before


def test_accelerates_wrapping_is_read_on_the_meta_device() -> None:
    """Each decoder layer (the model's ``_no_split_modules``), the input embeddings, the tail [final norm,
    lm_head] not resharded after the forward; nothing left to the root; every parameter in one group."""
    (s,) = load_file(SUITE / "hf-fsdp2.yaml")
    us = hf.units(s)
    L = json.loads(TINY.read_text())["num_hidden_layers"]
    assert [u.name for u in us] == [
        *(f"model.layers.{i} (LlamaDecoderLayer)" for i in range(L)),
        "input embeddings",
        "tail (final norm, output embeddings)",
    ]
    assert [u.reshards for u in us] == [True] * (L + 1) + [False]
    from commgate.model.usermodule import describe

    assert sum(n for u in us for n, _ in u.params) == sum(p.numel for p in describe(s).params)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fsdp_version": 1}, r"hf.training_args.fsdp_config.fsdp_version 1: FSDP1 is not modelled"),
        ({"version": 2, "cpu_offload": True}, r"hf.training_args.fsdp_config.cpu_offload True: not modelled"),
        (
            {"auto_wrap_policy": "SIZE_BASED_WRAP"},
            r"hf.training_args.fsdp_config.auto_wrap_policy 'SIZE_BASED_WRAP': trainer hf models",
        ),
        ({"cpu_ram_efficient_loading": True}, r"fsdp_config.cpu_ram_efficient_loading True: not modelled"),
        ({"forward_prefetch": True}, r"hf.training_args.fsdp_config.forward_prefetch True: not modelled"),
    ],
    ids=["fsdp1", "offload", "size-wrap", "ram-efficient", "fsdp1-key"],
)
def test_what_fsdp_cannot_say_is_one_line_naming_it(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(scenario(TINY, None, FSDP | {"fsdp_config": config}))
    assert len(info.value.problems) == 1 and "\n" not in str(info.value.problems[0]), info.value.problems


def test_accelerates_fsdp2_template_at_its_off_values_is_taken() -> None:
    """accelerate's FSDP2 template writes keys whose off values send nothing different (offload and RAM-
    efficient loading off, the state dict type read only when saving): taken, not refused one at a time
    (found by an adversarial pass); on, they are still refused (above)."""
    template = {
        "fsdp_version": 2,
        "fsdp_offload_params": False,
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": True,
    }
    (s,) = load_text(scenario(TINY, None, FSDP | {"fsdp_config": template}))
    assert s.parallelism.scheme == "fsdp"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"fsdp": "full_shard offload auto_wrap"}, r"hf.training_args.fsdp 'full_shard offload auto_wrap': offload"),
        ({"fsdp": "hybrid_shard auto_wrap"}, r"hf.training_args.fsdp 'hybrid_shard auto_wrap': hybrid_shard is not"),
        ({"fp16": True}, r"hf.training_args.fp16: true under FSDP2 is not modelled"),
    ],
    ids=["offload", "hybrid-shard", "fp16"],
)
def test_what_fsdp_arguments_cannot_say_is_one_line_naming_it(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(scenario(TINY, None, FSDP | args))
    assert len(info.value.problems) == 1 and "\n" not in str(info.value.problems[0]), info.value.problems


def test_fsdp_with_a_deepspeed_config_is_one_line() -> None:
    with pytest.raises(ScenarioError, match=r"hf.training_args.fsdp with hf.deepspeed .*ds_zero2.json: one of") as info:
        load_text(scenario(TINY, SUITE / "hf" / "ds_zero2.json", FSDP))
    assert len(info.value.problems) == 1 and "\n" not in str(info.value.problems[0]), info.value.problems


@pytest.mark.parametrize(
    "args",
    [
        {"bf16": True, "fsdp": "full_shard auto_wrap"},
        {"fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False}},
        {"gradient_accumulation_steps": 2},
        {"fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True}},
        # no clipping: Trainer still computes the norm, all-reducing the per-parameter norms (found by an
        # adversarial pass: the model left them out, 304 B a step unexplained)
        {"max_grad_norm": 0},
    ],
    ids=["bf16", "no-reshard", "accumulation-2", "activation-checkpointing", "no-clipping"],
)
def test_fsdp2_as_trainer_runs_it_reconciles(args: dict[str, Any], tmp_path: Path) -> None:
    """bf16 (the legacy ``fsdp`` string): accelerate's MixedPrecisionPolicy (gathers and reduce-scatters in
    bf16 over fp32 parameters); ``reshard_after_forward: false``: no group gathers again for its backward;
    gradient accumulation 2: every micro-batch gathers, one reduce-scatter a step (accelerate's ``no_sync``,
    which takes its FSDP2 path only with W5's type in ``PartialState`` too); accelerate's activation
    checkpointing (each decoder layer in torch's checkpoint_wrapper): its recompute gathers nothing more."""
    result = run(scenario(TINY, None, FSDP | args), tmp_path)
    reconciled(result)
    f = result.prediction.scenario.parallelism.fsdp
    assert (f.param_dtype, f.reduce_dtype) == (("bf16", "bf16") if args.get("bf16") else (None, None))


def test_a_model_shipped_in_bf16_trained_without_bf16_reconciles(tmp_path: Path) -> None:
    """A config with ``torch_dtype: bfloat16`` (Qwen2, Llama 3, Mistral ship so) under FSDP2 without ``bf16``: the
    parameters stay bf16, and so do the gradients whose per-parameter norms Trainer all-reduces (they were
    predicted fp32: a false failure, found by an adversarial pass)."""
    config = tmp_path / "shipped-bf16.json"
    config.write_text(json.dumps(json.loads(TINY.read_text()) | {"torch_dtype": "bfloat16"}))
    result = run(scenario(config, None, FSDP), tmp_path)
    reconciled(result)
    (norms,) = [c for c in result.prediction.collectives if "per-parameter norms" in c.source]
    assert (result.prediction.scenario.model.dtype, norms.dtype) == ("bf16", "bf16")


def test_a_tied_embedding_is_one_group_with_the_tail_and_reconciles(tmp_path: Path) -> None:
    """``tie_word_embeddings``: accelerate puts the shared weight in the tail group, the input embeddings first
    (``fsdp_utils.py:866-879``): no group of their own, the tail one parameter short."""
    config = tmp_path / "tied.json"
    config.write_text(json.dumps(json.loads(TINY.read_text()) | {"tie_word_embeddings": True}))
    (s,) = load_text(scenario(config, None, FSDP))
    assert [u.name for u in hf.units(s)][-1] == "tail (final norm, output embeddings)"
    assert "input embeddings" not in [u.name for u in hf.units(s)]
    reconciled(run(scenario(config, None, FSDP), tmp_path))


def test_a_layer_class_accelerate_cannot_find_in_the_model_is_refused_as_it_loads() -> None:
    """A class of the model's own modeling module that is not one of its layers (``LlamaForSequenceClassification``
    in ``transformer_layer_cls_to_wrap``): accelerate's wrapping cannot find it in the model, which was said as
    the scenario was predicted and stopped the whole run there, its report half-written (found by an
    adversarial pass). It is said as the scenario loads, in one line."""
    args = FSDP | {
        "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaForSequenceClassification"]}
    }
    with pytest.raises(ScenarioError) as info:
        load_text(scenario(TINY, None, args))
    (problem,) = info.value.problems
    assert problem.path == "$.hf" and "\n" not in str(info.value)
    assert problem.message.startswith(
        "hf.training_args.fsdp_config.transformer_layer_cls_to_wrap ['LlamaForSequenceClassification']: Could not "
        "find the transformer layer class LlamaForSequenceClassification in the model. (LlamaForCausalLM wraps "
    ), problem.message
