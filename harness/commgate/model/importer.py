"""``commgate import``: a scenario written from the configs a user already has.

* a GPT-NeoX config (``--neox``): a relaxed YAML (comments, ``True``, trailing commas) holding the model
  (``num-layers``, ``hidden-size``, ``num-attention-heads``, ``seq-length``, ``pos-emb``,
  ``no-weight-tying``), the parallelism (``pipe-parallel-size``, ``model-parallel-size``), activation
  checkpointing, and DeepSpeed's own keys (``zero_optimization``, ``fp16``/``bf16``, batch sizes);
* a DeepSpeed JSON (``--deepspeed``): becomes the ``deepspeed:`` block;
* a Hugging Face ``config.json`` (``--hf``) of ``model_type`` ``gpt_neox``, ``llama`` or ``mistral`` (the
  last two as ``architecture: llama``): dimensions, heads, key/value heads, MLP width, tied embeddings,
  ``torch_dtype``.

With ``--trainer hf`` the scenario is a Hugging Face ``Trainer`` job instead (``commgate.model.trainers.hf``):
its ``hf:`` block names the ``config.json`` and the DeepSpeed JSON as they are (``"auto"`` and all, paths
relative to the written file), and the file shows what Trainer resolves from them: a comment per decision
(each ``"auto"`` and what filled it) and the resolved fields themselves (model, parallelism, the DeepSpeed
block, ``TrainingArguments`` as Trainer holds them), which the loader checks against a fresh resolution.

Every key that is not used is listed, and so is every DeepSpeed key left out because the model does not
follow its value yet (``commgate.model.dsconfig``): the scenario written is one the model checks, and it
validates and predicts. ``--cpu`` writes the reduced-scale variant (the presets' rule: the same layers,
heads, MLP expansion, embeddings and positions; head dimension 8, V = 1024, s = 128).
"""

from __future__ import annotations

import copy
import difflib
import importlib
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from commgate.core.errors import UsageError
from commgate.core.fsutil import CONFIG_BYTES, json_once, read_text
from commgate.model import dsconfig
from commgate.model.schemes import SCHEMES

NEOX_USED = {
    "num-layers", "hidden-size", "num-attention-heads", "seq-length", "max-position-embeddings", "pos-emb",
    "no-weight-tying", "pipe-parallel-size", "model-parallel-size", "checkpoint-activations", "precision",
    "num-kv-heads", "make-vocab-size-divisible-by", "padded-vocab-size", "tokenizer-type",
}  # fmt: skip

NEOX_VOCAB = {"GPT2BPETokenizer": 50257, "HFGPT2Tokenizer": 50257, "HFTokenizer": 50277, "CharLevelTokenizer": 512}
"""Tokens of GPT-NeoX's tokenizers before padding (``HFTokenizer``: its 20B tokenizer, 50,277)."""


@dataclass
class Imported:
    doc: dict[str, Any]
    """The scenario document."""
    notes: list[str] = field(default_factory=list)
    """What was ignored or left out, one line each."""
    comments: list[str] = field(default_factory=list)
    """What the written file says in comments, one line each (a trainer's resolved values)."""
    origins: dict[str, str] = field(default_factory=dict)
    """A scenario path (``$.torchtitan.log_freq``) -> the config key it was read from, as the user wrote it
    (``job.toml: [metrics] log_freq``): a refusal of the scenario names the key to change."""


def _read(path: Path, what: str) -> dict[str, Any]:
    """A config file as a mapping: JSON, TOML (Python >= 3.11's tomllib) or YAML, by its suffix. A key given
    twice in one mapping is refused (JSON and YAML would keep the last silently; TOML refuses it itself)."""
    toml: Any = None
    if path.suffix == ".toml":
        if sys.version_info < (3, 11):
            raise UsageError(f"{path}: reading a TOML needs Python 3.11 or later (tomllib)")
        toml = importlib.import_module("tomllib")  # (commgate's types are Python 3.10's)
    try:
        text = read_text(path, limit=CONFIG_BYTES, what=what)
        doc = _json(text, path) if path.suffix == ".json" else toml.loads(text) if toml else _yaml(text, path)
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError too
        raise UsageError(f"{path}: not a {what} ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: a {what} is a mapping, found {type(doc).__name__}")
    return doc


def _json(text: str, path: Path) -> Any:
    """A JSON document, a key given twice in one object refused (``json`` keeps the last one silently)."""
    try:
        return json_once(text)
    except KeyError as exc:
        raise UsageError(f"{path}: {exc.args[0]}") from None


def _yaml(text: str, path: Path) -> Any:
    """A YAML document, a key given twice in one mapping, or an integer with a leading zero, refused as a
    scenario's are (the loader's check)."""
    from commgate.core.errors import ScenarioError
    from commgate.model.loader import _bounded, _misread

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:  # an alias "bomb" of a few lines expands to billions of nodes
            _bounded(node, str(path))
        except ScenarioError as exc:
            raise UsageError(str(exc).replace("; not a scenario", "; not a config")) from None
        for problem in _misread(node, str(path), []):  # the first one
            where, key = f"{problem.file}:{problem.line}", problem.path.removeprefix("$.")
            raise UsageError(f"{where}: {key}: {problem.message}")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def build(
    *,
    neox: Path | None = None,
    deepspeed: Path | None = None,
    hf: Path | None = None,
    dp: int = 1,
    tp: int | None = None,
    pp: int | None = None,
    cpu: bool = False,
    name: str | None = None,
) -> Imported:
    if not (neox or deepspeed or hf):
        raise UsageError("commgate import needs at least one of --neox, --deepspeed, --hf (or --torchtitan alone)")
    out = Imported(doc={})
    model: dict[str, Any] = {}
    par: dict[str, Any] = {}
    ds: dict[str, Any] = {}
    if neox:
        _neox(_read(neox, "GPT-NeoX config"), model, par, ds, out.notes, str(neox))
    if hf:
        neox_model = dict(model)
        _hf(_read(hf, "Hugging Face config.json"), model, out.notes, str(hf))
        if neox and (clash := [f"{k} {neox_model[k]} vs {model[k]}" for k, _ in NEOX_DIMENSIONS_OF if k in neox_model
                               and k in model and neox_model[k] != model[k]]):  # fmt: skip
            raise UsageError(
                f"{neox} and {hf} describe different models ({', '.join(clash)}); give the config of the model "
                "you train (--neox or --hf), not both"
            )
    stage_file = neox
    if deepspeed:
        given = _read(deepspeed, "DeepSpeed JSON config")
        if isinstance(given.get("zero_optimization"), dict) and "stage" in given["zero_optimization"]:
            stage_file = deepspeed
        ds = _merge(ds, given)
    if tp is not None:
        par["tp"] = tp
    if pp is not None:
        par["pp"] = pp
    par["dp"] = dp
    if neox and not hf and (missing := [key for key, target in NEOX_DIMENSIONS if target not in model]):
        raise UsageError(
            f"{neox}: {', '.join(missing)} missing: a GPT-NeoX config states "
            f"{', '.join(key for key, _ in NEOX_DIMENSIONS)} (or give --hf, a config.json, for the model)"
        )
    if "L" not in model:
        raise UsageError(f"{deepspeed}: a DeepSpeed config has no model dimensions: give --neox or --hf too")
    stage = _stage(ds, str(stage_file))
    _stage_fits(stage, par, str(stage_file))
    par["scheme"] = _scheme(par, stage)
    if SCHEMES[par["scheme"]].pipeline and stage == 1:  # GPT-NeoX's usual pipeline: ZeRO-1 in DeepSpeed's engine
        par["zero"] = {"stage": 1}
    for key in ("bf16", "fp16"):
        if dsconfig.enabled(ds, key):
            model["dtype"] = key
    if cpu:
        _reduce(model, par, ds, out.notes)
    baseline_only = _drop_unmodelled(ds, stage, out.notes)
    par.setdefault("tp", 1)
    par.setdefault("pp", 1)
    out.doc = {
        "schema_version": 1,
        "name": name or scenario_name(neox or hf or deepspeed),
        "description": "Imported by commgate import from " + ", ".join(str(p) for p in (neox, deepspeed, hf) if p),
        "model": model,
        "parallelism": {k: par[k] for k in ("scheme", "dp", "tp", "pp") if k in par}
        | {k: v for k, v in par.items() if k not in ("scheme", "dp", "tp", "pp")},
    }
    if ds:
        out.doc["deepspeed"] = ds
    if baseline_only:
        out.doc["expectations"] = {"model": {"check": False}}
    return out


