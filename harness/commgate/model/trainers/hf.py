"""Hugging Face ``transformers.Trainer`` as commgate's trainer ``hf`` (transformers 5.23, accelerate 1.15,
DeepSpeed 0.19): the job described by its own inputs, the scenario completed from them, and what Trainer
itself sends.

The scenario names the job as its user runs it (``hf:``): the model's ``config.json`` (built with
``AutoModelForCausalLM.from_config``), the DeepSpeed JSON handed to ``TrainingArguments(deepspeed=...)``
with its ``"auto"`` values, and the ``TrainingArguments`` fields that change what is sent. ``derive``
resolves every ``"auto"`` with transformers' and accelerate's own code, in the order Trainer runs it
(``resolution``, ``LAYERS``), and completes the document: the model (read off the Hugging Face model on the meta device,
``model``), the scheme (DDP, the ZeRO stage of the config, or ``fsdp`` for ``fsdp``/``fsdp_config``), the
batch, the dtype, the resolved ``deepspeed:`` block, and ``hf.training_args`` as Trainer holds them.
``derived`` lists what was decided, one line each, for the prediction and the result.

What it sends is the scheme's components fed by that model (DDP with Trainer's
``find_unused_parameters``; ZeRO-3 built under ``deepspeed.zero.Init``, as ``from_config`` does after
``TrainingArguments`` names a ZeRO-3 config), plus ``Construction`` (transformers' weight initialisation
under ZeRO-3) and ``TrainerCalls`` (the token count, logging and token tracking gathers of Trainer itself);
under FSDP2, ``AccelerateFullyShard`` in place of the scheme's (accelerate's own groups, ``units``, and
Trainer's clip-norm all-reduce) with ``TrainerCalls``.
What is not modelled is refused in one line: checkpoint saving, evaluation, DeepSpeed without ZeRO or
without an ``optimizer`` section (Trainer's own AdamW keeps two parameter groups, which the ZeRO models do
not split yet), activation checkpointing (but FSDP2's own), a tied embedding or bf16/fp16 under ZeRO-3, FSDP1,
offload, hybrid sharding, ``cpu_ram_efficient_loading`` and fp16 under FSDP, sweeps and emulation.

transformers, accelerate (and torch) are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from commgate.core import env
from commgate.core.errors import CommgateError
from commgate.core.fsutil import beside, read_json_object
from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.scenario import Scenario
from commgate.model.schemes._common import padded
from commgate.model.schemes.ddp import DistributedDataParallel
from commgate.model.schemes.deepspeed_zero import DeepSpeedZero3
from commgate.model.schemes.scheme import Component, Rule, Scheme

SCHEME_OF_STAGE: dict[int | None, str] = {None: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
"""The scheme a job runs as: torch DDP without a DeepSpeed config, else its ZeRO stage's."""

TRAINING_ARGS: dict[str, dict[str, Any]] = {
    "per_device_train_batch_size": {"type": "integer", "minimum": 1, "description": "the micro-batch b"},
    "gradient_accumulation_steps": {"type": "integer", "minimum": 1, "description": "micro-batches per step m"},
    "max_grad_norm": {"type": "number", "minimum": 0, "description": "fills gradient_clipping"},
    "learning_rate": {"type": "number", "description": "fills the optimizer's and scheduler's lr"},
    "weight_decay": {"type": "number"},
    "adam_beta1": {"type": "number"},
    "adam_beta2": {"type": "number"},
    "adam_epsilon": {"type": "number"},
    "warmup_steps": {"type": "number", "minimum": 0, "description": "the learning rate's warm-up (not commgate's)"},
    "lr_scheduler_type": {"type": "string"},
    "bf16": {"type": "boolean", "description": "DeepSpeed: bf16 parameters; DDP: autocast"},
    "fp16": {"type": "boolean"},
    "logging_steps": {"type": "integer", "minimum": 1, "description": "two all-gathers on each logging step"},
    "logging_strategy": {"enum": ["steps", "no"]},
    "logging_first_step": {"type": "boolean"},
    "average_tokens_across_devices": {"type": "boolean", "description": "the token count's all-gather each step"},
    "include_num_input_tokens_seen": {"enum": ["no", "all", "non_padding", True, False]},
    "ddp_find_unused_parameters": {"type": ["boolean", "null"], "description": "null: Trainer's choice"},
    "ddp_bucket_cap_mb": {"type": ["integer", "null"], "minimum": 1},
    "activation_checkpointing": {"type": ["boolean", "null"]},
    "gradient_checkpointing": {"type": ["boolean", "null"]},
    "save_strategy": {"type": "string", "description": "no: checkpoint saving is not modelled"},
    "eval_strategy": {"type": "string", "description": "no: evaluation is not modelled"},
    "seed": {
        "type": "integer",
        "minimum": 0,
        "maximum": 4294967295,
        "description": "Trainer's set_seed: numpy's seeds, 0 to 2**32 - 1 (another fails the job as it starts)",
    },
    "fsdp": {
        "type": ["boolean", "string", "null"],
        "description": "FSDP through accelerate's plugin (true, or the legacy 'full_shard auto_wrap'); FSDP2 only",
    },
    "fsdp_config": {
        "type": ["object", "null"],
        "description": "FSDP2's settings (the fsdp_ prefix allowed): version 2, reshard_after_forward, "
        "auto_wrap_policy TRANSFORMER_BASED_WRAP, transformer_layer_cls_to_wrap, activation_checkpointing; the "
        "others refused in one line",
    },
}
"""The ``TrainingArguments`` fields a scenario may set (those that change what is sent, and those that fill
an ``"auto"``), with their JSON Schemas."""

OPTIONS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["config"],
    "description": "A Hugging Face Trainer job (trainer: hf), described by its own inputs; paths are relative to "
    "the scenario file. The loader completes the scenario from them: model, parallelism, deepspeed.",
    "properties": {
        "config": {"type": "string", "description": "the model's config.json (AutoModelForCausalLM.from_config)"},
        "deepspeed": {
            "type": "string",
            "description": 'the DeepSpeed JSON handed to TrainingArguments(deepspeed=...), "auto" allowed; '
            "absent: torch DDP",
        },
        "training_args": {
            "type": "object",
            "additionalProperties": False,
            "properties": TRAINING_ARGS,
            "description": "TrainingArguments fields; the others keep transformers' defaults",
        },
    },
}


# ------------------------------------------------------------------------------------------ the inputs


path = beside
"""A file the ``hf:`` block names: relative to the scenario file."""


def _read_json(p: Path, what: str, where: str) -> dict[str, Any]:
    try:
        return read_json_object(p, what)
    except ValueError as exc:
        raise CommgateError(f"{where} {exc}") from None


