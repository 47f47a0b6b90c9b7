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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from commgate.core.errors import UsageError
from commgate.model import dsconfig

NEOX_USED = {
    "num-layers", "hidden-size", "num-attention-heads", "seq-length", "max-position-embeddings", "pos-emb",
    "no-weight-tying", "pipe-parallel-size", "model-parallel-size", "checkpoint-activations", "precision",
}  # fmt: skip


@dataclass
class Imported:
    doc: dict[str, Any]
    """The scenario document."""
    notes: list[str] = field(default_factory=list)
    """What was ignored or left out, one line each."""
    comments: list[str] = field(default_factory=list)
    """What the written file says in comments, one line each (a trainer's resolved values)."""


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not a {what} ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: a {what} is a mapping, found {type(doc).__name__}")
    return doc


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
        raise UsageError("commgate import needs at least one of --neox, --deepspeed, --hf")
    out = Imported(doc={})
    model: dict[str, Any] = {}
    par: dict[str, Any] = {}
    ds: dict[str, Any] = {}
    if neox:
        _neox(_read(neox, "GPT-NeoX config"), model, par, ds, out.notes, str(neox))
    if hf:
        _hf(_read(hf, "Hugging Face config.json"), model, out.notes, str(hf))
    if deepspeed:
        ds = _merge(ds, _read(deepspeed, "DeepSpeed JSON config"))
    if tp is not None:
        par["tp"] = tp
    if pp is not None:
        par["pp"] = pp
    par["dp"] = dp
    if "L" not in model:
        raise UsageError("no model dimensions: give --neox or --hf (a DeepSpeed config has none)")
    stage = ds.get("zero_optimization", {}).get("stage", 0) if isinstance(ds.get("zero_optimization"), dict) else 0
    stage = _whole(stage, "deepspeed zero_optimization.stage") if dsconfig.given(stage) else 0
    par["scheme"] = _scheme(par, stage)
    for key in ("bf16", "fp16"):
        if dsconfig.enabled(ds, key):
            model["dtype"] = key
    if cpu:
        _reduce(model, par, ds, out.notes)
    _drop_unmodelled(ds, stage, out.notes)
    par.setdefault("tp", 1)
    par.setdefault("pp", 1)
    out.doc = {
        "schema_version": 1,
        "name": name or _name(neox or hf or deepspeed),
        "description": "Imported by commgate import from " + ", ".join(str(p) for p in (neox, deepspeed, hf) if p),
        "model": model,
        "parallelism": {k: par[k] for k in ("scheme", "dp", "tp", "pp") if k in par}
        | {k: v for k, v in par.items() if k not in ("scheme", "dp", "tp", "pp")},
    }
    if ds:
        out.doc["deepspeed"] = ds
    return out


def _name(path: Path | None) -> str:
    if path is None:
        return "imported"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in path.stem) or "imported"