def _stage(ds: dict[str, Any], f: str) -> int:
    """The DeepSpeed config's ZeRO stage (0 when it gives none); ``f`` the file that states it."""
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if not dsconfig.given(stage):
        return 0
    if (number := _whole(stage, f"{f}: zero_optimization.stage")) not in ZERO_STAGES:
        raise UsageError(f"{f}: zero_optimization.stage: {stage!r} is not a ZeRO stage: give 0, 1, 2 or 3")
    return number


def scenario_name(path: Path | None) -> str:
    """A scenario name from a file's stem (characters a file name and an id both take)."""
    if path is None:
        return "imported"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in path.stem) or "imported"


def _stage_fits(stage: int, par: dict[str, Any], f: str) -> None:
    """A ZeRO stage the parallelism cannot run with commgate's model, refused naming the key (the loader's own
    check would advise a scheme that then refuses the TP or the pipeline)."""
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    if pp > 1 and stage >= 2:  # deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with ..."
        raise UsageError(
            f"{f}: zero_optimization.stage: {stage} with a pipeline of {pp} stages: DeepSpeed's pipeline engine "
            "runs ZeRO stage 0 or 1 only (it refuses 2 and 3 as it starts); give stage 0 or 1"
        )
    if tp > 1 and pp <= 1 and stage >= 1:
        raise UsageError(
            f"{f}: zero_optimization.stage: {stage} with tensor parallelism of {tp} and no pipeline is not modelled "
            "(commgate models ZeRO beside tensor parallelism only in DeepSpeed's pipeline engine, ZeRO-1 with 2 "
            "stages or more); give stage 0, or a pipeline (GPT-NeoX's pipe-parallel-size, or --pp) with stage 0 or 1"
        )