def fixed_arguments(steps: int) -> dict[str, Any]:
    """What commgate sets in ``TrainingArguments`` whatever the scenario says: CPU ranks (W2: without
    ``use_cpu`` a CPU-only host gets no distributed backend, accelerate ``state.py:800-815``; a rank on a
    GPU sets it off, not measured), ``steps`` optimizer steps, nothing saved, evaluated or reported."""
    return {
        "use_cpu": True,
        "max_steps": steps,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def arguments(block: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The keyword arguments of the job's ``TrainingArguments`` (no ``output_dir``, no ``deepspeed``)."""
    return dict(block.get("training_args", {})) | fixed_arguments(steps)


@dataclass(frozen=True, slots=True)
class Change:
    """One key of the DeepSpeed config as a layer of Trainer's set-up changed it."""

    key: str
    """Dotted: ``zero_optimization.reduce_bucket_size``."""
    before: Any
    """Its value before (``"auto"``; ``MISSING`` when absent)."""
    after: Any
    by: str
    """The layer, with its upstream place."""


MISSING = "(absent)"


@dataclass(frozen=True, slots=True)
class Resolution:
    config: dict[str, Any] | None
    """The DeepSpeed config Trainer hands ``deepspeed.initialize`` (None: no DeepSpeed)."""
    changes: tuple[Change, ...]
    args: dict[str, Any]
    """``TRAINING_ARGS`` as the resolved ``TrainingArguments`` hold them."""
    hidden_size: int | None


LAYERS = (
    "TrainingArguments: trainer_config_process",
    "accelerate DeepSpeedPlugin",
    "accelerate set_mixed_precision",
    "Trainer: trainer_config_finalize",
    "accelerate Accelerator._prepare_deepspeed",
)
"""Trainer's set-up of a DeepSpeed config, in order (transformers 5.23.0, accelerate 1.15.0):
``TrainingArguments.__post_init__`` runs ``HfTrainerDeepSpeedConfig.trainer_config_process``
(``training_args.py:1704-1715``, ``integrations/deepspeed.py:108-184``) and builds the ``DeepSpeedPlugin``
(``accelerate/utils/dataclasses.py:1264-1326``: leftover ``"auto"`` from its defaults, ``steps_per_print``
infinite); ``AcceleratorState`` calls its ``set_mixed_precision`` (``state.py:974-978``,
``dataclasses.py:1415-1446``); ``deepspeed_init`` runs ``trainer_config_finalize`` (``trainer.py:1729-1730``,
``integrations/deepspeed.py:186-263``: the hidden-size keys, the scheduler's steps); and
``Accelerator._prepare_deepspeed`` fills what is still ``"auto"`` (``accelerator.py:2179-2355``)."""


class _World:
    """The resolved ``TrainingArguments`` with ``world_size`` (a property reading the live process group,
    1 in a process without one) replaced by the job's."""

    def __init__(self, args: Any, world_size: int) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "world_size", world_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def _changes(before: Mapping[str, Any], after: Mapping[str, Any], by: str) -> list[Change]:
    a, b = _flat(before), _flat(after)
    return [
        Change(key=k, before=a.get(k, MISSING), after=b.get(k, MISSING), by=by)
        for k in list(a) + [k for k in b if k not in a]
        if a.get(k, MISSING) != b.get(k, MISSING)
    ]


def hidden_size(cfg: Any) -> int | None:
    """The hidden size transformers reads for the ``"auto"`` bucket keys (``integrations/deepspeed.py:210-230``:
    ``hidden_size``, else the largest of ``hidden_sizes``, else the text config's)."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if hasattr(c, "hidden_size"):
            return int(c.hidden_size)
        if hasattr(c, "hidden_sizes"):
            return int(max(c.hidden_sizes))
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' and accelerate's global state left as it was: ``HfTrainerDeepSpeedConfig`` registers a
    process-global weak reference (``integrations/deepspeed.py:79``; while it lives, ``from_config`` builds
    under ``deepspeed.zero.Init``) and ``TrainingArguments(use_cpu=True)`` makes accelerate's
    ``PartialState`` singleton. Where that state is made here, a launcher's variables (a stray ``WORLD_SIZE``
    left from another job, or this run's own ranks') are hidden from it: the resolution is of the scenario's
    ranks (``_World``), not of this process, and accelerate would otherwise set up a distributed state."""
    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    fresh = not PartialState._shared_state
    hidden = {k: os.environ.pop(k) for k in env.LAUNCHER_VARIABLES if k in os.environ} if fresh else {}
    try:
        yield
    finally:
        os.environ.update(hidden)
        unset_hf_deepspeed_config()
        if fresh:
            AcceleratorState._reset_state(reset_partial_state=True)


def _one_line(exc: Exception) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


@functools.cache
def _resolved(ds_text: str | None, config_text: str, world: int, args_text: str) -> Resolution:
    """The DeepSpeed config (JSON text, or None) as Trainer resolves it on ``world`` ranks for the model of
    ``config_text`` and ``TrainingArguments(**args)``, by transformers' and accelerate's own code in
    Trainer's order (``LAYERS``), and the arguments as Trainer holds them."""
    from transformers import AutoConfig, TrainingArguments

    with _quiet(), tempfile.TemporaryDirectory() as tmp:
        try:
            cfg = AutoConfig.for_model(**json.loads(config_text))
            ta = TrainingArguments(output_dir=tmp, **json.loads(args_text))
        except (ValueError, TypeError, KeyError) as exc:
            raise CommgateError(_one_line(exc)) from None
        args = {k: getattr(getattr(ta, k), "value", getattr(ta, k)) for k in TRAINING_ARGS}  # enums as their values
        args["fsdp"], args["fsdp_config"] = _fsdp_args(ta)
        if args["ddp_find_unused_parameters"] is None:  # trainer.py:749-756, for a PreTrainedModel
            args["ddp_find_unused_parameters"] = not (ta.activation_checkpointing or ta.gradient_checkpointing)
        if ds_text is None:
            return Resolution(config=None, changes=(), args=args, hidden_size=hidden_size(cfg))
        try:
            config, changes = _resolve_deepspeed(json.loads(ds_text), cfg, _World(ta, world))
        except (ValueError, TypeError, KeyError) as exc:
            raise CommgateError(f"transformers or accelerate refuse it: {_one_line(exc)}") from None
        return Resolution(config=config, changes=tuple(changes), args=args, hidden_size=hidden_size(cfg))


FSDP_MODELLED = (
    "version",
    "reshard_after_forward",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "activation_checkpointing",
)
"""The ``fsdp_config`` keys (``fsdp_`` prefix stripped) trainer hf follows; ``_refuse_fsdp`` refuses others."""
FSDP_INERT: dict[str, tuple[Any, ...]] = {
    "offload_params": (False, "false"),
    "cpu_ram_efficient_loading": (False, "false"),
    "state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT"),  # read when saving, which the job does not
    "sync_module_states": (False, "false"),
    "forward_prefetch": (False, "false"),
}
"""``fsdp_config`` keys (accelerate's FSDP2 template writes them) at values that change nothing a run of the
job sends: taken, as the keys the model follows are."""
FSDP_ITEMS = ("full_shard", "shard_grad_op", "auto_wrap")
"""The legacy ``fsdp`` string's items FSDP2 takes that the model follows (reshard after forward or not)."""


def _fsdp_args(ta: Any) -> tuple[bool, dict[str, Any] | None]:
    """``fsdp`` and ``fsdp_config`` as Trainer holds them after ``_process_fsdp_args``
    (``training_args.py:2775-2885``: the prefix stripped, the legacy string's items applied), the config cut
    to the keys that decide what is sent."""
    if not ta.fsdp_plugin_args:
        return False, None
    config = {k: ta.fsdp_config[k] for k in FSDP_MODELLED if k in ta.fsdp_config}
    plugin = ta.fsdp_plugin_args
    return True, config | {"version": plugin["fsdp_version"], "reshard_after_forward": plugin["reshard_after_forward"]}


def _refuse_fsdp(args: Mapping[str, Any]) -> None:
    """One-line errors for FSDP settings the model does not follow (as the scenario gives them)."""
    fsdp, config = args.get("fsdp"), args.get("fsdp_config") or {}
    if not fsdp:
        return
    where = "hf.training_args"
    items = fsdp.split() if isinstance(fsdp, str) else []
    if bad := [i for i in items if i not in FSDP_ITEMS]:
        raise CommgateError(
            f"{where}.fsdp {fsdp!r}: {bad[0]} is not modelled under trainer hf (FSDP2 over all ranks, nothing "
            f"offloaded: {', '.join(FSDP_ITEMS)})"
        )
    for key, value in config.items():
        name = key.removeprefix("fsdp_")
        if name == "version" and str(value) != "2":
            raise CommgateError(
                f"{where}.fsdp_config.{key} {value!r}: FSDP1 is not modelled (deprecated by transformers); use "
                "version 2 (FSDP2)"
            )
        if name == "auto_wrap_policy" and value != "TRANSFORMER_BASED_WRAP":
            raise CommgateError(
                f"{where}.fsdp_config.{key} {value!r}: trainer hf models accelerate's TRANSFORMER_BASED_WRAP "
                "(each decoder layer its own group) only"
            )
        if name in FSDP_INERT and value in FSDP_INERT[name]:
            continue
        if name not in FSDP_MODELLED:
            raise CommgateError(
                f"{where}.fsdp_config.{key} {value!r}: not modelled under trainer hf (it follows "
                f"{', '.join(FSDP_MODELLED)}); leave it out"
            )


def _resolve_deepspeed(ds: dict[str, Any], cfg: Any, args: _World) -> tuple[dict[str, Any], list[Change]]:
    """Trainer's set-up of a DeepSpeed config, layer by layer (``LAYERS``)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    snaps = [copy.deepcopy(ds)]
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(ds))
    hf.trainer_config_process(args)  # training_args.py:1711
    snaps.append(copy.deepcopy(hf.config))
    plugin = DeepSpeedPlugin(hf_ds_config=hf)  # training_args.py:1715
    snaps.append(copy.deepcopy(plugin.deepspeed_config))
    plugin.set_mixed_precision(args.mixed_precision)  # state.py:977
    snaps.append(copy.deepcopy(plugin.deepspeed_config))
    model = types.SimpleNamespace(config=cfg)  # trainer_config_finalize reads model.config only
    plugin.hf_ds_config.trainer_config_finalize(args, model, args.max_steps)  # deepspeed.py:642
    if "optimizer" not in plugin.deepspeed_config:
        plugin.deepspeed_config["zero_allow_untested_optimizer"] = True  # deepspeed.py:589
    snaps.append(copy.deepcopy(plugin.deepspeed_config))
    plugin.deepspeed_config_process(must_match=False, **_leftovers(plugin, cfg, args))  # accelerator.py:2223-2355
    snaps.append(copy.deepcopy(plugin.deepspeed_config))
    changes = [c for i, by in enumerate(LAYERS) for c in _changes(snaps[i], snaps[i + 1], by)]
    return snaps[-1], changes


def _leftovers(plugin: Any, cfg: Any, args: _World) -> dict[str, Any]:
    """What ``Accelerator._prepare_deepspeed`` fills of what is still ``"auto"``: the micro-batch from the
    train dataloader (``per_device_train_batch_size``), the train batch, clipping, the ZeRO-3 save flag, the
    hidden-size keys, the config optimizer's lr and weight decay (``DummyOptim``)."""
    gas = plugin.get_value("gradient_accumulation_steps")
    mb = plugin.get_value("train_micro_batch_size_per_gpu")
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        mb = args.per_device_train_batch_size
    kwargs: dict[str, Any] = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    if mb is not None:  # (a config without the key: accelerate leaves the batch keys alone)
        kwargs |= {"train_micro_batch_size_per_gpu": mb, "train_batch_size": mb * gas * args.world_size}
    keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    if any(plugin.is_auto(f"zero_optimization.{k}") for k in keys) and (h := hidden_size(cfg)) is not None:
        kwargs |= dict(zip((f"zero_optimization.{k}" for k in keys), (h * h, int(0.9 * h * h), 10 * h), strict=True))
    if "optimizer" in plugin.deepspeed_config:
        kwargs |= {"optimizer.params.lr": args.learning_rate, "optimizer.params.weight_decay": args.weight_decay}
    return kwargs


def resolution(scenario: Scenario) -> Resolution:
    """The scenario's job resolved (``derive`` did the same; cached)."""
    return _resolution(
        scenario.trainer_config, scenario.file, scenario.world_size, scenario.warmup_steps + scenario.steps
    )


def _resolution(block: Mapping[str, Any], file: str | None, world: int, steps: int) -> Resolution:
    config = _read_json(path(file, block["config"]), "Hugging Face config.json", "hf.config")
    cfg = _config_of(config, path(file, block["config"]))  # the config itself first: its problem names its file
    ds = (
        _read_json(path(file, block["deepspeed"]), "DeepSpeed JSON config", "hf.deepspeed")
        if "deepspeed" in block
        else None
    )
    where = f"hf.deepspeed {block['deepspeed']}" if ds is not None else "hf.training_args"
    try:
        res = _resolved(
            None if ds is None else json.dumps(ds, sort_keys=True),
            json.dumps(config, sort_keys=True),
            world,
            json.dumps(arguments(block, steps), sort_keys=True),
        )
    except CommgateError as exc:
        raise CommgateError(f"{where}: {exc}") from None
    _layers_to_wrap(res.args, cfg)
    return res


def _layers_to_wrap(args: Mapping[str, Any], cfg: Any) -> None:
    """``fsdp_config.transformer_layer_cls_to_wrap`` names classes of the model's own modeling module (else
    accelerate stops Trainer's FSDP2 wrapping: "Could not find the transformer layer class")."""
    names = (args.get("fsdp_config") or {}).get("transformer_layer_cls_to_wrap")
    if not args.get("fsdp") or not names:
        return
    cls = _model_class(cfg)
    module = sys.modules[cls.__module__]
    if missing := [n for n in ([names] if isinstance(names, str) else names) if not hasattr(module, n)]:
        layers = ", ".join(getattr(cls, "_no_split_modules", None) or ()) or "?"
        raise CommgateError(
            f"hf.training_args.fsdp_config.transformer_layer_cls_to_wrap {missing[0]!r}: {cls.__name__} has no "
            f"such layer; its decoder layers are {layers}"
        )


def finite(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without its non-finite numbers (accelerate always sets ``steps_per_print`` to infinity,
    ``utils/dataclasses.py:1326``; a scenario holds finite numbers only): the ``deepspeed:`` block."""
    return {k: finite(v) if isinstance(v, Mapping) else v for k, v in config.items() if _finite(v)}


# ------------------------------------------------------------------------------------------- derive


FROM_CONFIG = ("preset", "L", "h", "a", "V", "architecture", "kv_heads", "x", "ffn_hidden", "qkv_bias", "position")
"""The model's dimensions: a ``trainer: hf`` scenario's are its config.json's (read off the model itself)."""


def derive(doc: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The scenario of the job ``doc["hf"]`` describes (a block its schema holds: the loader checked it):
    every ``"auto"`` resolved as Trainer resolves it on ``parallelism.dp`` ranks, and the model, parallelism,
    dtype and ``deepspeed:`` block filled in. A document may state what is derived (``commgate import``
    writes it, to show it): it must then be what Trainer resolves."""
    block = doc.get("hf")
    if not isinstance(block, Mapping):
        raise CommgateError("missing: trainer hf reads the job from an hf block (hf: {config: config.json, ...})")
    _refuse_written(doc)
    dp = (doc.get("parallelism") or {}).get("dp")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise CommgateError(f"parallelism.dp {dp!r}: give the number of ranks the job runs on (a whole number >= 1)")
    _refuse_unmodelled_arguments(block.get("training_args", {}))
    default = {f.name: f.default for f in fields(Scenario)}
    counts = [doc.get(k, default[k]) for k in ("warmup_steps", "steps")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return dict(doc)  # the schema names them
    resolved = _resolution(block, file, dp, sum(counts))
    _refuse_unmodelled(block, resolved)
    _positions(doc["model"]["s"], _hf_config(path(file, block["config"])))
    filled = {
        "hf": {"training_args": _jsonable(resolved.args)},
        "parallelism": _parallelism(resolved),
        "model": _model(path(file, block["config"]), resolved),
    }
    _deepspeed_batch(block, resolved, dp)  # after what the model does not follow: DeepSpeed's own check last
    if resolved.config is not None:
        filled["deepspeed"] = finite(resolved.config)
    _agrees(doc, filled, block)
    out = dict(doc)
    for section, fields_ in filled.items():
        out[section] = fields_ if section == "deepspeed" else dict(doc.get(section) or {}) | fields_
    return out


def _jsonable(args: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (bool, int, float, str, type(None), dict)) else str(v) for k, v in args.items()}


def _positions(s: int, cfg: Any) -> None:
    """A model with learned absolute positions (GPT-2's ``n_positions``) embeds at most that many tokens: a
    longer ``model.s`` fails in the first forward ("index out of range"). Where the config names the limit
    ``max_position_embeddings`` (OPT, GPT-Neo, BioGPT; a rotary model's is no limit) and ``s`` passes it, the
    model built on the meta device says whether its positions are a learned table, and how many it holds."""
    limit = getattr(cfg, "n_positions", None)
    if isinstance(limit, int) and s > limit:
        raise CommgateError(
            f"model.s: {s} is longer than the model's learned positions (n_positions {limit} in hf.config): "
            f"give s <= {limit}"
        )
    most = getattr(cfg, "max_position_embeddings", None)
    if isinstance(most, int) and s > most and (table := _learned_positions(cfg)) is not None and s > table[1]:
        raise CommgateError(
            f"model.s: {s} is longer than the model's learned positions ({table[0]} holds {table[1]}; "
            f"max_position_embeddings {most} in hf.config): give s <= {table[1]}"
        )


def _learned_positions(cfg: Any) -> tuple[str, int] | None:
    """(name, positions) of the model's learned position table, built on the meta device: an embedding named for
    positions (``wpe``, ``embed_positions``, ``position_embeddings``), less its offset (OPT's 2); None if none."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    except Exception:  # the model's own measurement, as the scenario loads, says what fails to build, in one line
        return None
    tables = [
        (name, m.num_embeddings - int(getattr(m, "offset", 0)))
        for name, m in net.named_modules()
        if isinstance(m, torch.nn.Embedding) and ("pos" in (last := name.rsplit(".", 1)[-1]) or last == "wpe")
    ]
    return min(tables, key=lambda t: t[1]) if tables else None


def _refuse_written(doc: Mapping[str, Any]) -> None:
    """What a ``trainer: hf`` scenario cannot state (its model is its config.json) or be."""
    model: Mapping[str, Any] = doc["model"] if isinstance(doc.get("model"), Mapping) else {}
    par: Mapping[str, Any] = doc["parallelism"] if isinstance(doc.get("parallelism"), Mapping) else {}
    written = [f"model.{k}" for k in FROM_CONFIG if k in model]
    written += [f"parallelism.{k}" for k in ("zero", "activation_checkpointing") if k in par]
    written += [k for k in ("workload",) if k in doc]
    if written:
        raise CommgateError(
            f"{', '.join(written)}: trainer hf derives the job from hf (config, deepspeed, training_args); leave it out"
        )
    for key, why in (("sweep", "write one scenario per configuration"), ("emulate", "it runs on real ranks only")):
        if doc.get(key):
            raise CommgateError(f"{key}: not supported with trainer hf ({why})")
    # the schemes' own advice ("use scheme 'fsdp', 'tp', 'cp' or '3d'") is none a Trainer job can take: found by
    # an adversarial pass
    if dims := [f"parallelism.{k}: {par[k]}" for k in ("tp", "pp", "cp", "dp_replicate") if par.get(k, 1) != 1]:
        raise CommgateError(
            f"{', '.join(dims)}: trainer hf runs data parallelism only (DDP, DeepSpeed ZeRO or FSDP2 over dp ranks); "
            "leave it out"
        )
    if not isinstance(model.get("s"), int):
        raise CommgateError("model.s: give the sequence length the job trains with (model: {s: N})")
    if isinstance(doc.get("deepspeed"), str) or ("deepspeed" in doc and "deepspeed" not in doc["hf"]):
        raise CommgateError("deepspeed: trainer hf reads the DeepSpeed JSON from hf.deepspeed; name the file there")


def _agrees(doc: Mapping[str, Any], filled: Mapping[str, Mapping[str, Any]], block: Mapping[str, Any]) -> None:
    """Every derived field the document states is the one Trainer resolves (a scenario written by ``commgate
    import`` pins them: a change of the config files, or of transformers' resolution, is then named)."""
    wrong: list[tuple[str, str, Any, Any]] = []  # every section's, said at once (it named the first section's)
    for section, fields_ in filled.items():
        written = doc.get(section)
        if section == "hf" or not isinstance(written, Mapping):  # hf: the job's inputs, completed
            continue
        ours, theirs = _flat(written), _flat(fields_)
        # the deepspeed block's keys that Trainer does not resolve are named too; a key the block leaves out states
        # nothing (it was compared as "(absent)", so that the fix it named, to leave it out, failed: found by an
        # adversarial pass)
        keys = [k for k in ours if k in theirs or section == "deepspeed"]
        wrong += [(section, k, ours.get(k, MISSING), theirs.get(k, MISSING)) for k in keys
                  if ours.get(k, MISSING) != theirs.get(k, MISSING)]  # fmt: skip
    if wrong:
        section, k, stated, resolved = wrong[0]
        source = f"hf.deepspeed {block['deepspeed']}" if section == "deepspeed" else "hf"
        more = f" (and {len(wrong) - 1} more: {', '.join(f'{s}.{key}' for s, key, _, _ in wrong[1:])})"
        raise CommgateError(
            f"{section}.{k} is {_show(stated)} in the scenario, Trainer resolves {_show(resolved)} from {source}"
            + (more if len(wrong) > 1 else "")
            + "; leave it out, or write the scenario again (commgate import --trainer hf)"
        )


def _refuse_unmodelled_arguments(args: Mapping[str, Any]) -> None:
    """One-line errors for the arguments whose effect the model does not follow (yet), as the scenario gives
    them (before commgate's own, ``fixed_arguments``)."""
    for key, what in (("save_strategy", "checkpoint saving"), ("eval_strategy", "evaluation")):
        if args.get(key, "no") != "no":
            raise CommgateError(
                f"hf.training_args.{key} {args[key]!r}: {what} is not modelled (its collectives are not in the "
                "gate); set it to no"
            )
    _refuse_fsdp(args)
    if checkpointing := [k for k in ("activation_checkpointing", "gradient_checkpointing") if args.get(k)]:
        raise CommgateError(
            f"hf.training_args.{checkpointing[0]}: activation checkpointing under Trainer is not modelled yet; "
            "leave it out"
        )


def _refuse_unmodelled(block: Mapping[str, Any], r: Resolution) -> None:
    """One-line errors for a DeepSpeed config the model does not follow (yet)."""
    if r.config is None:
        return
    if r.args["fsdp"]:
        raise CommgateError(
            f"hf.training_args.fsdp with hf.deepspeed {block['deepspeed']}: one of them (accelerate runs one "
            "engine); leave the other out"
        )
    zo = r.config.get("zero_optimization")
    stage = zo.get("stage") if isinstance(zo, Mapping) else None
    if stage not in (1, 2, 3):
        raise CommgateError(
            f"hf.deepspeed {block['deepspeed']}: zero_optimization.stage {stage!r}: trainer hf runs ZeRO stages 1-3"
        )
    if "optimizer" not in r.config:
        raise CommgateError(
            f"hf.deepspeed {block['deepspeed']}: no optimizer section: Trainer's own AdamW keeps two parameter "
            "groups (decay, no decay), which the ZeRO models do not split yet; add an optimizer section "
            '(e.g. {"type": "AdamW", "params": {"lr": "auto", "torch_adam": true}})'
        )


def _deepspeed_batch(block: Mapping[str, Any], r: Resolution, world: int) -> None:
    """DeepSpeed's own check of the batch keys of the config Trainer hands it (``deepspeed/runtime/config.py``,
    ``_set_batch_related_parameters`` and ``_batch_assertion``), which fails the job in
    ``deepspeed.initialize``. A config without ``gradient_accumulation_steps`` holds 1 there: accelerate's
    ``DeepSpeedPlugin`` sets an absent one to 1 (``utils/dataclasses.py:1274``), whatever
    ``training_args.gradient_accumulation_steps`` is; Trainer still accumulates that many micro-batches,
    setting DeepSpeed's boundary itself, so only this check sees the 1."""
    if r.config is None:
        return
    file, c = block["deepspeed"], r.config
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    tbs, mb, gas = (c.get(k) for k in keys)
    if tbs is None and mb is None:
        raise CommgateError(
            f"hf.deepspeed {file}: neither train_batch_size nor train_micro_batch_size_per_gpu: DeepSpeed refuses the "
            'config Trainer hands it ("Either train_batch_size or train_micro_batch_size_per_gpu needs to be '
            f'provided"); add "train_micro_batch_size_per_gpu": "auto" to {file}'
        )
    if tbs is None or mb is None or tbs == mb * gas * world:
        return
    m = r.args["gradient_accumulation_steps"]
    cause = (
        f"; gradient_accumulation_steps is 1 because {file} leaves it out (accelerate's DeepSpeedPlugin sets an "
        f"absent one to 1, not training_args.gradient_accumulation_steps {m}): add "
        f'"gradient_accumulation_steps": "auto" to {file}'
        if any(ch.key == "gradient_accumulation_steps" and ch.before == MISSING for ch in r.changes) and gas != m
        else f'; make train_batch_size {mb * gas * world}, or "auto"'
    )
    raise CommgateError(
        f"hf.deepspeed {file}: train_batch_size {tbs} != {mb} * {gas} * {world} (train_micro_batch_size_per_gpu * "
        f"gradient_accumulation_steps * ranks): DeepSpeed refuses the config Trainer hands it{cause}"
    )


def _parallelism(r: Resolution) -> dict[str, Any]:
    a = r.args
    stage = None if r.config is None else r.config["zero_optimization"]["stage"]
    out: dict[str, Any] = {
        "scheme": "fsdp" if a["fsdp"] else SCHEME_OF_STAGE[stage],
        "micro_batch": a["per_device_train_batch_size"],
        "micro_batches": a["gradient_accumulation_steps"],
    }
    if a["fsdp"]:  # accelerate's MixedPrecisionPolicy for bf16: both dtypes (utils/dataclasses.py:2109-2143)
        half = {"param_dtype": "bf16", "reduce_dtype": "bf16"} if a["bf16"] else {}
        out["fsdp"] = {"reshard_after_forward": bool(a["fsdp_config"]["reshard_after_forward"])} | half
        return out
    if r.config is None and a["ddp_bucket_cap_mb"] is not None:
        out["ddp_bucket_mb"] = a["ddp_bucket_cap_mb"]
    return out


def _model(config_path: Path, r: Resolution) -> dict[str, Any]:
    """The model block: the class transformers builds (named for people; ``model`` builds it), and the
    dtype: DeepSpeed's bf16/fp16 parameters, else the config's (``from_config`` follows ``config.dtype``),
    with DDP's autocast for ``bf16``/``fp16``."""
    cfg = _hf_config(config_path)
    stage = None if r.config is None else r.config["zero_optimization"]["stage"]
    if stage == 3 and getattr(cfg, "tie_word_embeddings", False):
        raise CommgateError(
            f"hf.config {config_path}: tie_word_embeddings under ZeRO-3: transformers ties the weights again after "
            "its partitioned construction (model.tie_weights()), which is not measured; untie them or use ZeRO-1/2"
        )
    named = str(getattr(cfg, "dtype", None)).removeprefix("torch.")
    if named not in ("bfloat16", "float16", "float32", "None"):  # from_config builds the parameters in it
        raise CommgateError(
            f"hf.config {config_path}: torch_dtype {named} is not modelled: transformers' from_config builds the "
            'parameters in it, and commgate models float32, float16 and bfloat16; set "torch_dtype" (or "dtype") '
            'to "float32"'
        )
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(named, "fp32")
    out: dict[str, Any] = {"module": f"transformers:{_model_class(cfg).__name__}", "dtype": dtype}
    half = "bf16" if r.args["bf16"] else "fp16" if r.args["fp16"] else None
    if r.args["fsdp"]:
        if half == "fp16":
            raise CommgateError(
                "hf.training_args.fp16: true under FSDP2 is not modelled (fp16 needs a gradient scaler, GPU only); "
                "use bf16"
            )  # accelerate upcasts the parameters to fp32 under mixed precision (utils/fsdp_utils.py:812-817)
        return out | ({"dtype": "fp32"} if half else {})
    if stage == 3 and half:
        raise CommgateError(
            f"hf.training_args.{half}: true under ZeRO-3 is not modelled yet (measured on CPU ranks: transformers' "
            "zero.Init construction keeps the parameters fp32, gathered so, while the gradients are reduced in "
            f"{half}); leave it out, or use ZeRO-1/2"
        )
    if r.config is not None and half:
        out["dtype"] = half
    elif r.config is not None and dtype != "fp32":
        raise CommgateError(
            f"hf.config {config_path}: dtype {dtype}: DeepSpeed without bf16 or fp16 and a {dtype} model is not "
            "modelled; set training_args.bf16 (or fp16), or the config's dtype to float32"
        )
    elif half and dtype != "fp32":
        raise CommgateError(
            f"hf.training_args.{half}: true with hf.config {config_path}'s {dtype} parameters: DDP's autocast over "
            f"16-bit parameters is not modelled (Trainer's --{half} autocasts fp32 parameters); leave {half} out to "
            "train the model as it is shipped, or set the config's torch_dtype to float32"
        )
    elif half:
        out["autocast"] = half
    return out


# ------------------------------------------------------------------------------------------ the model


def _hf_config(p: Path) -> Any:
    """The config.json at ``p`` as transformers reads it (a copy: ``from_config`` may set attributes on it)."""
    return copy.deepcopy(_config_of(_read_json(p, "Hugging Face config.json", "hf.config"), p))


def _config_of(raw: dict[str, Any], p: Path) -> Any:
    """``raw`` (the config.json at ``p``) read by transformers; a problem is one line naming the file. Parsed
    once per content (derive, each prediction and each build read the same file)."""
    return _parsed(json.dumps(raw, sort_keys=True), str(p))


@functools.cache
def _parsed(text: str, where: str) -> Any:
    from transformers import AutoConfig

    raw = json.loads(text)
    if not isinstance(raw.get("model_type"), str):
        raise CommgateError(
            f"hf.config {where}: no model_type: give a causal language model's config.json (model_type llama, "
            "mistral, qwen2, gpt_neox ...)"
        )
    try:
        cfg = AutoConfig.for_model(**raw)
    except Exception as exc:  # transformers' own validation (strict dataclass fields, unknown model types)
        why = _one_line(exc)
        raise CommgateError(
            f"hf.config {where}: transformers cannot read it: {why[:300]}{' ...' if len(why) > 300 else ''}"
        ) from None
    _within_limits(cfg, where)
    return cfg


SIZES = {"num_hidden_layers": "L", "hidden_size": "h", "num_attention_heads": "a", "num_key_value_heads": "kv_heads",
         "vocab_size": "V", "intermediate_size": "ffn_hidden"}  # fmt: skip
"""A config's dimensions (as transformers reads them: GPT-2's ``n_embd`` is ``hidden_size``) and the
``model:`` field whose schema limit holds them too."""


def _within_limits(cfg: Any, where: str) -> None:
    """The limits a scenario's own model dimensions have (the scenario schema's), held to the config's: a
    6.6e21-parameter config predicted, and a run would have tried to build it (found by an adversarial pass)."""
    from commgate.core.schemas import load

    fields = load("scenario")["properties"]["model"]["properties"]
    for key, field in SIZES.items():
        value, most = getattr(cfg, key, None), fields[field]["maximum"]
        if isinstance(value, int) and value > most:
            raise CommgateError(
                f"hf.config {where}: {key} {value:,} is more than commgate takes ({most:,}, as model.{field}); "
                "give the config of the model you train"
            )


def _model_class(cfg: Any) -> type:
    from transformers import AutoModelForCausalLM

    try:
        cls: type = AutoModelForCausalLM._model_mapping[type(cfg)]
        return cls
    except KeyError:
        raise CommgateError(
            f"hf.config: model_type {cfg.model_type!r} has no causal language model in transformers"
        ) from None


def build(scenario: Scenario) -> Any:
    """The job's model as Trainer gets it: ``AutoModelForCausalLM.from_config`` of ``hf.config``, on torch's
    current default device (inside a ZeRO-3 ``TrainingArguments``: under ``deepspeed.zero.Init``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(_hf_config(path(scenario.file, scenario.trainer_config["config"])))


def model(scenario: Scenario) -> tuple[Any, Any]:
    """``Trainer.model``: the job's model (``build``) whose forward takes one micro-batch's ``input_ids`` and
    ``labels`` and returns the loss, as Trainer computes it, and the micro-batches: ``b`` sequences of
    ``s`` random token ids, their labels the same ids."""
    import torch

    net = build(scenario)
    forward = type(net).forward

    def loss(input_ids: Any, labels: Any) -> Any:
        return forward(net, input_ids=input_ids, labels=labels).loss

    net.forward = loss  # the instance's: the module tree stays Trainer's (no wrapper module)
    vocab, b, s = net.config.vocab_size, scenario.parallelism.micro_batch, scenario.model.s

    def inputs(seed: int) -> tuple[Any, ...]:
        ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
        return ids, ids.clone()

    return net, inputs


@dataclass(frozen=True, slots=True)
class Facts:
    """What the model tells Trainer, read on the meta device."""

    accepts_loss_kwargs: bool
    """Trainer's ``model_accepts_loss_kwargs`` (``trainer.py:517-523``): the token count is gathered."""
    holders: tuple[tuple[int, int], ...]
    """(elements, holders) of every parameter: how many of ``initialize_weights_zero3``'s gathers cover it."""


@functools.cache
def facts(scenario: Scenario) -> Facts:
    import inspect

    import torch
    from transformers import PreTrainedModel

    with torch.device("meta"):
        net = build(scenario)
    if hasattr(net, "accepts_loss_kwargs"):
        accepts = bool(net.accepts_loss_kwargs)
    else:
        accepts = any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(net.forward).parameters.values()
        )
    count: dict[int, int] = {}
    for mod in net.modules():  # integrations/deepspeed.py:313-326: a module's own and its plain children's
        own = list(mod.parameters(recurse=False))
        kids = [p for c in mod.children() if not isinstance(c, PreTrainedModel) for p in c.parameters(recurse=False)]
        for p in own + kids:
            count[id(p)] = count.get(id(p), 0) + 1
    holders = tuple((p.numel(), count.get(id(p), 0)) for p in net.parameters())
    return Facts(accepts_loss_kwargs=accepts, holders=holders)


# ------------------------------------------------------------------------------------- what it sends


def _row(ctx: Context, op: Op, dtype: str, elements: int, phase: Phase, source: str, **when: Any) -> ExpectedCollective:
    return ExpectedCollective(
        op=op,
        axis="dp",
        groups=ctx.layout.dp_groups(),
        dtype=dtype,
        elements=elements,
        calls=when.pop("calls", 1),
        phase=phase,
        source=source,
        **when,
    )


@dataclass(frozen=True, slots=True)
class NotInThePaper:
    """A component whose collectives the paper has no equation for."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ()

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return []

    def residuals(self, ctx: Context) -> list[Residual]:
        return []


@dataclass(frozen=True, slots=True)
class TrainerCalls(NotInThePaper):
    """What ``transformers.Trainer`` itself sends (per rank, over the data-parallel group):

    * each optimizer step, before its first forward, the token count of its micro-batches all-gathered
      (int64, one per rank; ``get_batch_samples`` -> ``_get_num_items_in_batch``, ``trainer.py:2298-2342``)
      when ``average_tokens_across_devices`` and the model takes loss keyword arguments;
    * each micro-batch, with ``include_num_input_tokens_seen``, its token count all-gathered (int64,
      ``_track_num_input_tokens``, ``trainer.py:2709-2740``);
    * each logging step (``logging_steps``, ``logging_first_step``), the loss and the floating-point
      operations all-gathered (fp32, one per rank each: ``nested_gather(tr_loss)`` and ``store_flos``,
      ``trainer.py:2249``, ``:2264``, ``:4205-4211``).

    The end of training's ``store_flos`` (``_finalize_training``) follows the last step, outside the
    measured window."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s = ctx.scenario
        a, d = s.trainer_config["training_args"], s.parallelism.data_ranks
        if d == 1:
            return []
        rows = []
        if a["average_tokens_across_devices"] and facts(s).accepts_loss_kwargs:
            rows.append(_row(ctx, Op.ALL_GATHER, "int64", d, Phase.FORWARD, "Trainer: the step's token count"))
        if a["include_num_input_tokens_seen"] != "no":
            m = s.parallelism.micro_batches
            rows.append(_row(ctx, Op.ALL_GATHER, "int64", d, Phase.FORWARD, "Trainer: input tokens seen", calls=m))
        logged = logging_steps(a, s.warmup_steps + s.steps)
        log = _row(ctx, Op.ALL_GATHER, "fp32", d, Phase.FORWARD, "Trainer: logging (loss, flos)", calls=2)
        if len(logged) == s.warmup_steps + s.steps:
            rows.append(log)
        else:
            rows += [replace(log, once=True, at_step=k) for k in logged]
        return rows


def logging_steps(args: Mapping[str, Any], steps: int) -> tuple[int, ...]:
    """The steps (0-based) after which Trainer logs (``DefaultFlowCallback.on_step_end``,
    ``trainer_callback.py:570-573``: global step 1 with ``logging_first_step``, every multiple of
    ``logging_steps`` with the steps strategy)."""
    every = args["logging_strategy"] == "steps"
    return tuple(
        k
        for k in range(steps)
        if (k == 0 and args["logging_first_step"]) or (every and (k + 1) % int(args["logging_steps"]) == 0)
    )


@dataclass(frozen=True, slots=True)
class Construction(NotInThePaper):
    """transformers' model construction under a ZeRO-3 config (``from_config`` after ``TrainingArguments``:
    ``modeling_utils.py:1435-1463``): the model is built inside ``deepspeed.zero.Init`` (each parameter
    broadcast once as it is partitioned: ``DeepSpeedZero3(built_partitioned=True)``), then
    ``initialize_weights_zero3`` (``integrations/deepspeed.py:298-334``) walks the module tree and, for every
    module with parameters of its own or in its children that are not ``PreTrainedModel``s, gathers them in
    ``GatheredParameters(modifier_rank=0)``: one all-gather of each, and one broadcast (as bytes) of each on
    exit. A parameter is covered by its owner and again by its owner's parent."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        d, isz = ctx.scenario.parallelism.dp, ctx.scenario.model.itemsize
        rows = []
        for numel, holders in facts(ctx.scenario).holders:
            if holders:
                what = "transformers initialize_weights_zero3: GatheredParameters"
                gather = _row(ctx, Op.ALL_GATHER, ctx.scenario.model.dtype, padded(numel, d), Phase.INIT,
                              f"{what} all-gather", calls=holders, once=True)  # fmt: skip
                rows += [
                    gather,
                    replace(gather, op=Op.BROADCAST, dtype="uint8", elements=numel * isz, source=f"{what} broadcast"),
                ]
        return rows


@dataclass(frozen=True, slots=True)
class Unit:
    """One ``fully_shard`` group as accelerate makes it (``fsdp2_prepare_model``)."""

    name: str
    params: tuple[tuple[int, int], ...]
    """(elements, dim 0) of each of its parameters."""
    reshards: bool
    """``reshard_after_forward``: its backward gathers it again."""

    def padded(self, d: int) -> int:
        """Elements of its flat all-gather: every parameter padded on dim 0 to a multiple of d."""
        return sum(-(-dim0 // d) * d * (numel // dim0) for numel, dim0 in self.params)


@functools.cache
def units(scenario: Scenario) -> tuple[Unit, ...]:
    """accelerate's FSDP2 wrapping of the model (``accelerate/utils/fsdp_utils.py:850-885``), read on the meta
    device with accelerate's own auto-wrap policy (``fsdp2_prepare_auto_wrap_policy``: the model's
    ``_no_split_modules``, or ``transformer_layer_cls_to_wrap``): bottom up, each wrapped module (a decoder
    layer) its own group; then the input embeddings (untied); then the tail [final norm, output embeddings]
    with ``reshard_after_forward=False``; then the root, with what is left, under torch's choice (not
    resharded). A group holds the parameters of its modules that no earlier group holds."""
    import torch
    from accelerate.utils.fsdp_utils import _find_final_norm, fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    config = scenario.trainer_config["training_args"]["fsdp_config"]
    reshard = bool(config["reshard_after_forward"])
    names = config.get("transformer_layer_cls_to_wrap")
    plugin = types.SimpleNamespace(
        auto_wrap_policy=transformer_auto_wrap_policy,
        transformer_cls_names_to_wrap=[names] if isinstance(names, str) else names,
    )
    with torch.device("meta"):
        net = build(scenario)
    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, net)
    except ValueError as exc:  # accelerate: "Could not find the transformer layer class X in the model."
        layers = ", ".join(getattr(net, "_no_split_modules", None) or ()) or "?"
        raise CommgateError(
            f"hf.training_args.fsdp_config.transformer_layer_cls_to_wrap {names!r}: {_one_line(exc)} "
            f"({type(net).__name__} wraps {layers})"
        ) from None
    held: set[int] = set()
    out: list[Unit] = []

    def group(name: str, modules: list[Any], reshards: bool) -> None:
        params = []
        for p in (p for m in modules for p in m.parameters()):  # a tied weight once
            if id(p) not in held:
                held.add(id(p))
                params.append(p)
        if params:
            out.append(Unit(name, tuple((p.numel(), p.shape[0]) for p in params), reshards))

    for name, module in get_module_children_bottom_up(net, return_fqns=True)[:-1]:
        if policy is not None and policy(module):
            group(f"{name} ({type(module).__name__})", [module], reshard)
    embed, head = net.get_input_embeddings(), net.get_output_embeddings()
    tied = embed is not None and head is not None and embed.weight is head.weight
    if not tied and embed is not None:
        group("input embeddings", [embed], reshard)
    tail = [m for m in (_find_final_norm(net), *((embed,) if tied else ()), head) if m is not None]
    group("tail (final norm, output embeddings)", tail, False)
    group("root", [net], False)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class AccelerateFullyShard(NotInThePaper):
    """FSDP2 as accelerate wraps a Trainer's model (``units``): each group all-gathered before its forward,
    every micro-batch (resharded after each backward); again before its backward where it reshards after
    the forward; its gradients reduce-scattered once a step (Trainer runs all micro-batches but the last in
    accelerate's ``no_sync``, which turns FSDP2's gradient sync off: ``trainer.py:1896-1907``,
    ``accelerator.py:1166-1171``), in the ``MixedPrecisionPolicy``'s dtypes (accelerate's for ``bf16``: both
    bf16). Then Trainer's gradient norm, whatever ``max_grad_norm`` is (``trainer.py:1937-1940``:
    ``_get_grad_norm`` clips at infinity where ``max_grad_norm`` is 0; transformers 5.23 and 5.24):
    ``clip_grad_norm_`` over the DTensor gradients, whose stacked per-parameter norms (one per parameter, in
    the gradients' dtype: the parameters', fp32 where accelerate upcasts them for ``bf16``, bf16 for a model
    shipped in bf16 trained without it; fp32 always was a false failure, found by an adversarial pass) are
    all-reduced once a step (``accelerator.py:3014-3022``; with ``max_grad_norm`` 0 it was left out, 304 B a
    step unexplained: found by an adversarial pass)."""

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        s = ctx.scenario
        d, m, f = s.parallelism.data_ranks, s.parallelism.micro_batches, s.parallelism.fsdp
        gather = f.compute_dtype(s.model.dtype)
        reduce = f.reduce_dtype or gather
        rows = []
        for u in units(s):
            what = f"accelerate FSDP2 {u.name}"
            rows.append(_row(ctx, Op.ALL_GATHER, gather, u.padded(d), Phase.FORWARD, f"{what}: all-gather", calls=m))
            if u.reshards:
                rows.append(_row(ctx, Op.ALL_GATHER, gather, u.padded(d), Phase.BACKWARD,
                                 f"{what}: all-gather (backward: resharded after forward)", calls=m))  # fmt: skip
            rows.append(_row(ctx, Op.REDUCE_SCATTER, reduce, u.padded(d), Phase.BACKWARD, f"{what}: reduce-scatter"))
        n = sum(len(u.params) for u in units(s))
        norms = s.model.dtype  # the gradients' own: fp32 where accelerate upcast for bf16, else as the model ships
        rows.append(
            _row(ctx, Op.ALL_REDUCE, norms, n, Phase.FORWARD, "Trainer: the gradient norm's per-parameter norms")
        )
        return rows


def components(scenario: Scenario, scheme: Scheme) -> tuple[Component, ...]:
    """The scheme's components as Trainer runs them, then Trainer's own calls (and ZeRO-3's construction)."""
    if scheme.fsdp:  # accelerate's wrapping in place of commgate's (blocks, then the root)
        return AccelerateFullyShard(), TrainerCalls()
    out: list[Component] = []
    for c in scheme.components:
        if isinstance(c, DistributedDataParallel):
            c = replace(
                c, find_unused_parameters=bool(scenario.trainer_config["training_args"]["ddp_find_unused_parameters"])
            )
        elif isinstance(c, DeepSpeedZero3):
            c = replace(c, built_partitioned=True)
            out.append(Construction())
        out.append(c)
    return (*out, TrainerCalls())


# ---------------------------------------------------------------------------------- what is shown


def derived(scenario: Scenario) -> tuple[str, ...]:
    """Every decision Trainer made for the job, one line each: the DeepSpeed keys its layers filled or
    changed, and the arguments that decide what it sends."""
    r = resolution(scenario)
    a, par = r.args, scenario.parallelism
    lines = [
        f"model {scenario.model.module} from {scenario.trainer_config['config']} (hidden_size {r.hidden_size}), "
        f"{scenario.model.dtype}{f', autocast {scenario.model.autocast}' if scenario.model.autocast else ''}",
        f"scheme {par.scheme}, {par.dp} ranks, b={par.micro_batch} (per_device_train_batch_size), "
        f"m={par.micro_batches} (gradient_accumulation_steps)"
        + (
            f"; DeepSpeed's config holds gradient_accumulation_steps {gas}, which sets only its batch check: Trainer "
            "sets the accumulation boundary itself (accelerate's DeepSpeedEngineWrapper.backward)"
            if r.config is not None and (gas := r.config.get("gradient_accumulation_steps")) != par.micro_batches
            else ""
        ),
    ]
    if a["fsdp"]:
        f = par.fsdp
        lines.append(
            f"fsdp: FSDP2 through accelerate's plugin (kept on CPU ranks: W5), reshard_after_forward = "
            f"{f.reshard_after_forward}, param/reduce dtype {f.param_dtype or scenario.model.dtype}/"
            f"{f.reduce_dtype or f.param_dtype or scenario.model.dtype}, activation_checkpointing = "
            f"{bool(a['fsdp_config'].get('activation_checkpointing'))}, groups: "
            + ", ".join(u.name for u in units(scenario))
            + f"; the gradient norms all-reduced each step (max_grad_norm {a['max_grad_norm']}: Trainer computes "
            "them at 0 too)"
        )
    elif r.config is None:
        lines.append(f"ddp_find_unused_parameters = {a['ddp_find_unused_parameters']} (Trainer's choice unless given)")
    lines += [
        f"deepspeed.{c.key}: {_show(c.before)} -> {_show(c.after)} [{c.by}]"
        + ("" if _finite(c.after) else " (the run's; not in the deepspeed: block, which holds finite numbers)")
        for c in r.changes
    ]
    logging = (
        f"logging every {a['logging_steps']} step(s)" if a["logging_strategy"] == "steps" else "logging off (no)"
    )  # "logging no every 500 step(s)" (found by an adversarial pass)
    lines.append(
        f"average_tokens_across_devices = {a['average_tokens_across_devices']}, include_num_input_tokens_seen = "
        f"{a['include_num_input_tokens_seen']}, {logging}{', first step too' if a['logging_first_step'] else ''}"
    )
    return tuple(lines)


def _finite(value: Any) -> bool:
    return not (isinstance(value, float) and not math.isfinite(value))


def _show(value: Any) -> str:
    return value if value == MISSING else json.dumps(value, default=str)