def _scheme(par: dict[str, Any], stage: int) -> str:
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    if tp > 1 and pp > 1:
        return "3d"
    if pp > 1:
        return "pp"
    if tp > 1:
        return "tp"
    return {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _whole(value: Any, where: str) -> int:
    """``value`` as a whole number; a one-line ``UsageError`` naming ``where`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{where}: {value!r} is not a whole number")
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
    get = {k.replace("_", "-"): v for k, v in cfg.items()}
    for key, target in (("num-layers", "L"), ("hidden-size", "h"), ("num-attention-heads", "a"), ("seq-length", "s")):
        if key in get:
            model[target] = _whole(get[key], f"{f}: {key}")
    model["V"] = 50304  # GPT-NeoX pads its tokenizer's vocabulary to a multiple of 128 (50277 -> 50304)
    notes.append(f"{f}: V = 50304, GPT-NeoX's padded vocabulary (the config does not state it)")
    pos = get.get("pos-emb", "learned")
    model["position"] = {"rotary": "rotary", "learned": "learned", "none": "none"}.get(pos, "learned")
    if pos not in ("rotary", "learned", "none"):
        notes.append(f"{f}: pos-emb {pos!r} has no counterpart; learned positions assumed")
    model["tied_embeddings"] = not get.get("no-weight-tying", False)
    if (pp := _whole(get.get("pipe-parallel-size", 0), f"{f}: pipe-parallel-size")) > 1:
        par["pp"] = pp
    if (tp := _whole(get.get("model-parallel-size", 1), f"{f}: model-parallel-size")) > 1:
        par["tp"] = tp
    if get.get("checkpoint-activations"):
        par["activation_checkpointing"] = True
    for key, value in cfg.items():
        if key in dsconfig.TOP_LEVEL:
            ds[key] = value
        elif key.replace("_", "-") not in NEOX_USED:
            notes.append(f"{f}: {key} ignored (no communication effect commgate models)")


HF_LLAMA = ("llama", "mistral", "qwen2")
"""Hugging Face model types imported as ``architecture: llama`` (Mistral's sliding window changes no
parameter and no collective; Qwen2 adds biases to the Q, K and V projections: ``qkv_bias``)."""
HF_TYPES = ("gpt_neox", *HF_LLAMA)
"""Every Hugging Face ``model_type`` commgate imports."""

HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _hf(cfg: dict[str, Any], model: dict[str, Any], notes: list[str], f: str) -> None:
    kind = cfg.get("model_type")
    if kind not in HF_TYPES:
        raise UsageError(f"{f}: model_type {kind!r}: commgate imports {', '.join(HF_TYPES)} configs")
    try:
        h, a = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        model.update(
            L=int(cfg["num_hidden_layers"]),
            h=h,
            a=a,
            V=int(cfg["vocab_size"]),
            s=int(cfg.get("max_position_embeddings", 2048)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
        if "intermediate_size" in cfg:
            model["ffn_hidden"] = int(cfg["intermediate_size"])
        model.pop("x", None)
        if kind in HF_LLAMA:
            model.update(architecture="llama", kv_heads=int(cfg.get("num_key_value_heads") or a))
            if kind == "qwen2":  # Qwen2Attention: bias=True on q_proj, k_proj, v_proj (not o_proj)
                model["qkv_bias"] = True
            model.pop("position", None)  # rotary
        else:
            model["position"] = "rotary"
    except KeyError as exc:
        raise UsageError(f"{f}: {exc.args[0]} missing (a {kind} config.json states it)") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{f}: not a number where one is needed ({exc})") from None
    notes.append(f"{f}: s = max_position_embeddings = {model['s']}; set model.s to the sequence length you train with")
    for key in ("attention_bias", "mlp_bias"):
        if kind in HF_LLAMA and cfg.get(key):
            raise UsageError(f"{f}: {key}: true: Llama-style layers with biases are not modelled")
    head_dim = cfg.get("head_dim")
    if kind in HF_LLAMA and head_dim is not None and int(head_dim) * a != h:
        raise UsageError(f"{f}: head_dim {head_dim} != hidden_size/num_attention_heads = {h}/{a}: not modelled")
    if kind in HF_LLAMA and cfg.get("hidden_act", "silu") != "silu":
        notes.append(f"{f}: hidden_act {cfg['hidden_act']!r}: the gated MLP's activation moves no bytes; SiLU is run")
    if dtype := HF_DTYPES.get(str(cfg.get("torch_dtype"))):
        model["dtype"] = dtype
        notes.append(f"{f}: dtype {dtype} from torch_dtype (a DeepSpeed fp16/bf16 block overrides it)")
    used = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "max_position_embeddings", "tie_word_embeddings", "intermediate_size", "num_key_value_heads",
            "attention_bias", "mlp_bias", "head_dim", "hidden_act", "torch_dtype"}  # fmt: skip
    notes += [f"{f}: {k} ignored" for k in cfg if k not in used]


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


def _drop_unmodelled(ds: dict[str, Any], stage: int, notes: list[str]) -> None:
    for key, message in dsconfig.refused_keys(ds):
        del ds["zero_optimization"][key]
        notes.append(f"deepspeed zero_optimization.{key} left out: {message}")
    for path, value, expected, what in dsconfig.violations(ds, stage):
        parent: Any = ds
        for part in path[:-1]:
            parent = parent[part]
        del parent[path[-1]]
        notes.append(
            f"deepspeed {'.'.join(path)} = {value!r} left out: {what} is not modelled yet "
            f"(the model follows {expected})"
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


def hf_trainer(*, hf: Path, deepspeed: Path | None, dp: int, out: Path, name: str | None = None) -> Imported:
    """A ``trainer: hf`` scenario of the job ``hf`` (a ``config.json``) and ``deepspeed`` (its DeepSpeed JSON,
    or None: DDP) describe on ``dp`` ranks, to be written at ``out``: the inputs named as they are, what
    Trainer resolves from them written out (the fields, and a comment per decision)."""
    import os

    from commgate.core.errors import CommgateError
    from commgate.model.loader import load_document
    from commgate.model.trainers import hf as trainer

    cfg = _read(hf, "Hugging Face config.json")
    if deepspeed is not None:
        _read(deepspeed, "DeepSpeed JSON config")
    out.parent.mkdir(parents=True, exist_ok=True)  # the paths are relative to it
    base = out.parent.resolve()
    block: dict[str, Any] = {"config": os.path.relpath(hf.resolve(), base)}
    if deepspeed is not None:
        block["deepspeed"] = os.path.relpath(deepspeed.resolve(), base)
    s = int(cfg.get("max_position_embeddings", 2048))
    doc: dict[str, Any] = {
        "schema_version": 1,
        "name": name or _name(hf),
        "description": "Imported by commgate import --trainer hf from "
        + ", ".join(map(str, filter(None, (hf, deepspeed)))),
        "trainer": "hf",
        "hf": block,
        "model": {"s": s},
        "parallelism": {"dp": dp},
    }
    notes = [f"{hf}: s = max_position_embeddings = {s}; set model.s to the sequence length you train with"]
    try:
        derived = trainer.derive(doc, str(out))
        (scenario,) = load_document(derived, file=str(out))
    except CommgateError as exc:
        raise UsageError(str(exc).replace("\n", "; ")) from None
    comments = ["resolved by trainer hf (transformers' and accelerate's own code), checked when loaded:"]
    comments += [f"  {line}" for line in trainer.derived(scenario)]
    return Imported(doc=derived, notes=notes, comments=comments)


def _autos(d: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose value is ``"auto"``."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _autos(v, f"{prefix}{k}.")
        elif v == "auto":
            out.append(prefix + k)
    return out