def _scheme(par: dict[str, Any], stage: int) -> str:
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    if tp > 1 and pp > 1:
        return "3d"
    if pp > 1:
        return "pp"
    if tp > 1:
        return "tp"
    return ZERO_STAGES[stage]


ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
"""DeepSpeed's ZeRO stages (``zero_optimization.stage``) and the scheme each is without TP or a pipeline."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _whole(value: Any, where: str) -> int:
    """``value`` as a whole number; a one-line ``UsageError`` naming ``where`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{where}: {value!r} is not a whole number")
    if isinstance(value, int):  # exactly (a float holds 53 bits)
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{where}: {value!r} is not a whole number") from None
    if not number.is_integer():
        raise UsageError(f"{where}: {value!r} is not a whole number")
    return int(number)


def _neox(
    cfg: dict[str, Any], model: dict[str, Any], par: dict[str, Any], ds: dict[str, Any], notes: list[str], f: str
) -> None:
    get: dict[str, Any] = {}
    for k, v in cfg.items():
        if (key := k.replace("_", "-")) in get:  # GPT-NeoX reads both spellings as one key: the last would win
            twice = [other for other in cfg if other.replace("_", "-") == key]
            raise UsageError(f"{f}: {' and '.join(twice)}: one key to GPT-NeoX, given twice: give it once")
        get[key] = v
    for key in ("no-weight-tying", "checkpoint-activations"):
        if key in get and not isinstance(get[key], bool):
            raise UsageError(f"{f}: {key}: {get[key]!r} is not a boolean; write true or false (no quotes)")
    for key, target in NEOX_DIMENSIONS:
        if key in get and (value := _whole(get[key], f"{f}: {key}")) < 1:
            raise UsageError(f"{f}: {key}: {value} is not 1 or more")
        if key in get:
            model[target] = value
    if "num-kv-heads" in get and "num-attention-heads" in get and get["num-kv-heads"] != get["num-attention-heads"]:
        raise UsageError(
            f"{f}: num-kv-heads: {get['num-kv-heads']!r} (grouped-query attention) changes the parameter count, and "
            "commgate's GPT-NeoX model has every head's keys and values; import the model's Hugging Face config.json "
            "(--hf: architecture llama, kv_heads) or write the scenario by hand"
        )
    pos = get.get("pos-emb", "learned")
    model["position"] = {"rotary": "rotary", "learned": "learned", "none": "none"}.get(pos, "learned")
    if pos not in ("rotary", "learned", "none"):
        notes.append(f"{f}: pos-emb {pos!r} has no counterpart; learned positions assumed")
    model["tied_embeddings"] = not get.get("no-weight-tying", False)
    pp = _whole(get.get("pipe-parallel-size", 1), f"{f}: pipe-parallel-size")
    tp = _whole(get.get("model-parallel-size", 1), f"{f}: model-parallel-size")
    if pp < 0:
        raise UsageError(f"{f}: pipe-parallel-size: {pp} is not 0 or more: give 0 (no pipeline) or the stage count")
    if tp < 1:
        raise UsageError(f"{f}: model-parallel-size: {tp} is not 1 or more: give 1 (no tensor parallelism) or more")
    _neox_vocab(get, model, notes, f, tp)
    if pp == 0:  # GPT-NeoX's is_pipe_parallel is pipe-parallel-size >= 1
        notes.append(f"{f}: pipe-parallel-size 0 (GPT-NeoX's model without its pipeline wrapper): pp 1")
    if pp > 1:
        par["pp"] = pp
    if tp > 1:
        par["tp"] = tp
    if get.get("checkpoint-activations"):
        par["activation_checkpointing"] = True
    for key, value in cfg.items():
        if key in dsconfig.TOP_LEVEL:
            ds[key] = value
        elif key.replace("_", "-") not in NEOX_USED:
            notes.append(f"{f}: {key} ignored (no communication effect commgate models)")
    _neox_precision(get.get("precision"), ds, notes, f)


def _neox_vocab(get: dict[str, Any], model: dict[str, Any], notes: list[str], f: str, mp: int) -> None:
    """V as GPT-NeoX derives it (``_vocab_size_with_padding``): the tokenizer's tokens padded to a multiple of
    ``make-vocab-size-divisible-by`` (128) times ``model-parallel-size``; a ``padded-vocab-size`` in the
    config is what GPT-NeoX recomputes, so it is not read."""
    kind = get.get("tokenizer-type", "HFTokenizer")
    tokens = NEOX_VOCAB.get(kind, NEOX_VOCAB["HFTokenizer"])
    by = _whole(get.get("make-vocab-size-divisible-by", 128), f"{f}: make-vocab-size-divisible-by")
    if by < 1:
        raise UsageError(f"{f}: make-vocab-size-divisible-by: {by} is not 1 or more (GPT-NeoX's default: 128)")
    model["V"] = -(-tokens // (by * mp)) * (by * mp)
    which = (
        f"{kind}'s {tokens:,} tokens"
        if kind in NEOX_VOCAB
        else f"{tokens:,} tokens ({kind!r}: the 20B tokenizer's assumed)"
    )
    notes.append(f"{f}: V = {model['V']}, GPT-NeoX's padded vocabulary: {which} padded to a multiple of {by} x {mp}")
    if "padded-vocab-size" in get:
        notes.append(f"{f}: padded-vocab-size not read: GPT-NeoX derives it from the tokenizer (V = {model['V']})")


def _neox_precision(precision: Any, ds: dict[str, Any], notes: list[str], f: str) -> None:
    """GPT-NeoX's ``precision`` (``NeoXArgs.calculate_derived``): ``fp16`` enables the DeepSpeed ``fp16`` block
    (its other keys kept), ``bfloat16`` adds an enabled ``bf16`` block where the config has none; ``fp32`` and
    absent leave the blocks as they are."""
    if precision is None or precision == "fp32":
        return
    if precision == "fp16":
        section = ds.get("fp16")
        ds["fp16"] = (dict(section) if isinstance(section, dict) else {}) | {"enabled": True}
    elif precision == "bfloat16":
        if not ds.get("bf16"):
            ds["bf16"] = {"enabled": True}
    else:
        raise UsageError(f"{f}: precision: {precision!r} is not one of GPT-NeoX's: fp32, fp16, bfloat16")
    notes.append(f"{f}: precision {precision}: DeepSpeed's {'fp16' if precision == 'fp16' else 'bf16'} block "
                 "enabled, as GPT-NeoX derives it")  # fmt: skip


NEOX_DIMENSIONS_OF = (("L", "num-layers"), ("h", "hidden-size"), ("a", "num-attention-heads"))
"""The dimensions a GPT-NeoX config and a Hugging Face config.json both state (when both are given)."""

NEOX_DIMENSIONS = (("num-layers", "L"), ("hidden-size", "h"), ("num-attention-heads", "a"), ("seq-length", "s"))
"""The GPT-NeoX keys of the model's dimensions (GPT-NeoX has no default for them) and their scenario fields."""

HF_LLAMA = ("llama", "mistral", "qwen2")
"""Hugging Face model types imported as ``architecture: llama`` (Mistral's sliding window changes no
parameter and no collective; Qwen2 adds biases to the Q, K and V projections: ``qkv_bias``)."""
HF_TYPES = ("gpt_neox", *HF_LLAMA)
"""Every Hugging Face ``model_type`` commgate imports."""

HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


HF_DEFAULTS: dict[str, dict[str, int | None]] = {
    "llama": {"intermediate_size": 11008, "num_key_value_heads": None, "max_position_embeddings": 2048},
    "mistral": {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072},
    "qwen2": {"intermediate_size": 22016, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "gpt_neox": {"intermediate_size": 24576, "max_position_embeddings": 2048},
}
"""What transformers (5.x: ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``GPTNeoXConfig``) builds a
model with when its config.json leaves the key out (``num_key_value_heads`` None: as many as the heads); each
one taken is noted. The other dimensions have no default here: a config.json states them."""


def _hf_count(cfg: dict[str, Any], key: str, kind: str, notes: list[str], f: str, heads: int = 0) -> int:
    """``cfg[key]``, a whole number of 1 or more (a JSON integer, as transformers writes it); absent:
    transformers' default for ``kind`` (noted), or a one-line error where commgate keeps none. ``heads``: what
    ``num_key_value_heads`` None (null, or transformers' default) stands for."""
    if key not in cfg:
        defaults = HF_DEFAULTS[kind]
        if key not in defaults:
            raise UsageError(f"{f}: {key} missing (a {kind} config.json states it)")
        default = defaults[key]
        if default is None:  # num_key_value_heads: as many as the heads
            return heads
        notes.append(f"{f}: {key} absent: {default}, transformers' default for {kind}; state it if yours differs")
        return default
    value = cfg[key]
    if value is None and heads:  # transformers: as many as the heads
        return heads
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{f}: {key}: {json.dumps(value)} is not a whole number of 1 or more: give one (no quotes)")
    return value


def _hf_flag(cfg: dict[str, Any], key: str, f: str) -> bool:
    """``cfg[key]``, a JSON boolean (false when absent, as in transformers' configs commgate imports)."""
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise UsageError(f"{f}: {key}: {json.dumps(value)} is not a boolean: give true or false (no quotes)")
    return value


def _hf(cfg: dict[str, Any], model: dict[str, Any], notes: list[str], f: str) -> None:
    kind = cfg.get("model_type")
    if kind not in HF_TYPES:
        raise UsageError(f"{f}: model_type {kind!r}: commgate imports {', '.join(HF_TYPES)} configs")

    def count(key: str) -> int:
        return _hf_count(cfg, key, kind, notes, f)

    h, a = count("hidden_size"), count("num_attention_heads")
    model.update(
        L=count("num_hidden_layers"),
        h=h,
        a=a,
        V=count("vocab_size"),
        s=count("max_position_embeddings"),
        tied_embeddings=_hf_flag(cfg, "tie_word_embeddings", f),
        ffn_hidden=count("intermediate_size"),
    )
    model.pop("x", None)
    if kind in HF_LLAMA:
        model.update(architecture="llama", kv_heads=_hf_count(cfg, "num_key_value_heads", kind, notes, f, heads=a))
        if kind == "qwen2":  # Qwen2Attention: bias=True on q_proj, k_proj, v_proj (not o_proj)
            model["qkv_bias"] = True
        model.pop("position", None)  # rotary
    else:
        model["position"] = "rotary"
    notes.append(f"{f}: s = max_position_embeddings = {model['s']}; set model.s to the sequence length you train with")
    for key in ("attention_bias", "mlp_bias"):
        if kind in HF_LLAMA and _hf_flag(cfg, key, f):
            raise UsageError(f"{f}: {key}: true: Llama-style layers with biases are not modelled")
    if kind in HF_LLAMA and cfg.get("head_dim") is not None and (head_dim := count("head_dim")) * a != h:
        raise UsageError(f"{f}: head_dim {head_dim} != hidden_size/num_attention_heads = {h}/{a}: not modelled")
    if kind in HF_LLAMA and cfg.get("hidden_act", "silu") != "silu":
        notes.append(f"{f}: hidden_act {cfg['hidden_act']!r}: the gated MLP's activation moves no bytes; SiLU is run")
    _hf_dtype(cfg, model, notes, f)
    used = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "max_position_embeddings", "tie_word_embeddings", "intermediate_size", "num_key_value_heads",
            "attention_bias", "mlp_bias", "head_dim", "hidden_act", "torch_dtype", "dtype"}  # fmt: skip
    notes += [f"{f}: {k} ignored" for k in cfg if k not in used]


def _hf_dtype(cfg: dict[str, Any], model: dict[str, Any], notes: list[str], f: str) -> None:
    """The model's dtype from ``dtype`` (transformers 5) or ``torch_dtype`` (before; ``dtype`` wins, as in
    transformers): a dtype commgate does not model is noted, and fp32 kept."""
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    given = cfg.get(key)
    if given is None:
        return
    if not isinstance(given, str):
        raise UsageError(f"{f}: {key}: {json.dumps(given)} is not a dtype's name: give one, such as bfloat16")
    if dtype := HF_DTYPES.get(given):
        model["dtype"] = dtype
        notes.append(f"{f}: dtype {dtype} from {key} (a DeepSpeed fp16/bf16 block overrides it)")
    else:
        notes.append(
            f"{f}: {key} {given!r} is not modelled (commgate models {', '.join(HF_DTYPES)}): dtype fp32 unless a "
            "DeepSpeed fp16/bf16 block sets one"
        )


def _reduce(model: dict[str, Any], par: dict[str, Any], ds: dict[str, Any], notes: list[str]) -> None:
    a, h = model["a"], model["h"]
    notes.append(
        f"--cpu: h {h} -> {8 * a} (head dimension 8), V {model['V']} -> 1024, s {model['s']} -> 128; "
        "layers, heads, key/value heads, MLP ratio, embeddings and positions kept"
    )
    model.update(h=8 * a, V=1024, s=128)
    if "ffn_hidden" in model:  # the same ratio to h, rounded up to what tensor parallelism splits
        step = 2 * par.get("tp", 1)
        ffn = -(-model["ffn_hidden"] * 8 * a // h // step) * step
        notes.append(f"--cpu: ffn_hidden {model['ffn_hidden']} -> {ffn}")
        model["ffn_hidden"] = ffn
    if model.get("dtype") == "fp16":
        notes.append("--cpu: fp16 -> fp32 (DeepSpeed's fp16 runs on GPUs only)")
        model["dtype"] = "fp32"
        ds.pop("fp16", None)
    for key in ("train_batch_size",):
        if key in ds:
            notes.append(f"--cpu: deepspeed {key} left out (dp changes)")
            ds.pop(key)


def _drop_unmodelled(ds: dict[str, Any], stage: int, notes: list[str]) -> bool:
    """Leave out what DeepSpeed refuses (it would not run); keep what the model does not follow yet, noted.
    Returns whether anything kept is not modelled (the scenario is then a baseline-only gate)."""
    for path, message in dsconfig.refused_keys(ds):
        section = ds if len(path) == 1 else ds[path[0]]
        del section[path[-1]]
        notes.append(f"deepspeed {'.'.join(path)} left out: {message.removesuffix(': leave it out')}")
    unmodelled = dsconfig.violations(ds, stage)
    for path, value, expected, what in unmodelled:
        notes.append(
            f"deepspeed {'.'.join(path)} = {value!r} kept: {what} is not modelled yet (the model follows "
            f"{expected}), so the scenario gates against its baseline only (expectations.model.check: false)"
        )
    if "train_batch_size" in ds:
        ds.pop("train_batch_size")
        notes.append("deepspeed train_batch_size left out (commgate derives it from dp, b and m)")
    if autos := _autos(ds):
        notes.append(
            f"deepspeed {', '.join(autos)}: \"auto\" is Hugging Face's placeholder; commgate's own workloads take "
            "the scenario's value (or DeepSpeed's default) for it, Trainer its own: for a Trainer job, import "
            "with --trainer hf"
        )
    return bool(unmodelled)


# --------------------------------------------------------------------------------------------- torchtitan


@dataclass(frozen=True, kw_only=True)
class TitanJob:
    """A torchtitan job as its config states it: a TOML of torchtitan <= 0.2.2 (``torchtitan_toml``), or a
    0.3.0 config function read by torchtitan's own ``ConfigManager``
    (``commgate.run.trainers.torchtitan.read_config``). Degrees as torchtitan writes them (dp -1: the rest)."""

    source: str
    config: str
    """The torchtitan 0.3.0 config function the scenario runs (``torchtitan.config``)."""
    module: str = "llama3"
    model: dict[str, Any]
    """L, h, a, kv_heads, ffn_hidden, V, tied_embeddings."""
    local_batch_size: int
    global_batch_size: int = -1
    """-1: ``local_batch_size`` x the data-parallel degree, one gradient-accumulation step (``trainer.py:415``)."""
    seq_len: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    replicate: int = 1
    schedule: str = "1F1B"
    """``pipeline_parallel_schedule``: torchtitan's name of torch's schedule class."""
    microbatch_size: int = 1
    """``pipeline_parallel_microbatch_size``."""
    sequence_parallel: bool = True
    ac: str = "selective"
    """none, selective or full."""
    loss: str = "chunked"
    loss_chunks: int = 8
    log_freq: int = 10
    mixed_precision_param: str = "bfloat16"
    reshard: str = "default"
    cpu_offload: bool = False
    """``training.enable_cpu_offload``."""
    compile: bool = False
    async_tp: bool = False
    float8: bool = False
    float8_all_gather: bool = False
    notes: tuple[str, ...] = ()


def torchtitan_toml(path: Path) -> TitanJob:
    """A torchtitan TOML (the format of torchtitan <= 0.2.2, ``torchtitan/models/llama3/train_configs``):
    the llama3 flavor's dimensions and the keys that change what the job sends; every other key is noted."""
    from commgate.model.trainers.torchtitan import LLAMA3_CONFIGS, flavor_model

    doc = _read(path, "torchtitan TOML")
    f = str(path)

    def get(section: str, key: str, default: Any) -> Any:
        block = doc.get(section, {})
        return block.get(key, default) if isinstance(block, dict) else default

    name, flavor = get("model", "name", None), str(get("model", "flavor", ""))
    if name is None:
        raise UsageError(f'{f}: [model] name missing: commgate models torchtitan\'s llama3 (name = "llama3")')
    if name != "llama3":
        raise UsageError(f"{f}: [model] name {name!r}: commgate models torchtitan's llama3 only")
    base = flavor.split("_")[0]  # debugmodel_flex_attn, 8B_varlen: the flavor's dimensions, another attention
    if base not in LLAMA3_CONFIGS:
        raise UsageError(f"{f}: [model] flavor {flavor!r}: commgate knows llama3's {', '.join(LLAMA3_CONFIGS)}")
    notes = [
        f"{f}: torchtitan {_TOML_VERSION} TOML; the scenario runs torchtitan 0.3.0's config {LLAMA3_CONFIGS[base]} "
        "(0.3.0 has no TOML): its loss is ChunkedLossWrapper (0.2.2's was plain cross-entropy), its selective "
        "checkpointing per-op"
    ]
    ac = get("activation_checkpoint", "mode", "selective")
    option = str(get("activation_checkpoint", "selective_ac_option", "op"))
    if ac == "selective" and option != "op":
        notes.append(
            f"{f}: activation_checkpoint.selective_ac_option {option!r} (one layer in {option}) has no 0.3.0 "
            "counterpart: 0.3.0's per-op selective checkpointing is predicted"
        )
    par = {k: get("parallelism", k, d) for k, d in _TOML_PARALLELISM.items()}
    converters = get("model", "converters", [])
    float8 = "float8" in converters
    used = {("model", k) for k in ("name", "flavor", "converters")} | {("parallelism", k) for k in _TOML_PARALLELISM}
    used |= {
        ("training", "local_batch_size"),
        ("training", "global_batch_size"),
        ("training", "enable_cpu_offload"),
        ("training", "mixed_precision_param"),
        ("training", "seq_len"),
        ("metrics", "log_freq"),
        ("compile", "enable"),
    }
    used |= {("activation_checkpoint", "mode"), ("activation_checkpoint", "selective_ac_option")}
    used |= {("quantize.linear.float8", "enable_fsdp_float8_all_gather")}
    float8_block = doc.get("quantize", {}).get("linear", {}).get("float8", {})
    precision = get("training", "mixed_precision_param", "bfloat16")
    if precision not in ("bfloat16", "float32"):  # FSDP2 gathers in it: it was read as bfloat16 whatever it said
        raise UsageError(f"{f}: training.mixed_precision_param = {precision!r}: torchtitan takes bfloat16 or float32")
    _toml_typos(doc, used, f)
    for section, block in _toml_sections(doc):
        notes += [f"{f}: [{section}] {k} ignored" for k in block if (section, k) not in used]
    return TitanJob(
        source=f,
        config=LLAMA3_CONFIGS[base],
        model=flavor_model(base),
        local_batch_size=_whole(get("training", "local_batch_size", 8), f"{f}: training.local_batch_size"),
        global_batch_size=_whole(get("training", "global_batch_size", -1), f"{f}: training.global_batch_size"),
        seq_len=_whole(get("training", "seq_len", 2048), f"{f}: training.seq_len"),
        dp=_whole(par["data_parallel_shard_degree"], f"{f}: parallelism.data_parallel_shard_degree"),
        tp=_whole(par["tensor_parallel_degree"], f"{f}: parallelism.tensor_parallel_degree"),
        pp=_whole(par["pipeline_parallel_degree"], f"{f}: parallelism.pipeline_parallel_degree"),
        cp=_whole(par["context_parallel_degree"], f"{f}: parallelism.context_parallel_degree"),
        replicate=_whole(par["data_parallel_replicate_degree"], f"{f}: parallelism.data_parallel_replicate_degree"),
        schedule=str(par["pipeline_parallel_schedule"]),
        microbatch_size=_whole(
            par["pipeline_parallel_microbatch_size"], f"{f}: parallelism.pipeline_parallel_microbatch_size"
        ),
        ac=str(ac),
        log_freq=_whole(get("metrics", "log_freq", 10), f"{f}: metrics.log_freq"),
        reshard=str(par["fsdp_reshard_after_forward"]),
        cpu_offload=bool(get("training", "enable_cpu_offload", False)),
        mixed_precision_param=str(precision),
        compile=bool(get("compile", "enable", False)),
        async_tp=bool(par["enable_async_tensor_parallel"]),
        float8=float8,
        float8_all_gather=float8 and bool(float8_block.get("enable_fsdp_float8_all_gather", False)),
        notes=tuple(notes),
    )


_TOML_VERSION = "<= 0.2.2"
_TOML_PARALLELISM: dict[str, Any] = {
    "data_parallel_shard_degree": -1,
    "data_parallel_replicate_degree": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "context_parallel_degree": 1,
    "pipeline_parallel_schedule": "1F1B",
    "pipeline_parallel_microbatch_size": 1,
    "fsdp_reshard_after_forward": "default",
    "enable_async_tensor_parallel": False,
}


_TOML_TABLES = frozenset(
    {
        "job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism", "checkpoint",
        "activation_checkpoint", "compile", "float8", "mx", "quantize", "quantize.linear", "quantize.linear.float8",
        "quantize.linear.mx", "quantize.grouped_mm", "quantize.grouped_mm.float8", "quantize.grouped_mm.mx",
        "comm", "memory_estimation", "fault_tolerance", "experimental", "validation", "validation.sampler",
    }
)  # fmt: skip
"""The tables of torchtitan 0.2.2's ``JobConfig`` (``torchtitan/config/job_config.py``)."""
_TOML_KEYS = {
    "model": {"name", "flavor", "tokenizer_path", "hf_assets_path", "converters", "print_after_conversion"},
    "training": {
        "dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
        "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile", "gc_freq", "gc_debug",
        "seed", "deterministic",
    },
    "parallelism": {
        "data_parallel_replicate_degree", "enable_compiled_autograd", "data_parallel_shard_degree",
        "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
        "enable_async_tensor_parallel", "pipeline_parallel_degree", "pipeline_parallel_split_points",
        "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "context_parallel_degree", "context_parallel_rotate_method",
        "expert_parallel_degree", "expert_tensor_parallel_degree", "module_fqns_per_model_part",
    },
    "metrics": {
        "log_freq", "enable_tensorboard", "disable_color_printing", "save_tb_folder", "save_for_all_ranks",
        "enable_wandb",
    },
    "activation_checkpoint": {
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop",
        "preserve_rng_state", "determinism_check", "debug",
    },
    "compile": {"enable", "components", "backend"},
}  # fmt: skip
"""Keys of those tables that commgate reads from, as torchtitan's ``JobConfig`` has them (0.2.x): a key that is
none of them but a letter or two from one commgate reads is a typo of it (``_toml_typos``)."""


def _toml_typos(doc: dict[str, Any], used: set[tuple[str, str]], f: str) -> None:
    """A key or table a letter or two from one commgate reads is a typo of it, not a key to ignore:
    ``tensor_parallel_degre = 2`` was noted "ignored" among 38 others and the job imported at tp 1, and a
    ``[trainng]`` table's batch and sequence length likewise; a count written as a string was taken as its
    number (found by an adversarial pass). One line each, nothing written."""
    tables = {section for section, _ in used}
    for section, block in _toml_sections(doc):
        if section not in _TOML_TABLES and (close := difflib.get_close_matches(section, sorted(tables), 1, 0.8)):
            raise UsageError(f"{f}: [{section}]: torchtitan has no such table; did you mean [{close[0]}]?")
        own = sorted(k for s, k in used if s == section)
        for key, value in block.items():
            if (section, key) in used:
                count = section in ("parallelism", "training") and isinstance(_TOML_PARALLELISM.get(key, 0), int)
                if count and isinstance(value, str) and value.lstrip("-").isdigit():
                    raise UsageError(f"{f}: {section}.{key} = {value!r}: a string; write the number ({value})")
                continue
            if key in _TOML_KEYS.get(section, ()):
                continue
            if close := difflib.get_close_matches(key, own, 1, 0.9):
                raise UsageError(f"{f}: [{section}] {key}: torchtitan has no such key; did you mean {close[0]}?")


def _toml_sections(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(dotted section, its scalar keys) of every table of a TOML document."""
    out = []
    for key, value in doc.items():
        if isinstance(value, dict):
            name = f"{prefix}{key}"
            out.append((name, {k: v for k, v in value.items() if not isinstance(v, dict)}))
            out += _toml_sections(value, f"{name}.")
    return out


def torchtitan(
    job: TitanJob, *, dp: int | None, tp: int | None, pp: int | None = None, cpu: bool, name: str | None
) -> Imported:
    """The ``trainer: torchtitan`` scenario of ``job``: full size (``--cpu``: the reduced variant that runs).
    What the job does that a CPU run cannot is named in ``torchtitan.left_off`` and in the scenario's first
    lines; what the model cannot hold turns the model check off (baseline-only), saying why."""
    f = job.source
    degrees = (("dp", dp, job.dp, "data_parallel_shard_degree"), ("tp", tp, job.tp, "tensor_parallel_degree"),
               ("pp", pp, job.pp, "pipeline_parallel_degree"))  # fmt: skip
    for flag, given, own, key in degrees:  # a degree the config sets, changed by a flag: said, not silent
        if given is not None and given != own and own != _TOML_PARALLELISM[key]:
            job = replace(job, notes=(*job.notes, f"{f}: --{flag} {given} in place of the config's {key} = {own}"))
    dp = dp if dp is not None else job.dp
    if dp < 1:
        raise UsageError(f"{f}: data_parallel_shard_degree = {job.dp} (the rest of the ranks): give --dp")
    tp = tp if tp is not None else job.tp
    pp = pp if pp is not None else job.pp
    for flag, value in (("tp", tp), ("pp", pp)):
        if value < 1:
            raise UsageError(f"{f}: {flag} = {value} (--{flag} or the config's degree): give 1 or more")
    if job.cp > 1 and pp != 1:
        raise UsageError(
            f"{f}: context_parallel_degree = {job.cp} with pp = {pp}: torchtitan's context parallelism is modelled "
            "with FSDP2 and TP, not its pipeline (give --pp 1)"
        )
    steps = _accumulation(job, dp)
    out = Imported(doc={}, notes=list(job.notes))
    tied = {"tied_embeddings": True} if job.model.get("tied_embeddings") else {}  # one [emb, norm, head] group
    model = {"architecture": "llama", **{k: v for k, v in job.model.items() if k != "tied_embeddings"}, **tied}
    model |= {"s": job.seq_len, "dtype": "fp32"}
    par: dict[str, Any] = {"dp": dp, "tp": tp}
    b = job.local_batch_size
    if cpu:
        _reduce(model, par, {}, out.notes)
        if b > 1 and pp == 1:  # a pipeline's local batch is its micro-batches: the schedule, kept
            out.notes.append(f"--cpu: local_batch_size {b} -> 1 (the accumulation steps kept)")
            b = 1
        if job.cp > 1:  # flex CP splits the sequence into whole 128-token blocks
            out.notes.append(f"--cpu: s {model['s']} -> {128 * job.cp} (flex attention's 128-token blocks x cp)")
            model["s"] = 128 * job.cp
    ac = job.ac != "none"
    parallelism: dict[str, Any]
    if job.cp > 1:
        parallelism = {
            "scheme": "cp",
            "cp": job.cp,
            **({"dp": dp} if dp > 1 else {}),
            **({"tp": tp, "sequence_parallel": job.sequence_parallel} if tp > 1 else {}),
            **({"dp_replicate": job.replicate} if job.replicate > 1 else {}),  # the rules say what HSDP composes with
            "micro_batch": b,
            **({"micro_batches": steps} if steps > 1 else {}),
            "activation_checkpointing": ac,
        }
    elif pp > 1:
        parallelism = _titan_pipeline(job, dp, tp, pp, ac)
    else:
        parallelism = {"scheme": "fsdp" if dp > 1 else "tp", "dp": dp, "tp": tp}
        if job.replicate > 1:  # HSDP: replicas of the sharded model (the rules say what it composes with)
            parallelism["dp_replicate"] = job.replicate
        if tp > 1:
            parallelism["sequence_parallel"] = job.sequence_parallel
        parallelism["micro_batch"] = b
        if steps > 1:  # torchtitan's gradient accumulation: the scenario's micro-batches without a pipeline
            parallelism["micro_batches"] = steps
        parallelism["activation_checkpointing"] = ac
    block = _torchtitan_block(job, out)
    if pp > 1 and steps > 1:  # the schedule's steps per optimizer step (micro_batches are the schedule's)
        block["gradient_accumulation_steps"] = steps
    out.doc = {
        "schema_version": 1,
        "name": name or scenario_name(Path(job.source)) if Path(job.source).suffix == ".toml" else name or job.config,
        "description": f"Imported by commgate import from torchtitan {job.source}",
        "trainer": "torchtitan",
        "torchtitan": block,
        "model": model,
        "parallelism": parallelism,
    }
    unchecked = _not_modelled(job, tp)
    if unchecked:
        out.doc["expectations"] = {"model": {"check": False}}
        out.comments.append(f"expectations.model.check false (baseline-only): {unchecked}")
    return out


def _accumulation(job: TitanJob, dp: int) -> int:
    """torchtitan's gradient-accumulation steps: ``global_batch_size / (local_batch_size x dp_replicate x
    dp_shard)`` (``trainer.py:415-433``; -1: one step)."""
    f, g = job.source, job.global_batch_size
    if g == -1:
        return 1
    per_step = job.local_batch_size * dp * job.replicate
    steps, rest = divmod(g, per_step)
    if g < 1 or rest or not steps:
        raise UsageError(
            f"{f}: global_batch_size = {g} is not a positive multiple of local_batch_size x data-parallel degree = "
            f"{job.local_batch_size} x {dp * job.replicate} (torchtitan refuses it too): give a multiple, or -1"
        )
    return steps


TITAN_SCHEDULES = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved-1f1b",
    "InterleavedZeroBubble": "zero-bubble",
}
"""torchtitan's ``pipeline_parallel_schedule`` names (torch's schedule classes) -> commgate's; the others
(ZBVZeroBubble, DualPipeV, looped BFS, a CSV schedule) are not modelled under torchtitan."""


def _titan_pipeline(job: TitanJob, dp: int, tp: int, pp: int, ac: bool) -> dict[str, Any]:
    """The ``parallelism`` block of torchtitan's pipeline: its schedule, ``local_batch_size /
    pipeline_parallel_microbatch_size`` micro-batches of the micro-batch size (``trainer.py:434-438``),
    FSDP2 in each stage over dp, tensor parallelism inside (torchtitan's 3-D)."""
    f = job.source
    if job.schedule not in TITAN_SCHEDULES:
        raise UsageError(
            f"{f}: pipeline_parallel_schedule = {job.schedule!r}: torchtitan's {', '.join(TITAN_SCHEDULES)} are "
            "modelled; write the scenario with one of them, or gate it baseline-only"
        )
    if job.microbatch_size < 1:
        raise UsageError(f"{f}: pipeline_parallel_microbatch_size = {job.microbatch_size}: give 1 or more")
    m, rest = divmod(job.local_batch_size, job.microbatch_size)
    if rest or not m:
        raise UsageError(
            f"{f}: local_batch_size = {job.local_batch_size} is not a multiple of pipeline_parallel_microbatch_size"
            f" = {job.microbatch_size} (torchtitan refuses it too)"
        )
    schedule = TITAN_SCHEDULES[job.schedule]
    pipeline: dict[str, Any] = {"engine": "torch", "schedule": schedule}
    if schedule in (
        "interleaved-1f1b",
        "zero-bubble",
    ):  # torchtitan's default: 2 stages a rank (pipeline_parallel.py:256-262)
        pipeline["virtual_stages"] = 2
    axes = {"tp": tp, "sequence_parallel": job.sequence_parallel} if tp > 1 else {}
    return {
        "scheme": "fsdp" if dp > 1 else "3d" if tp > 1 else "pp",
        "dp": dp,
        **axes,
        "pp": pp,
        "micro_batch": job.microbatch_size,
        "micro_batches": m,
        "activation_checkpointing": ac,
        "pipeline": pipeline,
    }


TOML_KEYS = {
    "activation_checkpoint": "[activation_checkpoint] mode",
    "mixed_precision_param": "[training] mixed_precision_param",
    "fsdp_reshard_after_forward": "[parallelism] fsdp_reshard_after_forward",
    "cpu_offload": "[training] enable_cpu_offload",
    "log_freq": "[metrics] log_freq",
}
"""The ``torchtitan:`` block's keys and the TOML keys they are read from."""


def _torchtitan_block(job: TitanJob, out: Imported) -> dict[str, Any]:
    """The scenario's ``torchtitan:`` block: what the model needs beyond the model and parallelism blocks,
    torchtitan's defaults left out; ``left_off`` what a CPU run cannot do, each named in a comment."""
    from commgate.model.trainers.torchtitan import LEFT_OFF_WHY, Job

    default = Job()
    block: dict[str, Any] = {"module": job.module, "config": job.config}
    if job.ac != "none":
        block["activation_checkpoint"] = job.ac
    for key, value, was in (
        ("mixed_precision_param", job.mixed_precision_param, default.mixed_precision_param),
        ("fsdp_reshard_after_forward", job.reshard, default.fsdp_reshard_after_forward),
        ("cpu_offload", job.cpu_offload, default.cpu_offload),
        ("loss", job.loss, default.loss),
        ("loss_chunks", job.loss_chunks, default.loss_chunks),
        ("log_freq", job.log_freq, default.log_freq),
    ):
        if value != was:
            block[key] = value
    left_off = [
        what for what, on in (("compile", job.compile), ("async_tp", job.async_tp), ("float8", job.float8)) if on
    ]
    if Path(job.source).suffix == ".toml":
        out.origins |= {f"$.torchtitan.{k}": f"{job.source}: {key}" for k, key in TOML_KEYS.items() if k in block}
    if left_off:
        block["left_off"] = left_off
    for what in left_off:
        out.comments.append(f"torchtitan.left_off {what}: the job {LEFT_OFF_WHY[what][0]}; {LEFT_OFF_WHY[what][1]}")
    return block


def _not_modelled(job: TitanJob, tp: int) -> str:
    """Why the model cannot be checked against this job (empty: it can)."""
    why = []
    if job.float8_all_gather:
        why.append("float8 all-gathers (quantize.linear.float8.enable_fsdp_float8_all_gather) are not modelled")
    if job.float8 and tp > 1:
        why.append("float8 under tensor parallelism adds amax all-reduces the model does not hold")
    if tp > 1 and not job.sequence_parallel:
        why.append("TP without sequence parallelism is measured, not modelled")
    return "; ".join(why)


# ------------------------------------------------------------------------------------- Hugging Face Trainer


def hf_trainer(*, hf: Path, deepspeed: Path | None, dp: int, out: Path, name: str | None = None) -> Imported:
    """A ``trainer: hf`` scenario of the job ``hf`` (a ``config.json``) and ``deepspeed`` (its DeepSpeed JSON,
    or None: DDP) describe on ``dp`` ranks, to be written at ``out``: the inputs named as they are, what
    Trainer resolves from them written out (the fields, and a comment per decision)."""
    import os

    from commgate.core.errors import CommgateError
    from commgate.model.loader import load_document
    from commgate.model.trainers import hf as trainer

    cfg = _read(hf, "Hugging Face config.json")
    ds = _read(deepspeed, "DeepSpeed JSON config") if deepspeed is not None else {}
    notes: list[str] = []
    args = _trainer_arguments(ds, cfg, notes, deepspeed)
    out.parent.mkdir(parents=True, exist_ok=True)  # the paths are relative to it
    base = out.parent.resolve()
    block: dict[str, Any] = {"config": os.path.relpath(hf.resolve(), base)}
    if deepspeed is not None:
        block["deepspeed"] = os.path.relpath(deepspeed.resolve(), base)
    if args:
        block["training_args"] = args
    # as transformers reads it: GPT-2's config names it n_positions (its attribute_map); it was read as absent, and
    # the import refused its own 2048 against the model's learned positions (found by an adversarial pass)
    read = (
        None if "max_position_embeddings" in cfg else getattr(trainer._hf_config(hf), "max_position_embeddings", None)
    )
    s = cfg.get("max_position_embeddings", read or 2048)
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise UsageError(f"{hf}: max_position_embeddings: {json.dumps(s)} is not a whole number of 1 or more: give one")
    doc: dict[str, Any] = {
        "schema_version": 1,
        "name": name or scenario_name(hf),
        "description": "Imported by commgate import --trainer hf from "
        + ", ".join(map(str, filter(None, (hf, deepspeed)))),
        "trainer": "hf",
        "hf": block,
        "model": {"s": s},
        "parallelism": {"dp": dp},
    }
    try:
        derived = trainer.derive(doc, str(out))
        (scenario,) = load_document(derived, file=str(out))
    except CommgateError as exc:  # nothing is written: the message names the inputs' fields, not the file
        why = str(exc).replace("\n", "; ").removeprefix(f"{out}:").strip()
        raise UsageError(f"{out} not written: the imported scenario is refused: {why}") from None
    whence = (
        "'s max_position_embeddings"
        if "max_position_embeddings" in cfg
        else f"'s max_position_embeddings as transformers reads it ({read})"
        if read
        else " states no max_position_embeddings"
    )
    comments = [  # an edit to make, not a note of the job: in the file's head, not repeated by every run
        f"model.s = {s}, {hf.name}{whence}: set it to the sequence length you train with",
        "resolved by trainer hf (transformers' and accelerate's own code), checked when loaded:",
    ]
    comments += [f"  {line}" for line in trainer.derived(scenario)]
    return Imported(doc=derived, notes=notes, comments=comments)


TRAINER_FROM_DEEPSPEED = (
    (("train_micro_batch_size_per_gpu",), "per_device_train_batch_size"),
    (("gradient_accumulation_steps",), "gradient_accumulation_steps"),
    (("optimizer", "params", "lr"), "learning_rate"),
    (("optimizer", "params", "eps"), "adam_epsilon"),
    (("optimizer", "params", "weight_decay"), "weight_decay"),
    (("gradient_clipping",), "max_grad_norm"),
)
"""A DeepSpeed JSON's explicit values that Trainer requires its ``TrainingArguments`` to match
(``integrations/deepspeed.py``'s ``fill_match``): the import writes them as the arguments."""


def _trainer_arguments(
    ds: dict[str, Any], cfg: dict[str, Any], notes: list[str], source: Path | None
) -> dict[str, Any]:
    """The ``TrainingArguments`` a job with DeepSpeed JSON ``ds`` must have passed: its explicit values where
    Trainer checks they match, and ``bf16``/``fp16`` where the JSON enables one, or leaves it "auto" for a
    model shipped in that dtype (Trainer's ``--bf16``; said in a note)."""
    args: dict[str, Any] = {}
    for keys, arg in TRAINER_FROM_DEEPSPEED:
        value: Any = ds
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            args[arg] = value
    betas = (
        ((ds.get("optimizer") or {}).get("params") or {}).get("betas")
        if isinstance(ds.get("optimizer"), dict)
        else None
    )
    if isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) for b in betas):
        args["adam_beta1"], args["adam_beta2"] = betas
    shipped = cfg.get("torch_dtype") or cfg.get("dtype")
    for kind, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        enabled = (ds.get(kind) or {}).get("enabled") if isinstance(ds.get(kind), dict) else None
        if enabled is True or (enabled == "auto" and shipped == dtype):
            args[kind] = True
            if enabled == "auto":
                notes.append(
                    f'{source}: {kind}.enabled "auto" with a model shipped in {dtype}: written as Trainer\'s --{kind} '
                    f"(hf.training_args.{kind}: true); set it false if your job does not pass it"
                )
    if args:
        notes.append(f"{source}: its explicit values written as the TrainingArguments Trainer requires them to "
                     f"match: {', '.join(f'{k}={v}' for k, v in args.items())}")  # fmt: skip
    return args


def _autos(d: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose value is ``"auto"``."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _autos(v, f"{prefix}{k}.")
        elif v == "auto":
            out.append(prefix + k)
    return out
