"""A scenario's ``deepspeed:`` block: DeepSpeed's own config keys (a mapping, or the path of a DeepSpeed
JSON file relative to the scenario), merged over the few keys commgate writes itself
(``commgate.run.workloads.zero.ds_config``).

Every key is one of three kinds, read from DeepSpeed 0.19's config (``runtime/config.py``,
``runtime/zero/config.py``):

* **mapped**: what the scenario also states (ZeRO stage, bucket sizes, micro-batch size and count,
  train batch size, bf16/fp16, hpZ). The block's value sets the scenario's field, or contradicts it in
  one line naming both;
* **communication keys the model follows only at one value**: another value is a one-line error naming
  the key (the model would be wrong), unless the scenario turns the model check off;
* **everything else DeepSpeed knows** (optimizer, scheduler, logging, checkpointing ...): passed through.

A top-level key DeepSpeed does not know is a warning with the closest known key ("did you mean ..."):
DeepSpeed ignores it. One under ``zero_optimization`` is an error, as DeepSpeed 0.19's pydantic config
forbids extra fields and refuses the whole config. Real configs carry such typos, e.g. GPT-NeoX's 13B
ZeRO-3 config spells ``stage3_param_persitance_threshold`` (``commgate import`` leaves it out, saying so).
Pure Python: nothing here imports DeepSpeed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from commgate.core.fsutil import beside, read_json_object

TOP_LEVEL = frozenset(
    {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
        "scheduler", "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
        "gradient_predivide_factor", "sparse_gradients", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
        "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
        "activation_checkpointing", "sparse_attention", "data_efficiency", "curriculum_learning", "monitor_config",
        "tensorboard", "wandb", "csv_monitor", "comet", "elasticity", "aio", "autotuning", "checkpoint",
        "data_types", "pipeline", "compression_training", "comms_logger", "timers", "nebula",
        "weight_quantization", "hybrid_engine", "disable_allgather", "dataloader_drop_last", "load_universal",
        "use_node_local_storage", "graph_harvesting", "compile", "zenflow", "eigenvalue", "progressive_layer_drop",
        "quantize_training", "mics_shard_size", "mics_hierarchical_params_gather", "use_data_before_expert_parallelism",
        "expert_parallel", "tensor_parallel", "sequence_parallel_size", "checkpoint_in_cpu", "gradient_allreduce_op",
    }
)  # fmt: skip
"""Top-level keys of DeepSpeed's config (its documented config-json keys)."""

ZERO = frozenset(
    {
        "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
        "reduce_bucket_size", "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
        "offload_param", "offload_optimizer", "sub_group_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "elastic_checkpoint",
        "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
        "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
        "enable_sanity_checks", "parameter_alignment", "load_from_fp32_weights", "leaf_module",
        "use_multi_rank_bucket_allreduce",
        "compute_grad_norm", "save_muon_momentum_buffer_in_memory", "zenflow", "mics_shard_size",
        "mics_hierarchical_params_gather",
    }
)  # fmt: skip
"""Keys of ``zero_optimization`` (``DeepSpeedZeroConfig``'s fields and aliases; a test keeps them in step)."""


def _absent(value: Any, stage: int) -> bool:
    return False


def _cpu_offload(value: Any, stage: int) -> bool:
    """ZeRO-Offload to the CPU, whole (measured on CPU gloo: ZeRO-1/2 send the same; ZeRO-3 all-reduces its
    gradient norm in fp32 instead of float64 when the optimizer is offloaded, ``offloads_optimizer``)."""
    return (
        isinstance(value, Mapping)
        and value.get("device", "none") in ("none", "cpu")
        and value.get("ratio", 1) in (1, 1.0)
    )


def _bool(value: Any, stage: int) -> bool:
    return isinstance(value, bool)


def _is(expected: Any) -> Callable[[Any, int], bool]:
    return lambda value, stage: value == expected


def _count(value: Any, stage: int) -> bool:
    """A number of elements (``commgate.model.schemes.zero3_fetch`` replays the coordinator with it), or
    ``"auto"``: commgate's own workloads leave it out, so DeepSpeed's default, which the replay takes too."""
    return value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0)


MODELLED: dict[tuple[str, ...], tuple[Callable[[Any, int], bool], str, str]] = {
    ("zero_optimization", "round_robin_gradients"): (_is(False), "false", "round-robin gradient partitioning"),
    ("zero_optimization", "use_multi_rank_bucket_allreduce"): (_is(True), "true", "per-rank bucket reduces"),
    ("zero_optimization", "stage3_prefetch_bucket_size"): (_count, "a count", "ZeRO-3 parameter prefetching"),
    ("zero_optimization", "stage3_param_persistence_threshold"): (_count, "a count", "ZeRO-3 persistent parameters"),
    ("zero_optimization", "stage3_model_persistence_threshold"): (_count, "a count", "ZeRO-3 persistence"),
    ("zero_optimization", "stage3_max_live_parameters"): (_count, "a count", "ZeRO-3 live-parameter limits"),
    ("zero_optimization", "stage3_max_reuse_distance"): (_count, "a count", "ZeRO-3 parameter reuse"),
    ("zero_optimization", "stage3_use_all_reduce_for_fetch_params"): (_is(False), "false", "all-reduce fetches"),
    # ZeRO-3 all-reduces the norm once per optimizer sub-group (deepspeed_zero.sub_groups); stages 1-2 ignore it
    ("zero_optimization", "sub_group_size"): (
        lambda v, stage: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1,
        "a count >= 1",
        "optimizer sub-groups",
    ),
    # DeepSpeed's default, false, is what a ZeRO++ template often writes out (found by an adversarial pass);
    # commgate's own workloads run qwZ and qgZ from parallelism.zero (scheme zero++)
    ("zero_optimization", "zero_quantized_weights"): (
        _is(False),
        "false",
        "qwZ set in the deepspeed block (set parallelism.zero.qwz: true under scheme zero++)",
    ),
    ("zero_optimization", "zero_quantized_gradients"): (
        _is(False),
        "false",
        "qgZ set in the deepspeed block (set parallelism.zero.qgz: true under scheme zero++)",
    ),
    ("zero_optimization", "offload_optimizer"): (
        _cpu_offload,
        "device none or cpu, the whole of it",
        "optimizer offload to NVMe or in part",
    ),
    ("zero_optimization", "offload_param"): (
        _cpu_offload,
        "device none or cpu, the whole of it",
        "parameter offload to NVMe or in part",
    ),
    ("zero_optimization", "cpu_offload"): (_bool, "true or false", "optimizer offload"),
    ("zero_optimization", "cpu_offload_param"): (_bool, "true or false", "parameter offload"),
    # measured: ZeRO-1/2/3 reduce the gradients in it, same buckets (MoE and the pipeline: see scenario.py)
    ("communication_data_type",): (
        lambda v, stage: isinstance(v, str) and v.lower() in ("fp32", "fp16", "bf16"),  # DeepSpeed lower-cases it
        "fp32, fp16 or bf16, any case",
        "this communication dtype",
    ),
    ("prescale_gradients",): (_is(False), "false", "gradient prescaling"),
    # accepted in silence and predicted wrong, each measured or read upstream (found by an adversarial pass):
    # torch_autocast tags Linear parameters with its dtype, which ZeRO reduces them in (runtime/torch_autocast.py)
    ("torch_autocast", "enabled"): (_is(False), "false", "DeepSpeed's torch_autocast (Linear gradients in its dtype)"),
    ("zero_optimization", "compute_grad_norm"): (_is(True), "true", "ZeRO without its gradient-norm all-reduce"),
    ("zero_optimization", "stage3_allgather_sequential"): (
        _is(False),
        "false",
        "ZeRO-3's one-by-one parameter all-gathering",
    ),
    ("zero_optimization", "stage3_module_granularity_threshold"): (_is(0), "0", "ZeRO-3 leaf modules by size"),
    ("zero_optimization", "leaf_module"): (
        lambda v, stage: isinstance(v, Mapping) and not any(v.get(k) for k in ("classes", "names", "name_suffixes")),
        "no classes, names or name_suffixes",
        "ZeRO-3 leaf modules",
    ),
    ("tensor_parallel", "autotp_size"): (lambda v, stage: v in (0, 1), "0 or 1", "DeepSpeed AutoTP"),
    ("pipeline", "pipe_partitioned"): (_absent, "left out", "partitioned pipeline activations"),
    ("pipeline", "grad_partitioned"): (_absent, "left out", "partitioned pipeline gradients"),
}
"""Keys that change communication: which values the model follows, in words, and what another value
changes. Measured on CPU gloo to send nothing different, and so accepted at any value:
``contiguous_gradients`` and ``reduce_scatter`` (modelled: without either an oversized gradient is
all-reduced whole), ``allgather_partitions``, ``allgather_bucket_size`` (torch >= 1.13 gathers in one call),
``gradient_clipping``, and ``overlap_comm`` at stages 2 and 3 and in the pipeline engine. ``overlap_comm`` at
ZeRO-1 (and MoE's) reduces in the backward hooks, in gradient-ready order (``deepspeed_zero.in_hooks``)."""

Problem = Callable[[list[str | int], str], None]


def load(block: Any, *, scenario_file: str | None) -> dict[str, Any]:
    """The block as a mapping: itself, or the JSON file it names (relative to the scenario file)."""
    if not isinstance(block, str):
        return dict(block)
    return read_json_object(beside(scenario_file, block), "DeepSpeed JSON config")


SECTIONS = frozenset(
    {
        "zero_optimization", "bf16", "bfloat16", "fp16", "amp", "torch_autocast", "data_types", "pipeline",
        "optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "comms_logger", "tensorboard",
        "wandb", "csv_monitor", "comet", "monitor_config", "aio", "autotuning", "checkpoint", "compile",
        "elasticity", "sparse_attention", "data_efficiency", "curriculum_learning", "compression_training",
        "hybrid_engine", "nebula", "weight_quantization", "timers", "tensor_parallel",
    }
)  # fmt: skip
"""Top-level keys DeepSpeed reads as mappings (anything else there fails inside its config)."""


def not_mappings(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, message) per section given as something other than a mapping (``bf16: yes``, a list)."""
    return [
        (k, f"{cfg[k]!r} is a {type(cfg[k]).__name__}; DeepSpeed reads {k} as a mapping of its keys")
        for k in sorted(SECTIONS & set(cfg))
        if not isinstance(cfg[k], Mapping)
    ]


SWITCHES = ("fp16", "bf16", "bfloat16")
"""Sections whose ``enabled`` sets the precision the model follows."""


def not_switches(cfg: Mapping[str, Any]) -> list[tuple[tuple[str, str], str]]:
    """(key path, message) per ``enabled`` of a precision section that is neither a boolean nor ``"auto"``:
    DeepSpeed's pydantic config coerces ``1`` and ``"yes"`` to true, and a model reading only ``true`` would
    predict fp32 for a bf16 run."""
    out = []
    for k in SWITCHES:
        section = cfg.get(k)
        value = section.get("enabled", False) if isinstance(section, Mapping) else False
        if not isinstance(value, bool) and value != "auto":
            why = f'{value!r} is not a boolean (DeepSpeed would read it as one); write true or false, or "auto"'
            out.append(((k, "enabled"), why))
    return out


def _closest(key: str, known: frozenset[str], where: str) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {where}{close[0]}?" if close else ""


def unknown_keys(cfg: Mapping[str, Any]) -> list[str]:
    """One warning per top-level key DeepSpeed does not know (its config ignores them), with the closest
    known key."""
    return [
        f"deepspeed.{k}: DeepSpeed has no such key (it would be ignored){_closest(k, TOP_LEVEL, '')}"
        for k in cfg
        if k not in TOP_LEVEL
    ]


PARAM_OFFLOAD = ("offload_param", "cpu_offload_param")
"""``zero_optimization`` keys only ZeRO-3 reads: stages 1 and 2 (``stage_1_and_2.py``) take no parameter
offload, and the engine hands its config to the ZeRO-3 optimizer alone (and, with ``compile.deepcompile``,
to DeepCompile's offload pass, ``runtime/engine.py``)."""


def inert_keys(cfg: Mapping[str, Any], stage: int) -> list[str]:
    """One warning per parameter-offload key set at a stage that does not read it: the job offloads nothing,
    whatever the config says (found by an adversarial pass: taken in silence at ZeRO-2)."""
    zo, compiled = cfg.get("zero_optimization"), cfg.get("compile")
    if isinstance(compiled, Mapping) and compiled.get("deepcompile"):  # DeepCompile offloads them at stages 1-2
        return []
    if stage >= 3 or not isinstance(zo, Mapping):
        return []
    return [
        f"deepspeed.zero_optimization.{k}: parameter offload is ZeRO-3's; at stage {stage} DeepSpeed does not read "
        "it, and offloads no parameter"
        for k in PARAM_OFFLOAD
        if zo.get(k) not in (None, False) and not (isinstance(zo.get(k), Mapping) and zo[k].get("device") == "none")
    ]


REMOVED = frozenset(
    {
        "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting",
        "nebula", "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
    }
)  # fmt: skip
"""Top-level keys DeepSpeed 0.19 refuses whatever their value: their features were removed
(``runtime/config.py``'s ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``; a test keeps this equal to it)."""
REMOVED_ZERO = frozenset({"mics_hierarchical_params_gather", "mics_shard_size", "zeropp_loco_param"})
"""The same in ``zero_optimization`` (``_REMOVED_ZERO_CONFIG_KEYS``)."""


def refused_keys(cfg: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """(key path, message) per key DeepSpeed refuses the config for, whatever its value: a feature it removed
    (``REMOVED``, ``REMOVED_ZERO``), or a ``zero_optimization`` key it does not know (its pydantic config
    forbids extra fields: ``extra_forbidden``), with the closest known key."""
    removed = "DeepSpeed removed this feature and refuses a config that names it, at any value: leave it out"
    out: list[tuple[tuple[str, ...], str]] = [((k,), removed) for k in cfg if k in REMOVED]
    zo = cfg.get("zero_optimization", {})
    if not isinstance(zo, Mapping):
        return out
    unknown = "DeepSpeed has no such key and refuses the config (extra fields forbidden)"
    for k in zo:
        if k in REMOVED_ZERO:
            out.append((("zero_optimization", k), removed))
        elif k not in ZERO and k in TOP_LEVEL:  # misplaced, a real key elsewhere (found by an adversarial pass)
            out.append(
                (("zero_optimization", k), f"{unknown}; {k} is a top-level key: move it out of zero_optimization")
            )
        elif k not in ZERO:
            out.append((("zero_optimization", k), unknown + _closest(k, ZERO, "")))
    return out


def violations(cfg: Mapping[str, Any], stage: int) -> list[tuple[tuple[str, ...], Any, str, str]]:
    """(key path, value, what the model follows, what the value changes) of every communication key set
    to a value the model does not follow."""
    out = []
    for path, (follows, expected, what) in MODELLED.items():
        node: Any = cfg
        for part in path:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            if not follows(node, stage):
                out.append((path, node, expected, what))
    return out


def unmodelled(cfg: Mapping[str, Any], stage: int, bad: Problem) -> None:
    """One problem per communication key set to a value the model does not follow."""
    for path, value, expected, what in violations(cfg, stage):
        bad(
            ["deepspeed", *path],
            f"{value!r}: {what} is not modelled yet (the model follows {expected}); "
            "expectations: {model: {check: false}} runs it as a baseline-only gate",
        )


def enabled(cfg: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` (``bf16``, ``fp16``) is enabled; ``"auto"`` (Hugging Face's placeholder) is not."""
    section = cfg.get(key)
    return isinstance(section, Mapping) and section.get("enabled", False) is True


DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
"""``data_types.grad_accum_dtype``'s spellings (DeepSpeed's ``DtypeEnum``), as commgate's dtype names."""


def grad_accum_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    """The dtype DeepSpeed accumulates gradients in: ``data_types.grad_accum_dtype``, else the
    parameters' (``engine.get_data_types``)."""
    section = cfg.get("data_types")
    value = section.get("grad_accum_dtype") if isinstance(section, Mapping) else None
    return DTYPES.get(str(value), dtype) if value is not None else dtype


def optimizer(cfg: Mapping[str, Any], dtype: str, stage: int, *, pipeline: bool) -> str | None:
    """The optimizer wrapper DeepSpeed's engine puts around the client optimizer
    (``engine._do_optimizer_sanity_check``): ``"BF16_Optimizer"`` for bf16 parameters with fp32
    accumulation at ZeRO-1 and for bf16 without ZeRO in the pipeline engine, ``"ZeRO"`` at any other
    stage >= 1, ``"FP16_Optimizer"`` for 16-bit parameters without ZeRO (bf16 too, outside the pipeline),
    None for fp32 without ZeRO. Raises ValueError for a mix DeepSpeed refuses."""
    acc = grad_accum_dtype(cfg, dtype)
    if stage >= 1:
        return "BF16_Optimizer" if (dtype, acc, stage) == ("bf16", "fp32", 1) else "ZeRO"
    if acc != dtype:
        raise ValueError(f"{acc}: DeepSpeed accumulates {dtype} gradients without ZeRO only in {dtype}")
    if dtype == "fp32":
        return None
    return "BF16_Optimizer" if dtype == "bf16" and pipeline else "FP16_Optimizer"


def offloads_optimizer(cfg: Mapping[str, Any]) -> bool:
    """ZeRO-Offload of the optimizer to the CPU (``offload_optimizer: {device: cpu}``, or the older
    ``cpu_offload: true``)."""
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, Mapping):
        return False
    off = zo.get("offload_optimizer")
    return zo.get("cpu_offload") is True or (isinstance(off, Mapping) and off.get("device") == "cpu")


def autos(cfg: Mapping[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of the config's ``"auto"`` values (Hugging Face's placeholder for what the trainer fills in)."""
    out: list[tuple[str, ...]] = []
    for key, value in cfg.items():
        if isinstance(value, Mapping):
            out += autos(value, (*path, str(key)))
        elif value == "auto":
            out.append((*path, str(key)))
    return out


def given(value: Any) -> bool:
    """A value the config states (Hugging Face's ``"auto"`` leaves it to the trainer: for commgate's own
    workloads, the scenario; a ``trainer: hf`` scenario has none left, its trainer resolved them as
    Hugging Face's Trainer does, ``commgate.model.trainers.hf``)."""
    return bool(value != "auto")
