"""A seeded generator of random valid *trainer* scenarios: each trainer commgate runs as itself (``trainer:
torchtitan``, ``hf``, ``megatron``) crossed with its parallelism and the knobs that change what it sends.
Where a trainer reads its own configuration files (a Hugging Face ``config.json`` and DeepSpeed JSON,
``"auto"`` values and all), the generator writes them too. Used by ``tests/test_generated_trainers.py``; the
same seed always gives the same jobs, so a failure is replayed with its seed.

    python tests/trainer_gen.py SEED [COUNT] [DIR]    # write COUNT jobs per trainer under DIR, print their files

A draw may be one the trainer refuses (its rules say so, in one line): ``job`` draws again, and counts how
many it refused, so that a generator whose draws are all refused is seen, not silently empty.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from commgate.core.errors import ScenarioError
from commgate.model.loader import load_file
from commgate.model.scenario import Scenario

MAX_WORLD = 4
"""Ranks: a real trainer's rank imports its framework; more than 4 on 2 cores only wait on each other."""


@dataclass(frozen=True)
class Draw:
    """One job: the scenario document and the files it names (relative to the scenario file)."""

    doc: dict[str, Any]
    files: dict[str, Any]
    """file name -> JSON content."""


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
}


def _hf_config(rng: random.Random) -> dict[str, Any]:
    """A Llama-, Mistral-, Qwen2- (biases on Q, K, V) or GPT-NeoX-family (biases on every linear layer)
    ``config.json`` small enough for CPU ranks."""
    family = rng.choice(list(ARCHITECTURES))
    heads = rng.choice([2, 4])
    cfg: dict[str, Any] = {
        "model_type": family,
        "architectures": [ARCHITECTURES[family]],
        "vocab_size": rng.choice([128, 256, 320]),
        "hidden_size": heads * rng.choice([8, 16]),
        "intermediate_size": rng.choice([64, 96, 176]),
        "num_hidden_layers": rng.choice([1, 2, 3]),
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (1, 2, heads) if heads % k == 0]),
        "max_position_embeddings": 64,
        "tie_word_embeddings": rng.random() < 0.3,
        "rms_norm_eps": 1e-5,
    }
    if family == "mistral":
        cfg["sliding_window"] = rng.choice([None, 4096])
    if family == "gpt_neox":
        del cfg["num_key_value_heads"], cfg["rms_norm_eps"]
        cfg |= {"layer_norm_eps": 1e-5, "rotary_pct": rng.choice([0.5, 1.0])}
        cfg["use_parallel_residual"] = rng.random() < 0.5
    return cfg


def _auto_or(rng: random.Random, value: Any) -> Any:
    return "auto" if rng.random() < 0.6 else value


def _deepspeed(rng: random.Random, stage: int, bf16: bool) -> dict[str, Any]:
    """A DeepSpeed JSON as Hugging Face's examples write them: ``"auto"`` where Trainer fills it, or a value."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": rng.random() < 0.5, "contiguous_gradients": True}
    zero["reduce_bucket_size"] = _auto_or(rng, rng.choice([5e5, 2e8]))
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = _auto_or(rng, rng.choice([5e4, 5e8]))
        zero["stage3_param_persistence_threshold"] = _auto_or(rng, rng.choice([0, 100, 1e6]))
        zero["stage3_max_live_parameters"] = 1e9
        zero["stage3_max_reuse_distance"] = 1e9
    elif rng.random() < 0.5:
        zero["allgather_bucket_size"] = rng.choice([5e5, 2e8])
    ds: dict[str, Any] = {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto" if rng.random() < 0.7 else bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": _auto_or(rng, 1.0),
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    if rng.random() < 0.5:
        ds["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        }
    return ds


def hf(rng: random.Random, index: int) -> Draw:
    """A Hugging Face Trainer job: DDP, FSDP2 (accelerate's plugin) or ZeRO-1/2/3 over a generated
    ``config.json``."""
    cfg = _hf_config(rng)
    fsdp = rng.random() < 0.2  # FSDP2 through accelerate's plugin; else DDP or a ZeRO stage
    stage = None if fsdp else rng.choice([None, 1, 2, 3])
    bf16 = rng.random() < 0.3
    args: dict[str, Any] = {
        "per_device_train_batch_size": rng.choice([1, 2]),
        "gradient_accumulation_steps": rng.choice([1, 1, 2]),
        "logging_steps": rng.choice([1, 2, 5]),
        "learning_rate": 1e-4,
        "bf16": bf16,
    }
    if rng.random() < 0.3:
        args["average_tokens_across_devices"] = rng.random() < 0.5
    if rng.random() < 0.3:
        args["include_num_input_tokens_seen"] = rng.choice([True, False, "non_padding"])
    files: dict[str, Any] = {"config.json": cfg}
    block: dict[str, Any] = {"config": "config.json", "training_args": args}
    if fsdp:
        args |= {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
        if rng.random() < 0.4:
            args["fsdp_config"]["reshard_after_forward"] = rng.choice([True, False])
    elif stage is None:
        if rng.random() < 0.4:
            args["ddp_find_unused_parameters"] = rng.choice([True, False])
        if rng.random() < 0.4:  # buckets of 1 MB over a model of several: the rebuilt buckets' boundaries
            args["ddp_bucket_cap_mb"] = 1
            cfg |= {"hidden_size": 256, "intermediate_size": 1024, "vocab_size": 2048}
    else:
        files["ds.json"] = _deepspeed(rng, stage, bf16)
        block["deepspeed"] = "ds.json"
    doc = {
        "schema_version": 1,
        "name": f"gen-hf-{index}",
        "trainer": "hf",
        "hf": block,
        "model": {"s": rng.choice([16, 32])},
        "parallelism": {"dp": rng.choice([2, 2, 3, 4])},
        "steps": 2,
        "warmup_steps": 1,
    }
    return Draw(doc=doc, files=files)


def torchtitan(rng: random.Random, index: int) -> Draw:
    """A torchtitan job: its llama3 debug config on a drawn llama3, FSDP2 (HSDP), TP with sequence
    parallelism, FSDP2 x TP, its pipeline under each schedule (FSDP2 in its stages) or its context
    parallelism (with FSDP2 over dp x cp), with its checkpointing, precision, resharding, loss and logging
    knobs, and gradient accumulation outside its pipeline."""
    a = rng.choice([2, 4])
    tp = rng.choice([1, 2])
    dp = rng.choice([d for d in (1, 2, 4) if d * tp <= MAX_WORLD and d * tp > 1])
    model = {
        "architecture": "llama",
        "L": rng.choice([1, 2]),
        "h": a * rng.choice([8, 16, 18]),
        "a": a,
        "kv_heads": rng.choice([k for k in (1, 2, a) if a % k == 0 and k % tp == 0] or [a]),
        "ffn_hidden": rng.choice([64, 96, 130, 195]),
        "V": rng.choice([258, 320, 385]),
        "s": rng.choice([32, 64]),
        "dtype": "fp32",
    }
    block: dict[str, Any] = {"config": "llama3_debugmodel", "log_freq": rng.choice([1, 2, 10])}
    ac = rng.random() < 0.5
    if ac:
        block["activation_checkpoint"] = rng.choice(["selective", "full"])
    if rng.random() < 0.3:
        block["mixed_precision_param"] = rng.choice(["bfloat16", "float32"])
    if dp > 1 and rng.random() < 0.3:
        block["fsdp_reshard_after_forward"] = rng.choice(["default", "always", "never"])
    if rng.random() < 0.15:  # FSDP2's CPU offload (training.enable_cpu_offload)
        block["cpu_offload"] = True
    if rng.random() < 0.3:  # the config function that trains with plain cross-entropy
        block |= {"config": "llama3_debugmodel_ce_loss", "loss": "cross_entropy"}
    elif rng.random() < 0.3:
        block["loss_chunks"] = rng.choice([1, 2, 4])
    par: dict[str, Any] = {"scheme": "fsdp" if dp > 1 else "tp", "dp": dp, "tp": tp}
    if tp > 1:
        par["sequence_parallel"] = True
    par |= {"micro_batch": rng.choice([1, 2]), "activation_checkpointing": ac}
    if rng.random() < 0.35:  # torchtitan's pipeline (tp = 1), each schedule it names, FSDP2 in the stages
        pp = rng.choice([p for p in (2, 2, 4) if p <= MAX_WORLD])
        schedule = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
        v = 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1
        dp = rng.choice([1, 2]) if 2 * pp <= MAX_WORLD else 1
        model["L"] = rng.randint(max(1, pp * v - 2), 2 * pp * v)  # torchtitan splits L + 2 units, unevenly too
        pipeline: dict[str, Any] = {"engine": "torch", "schedule": schedule} | ({"virtual_stages": v} if v > 1 else {})
        inner = tp if tp > 1 and dp == 1 and v == 1 and pp * tp <= MAX_WORLD and rng.random() < 0.5 else 1
        scheme = "fsdp" if dp > 1 else "3d" if inner > 1 else "pp"  # 3d: TP in the stages, one data rank
        par = {"scheme": scheme, "dp": dp, "pp": pp, "micro_batch": par["micro_batch"]}
        if inner > 1:
            par |= {"tp": inner, "sequence_parallel": True}
        par |= {"micro_batches": rng.choice([pp, 2 * pp, pp + 1]), "activation_checkpointing": ac, "pipeline": pipeline}
        if rng.random() < 0.25:  # global_batch_size beyond local x dp: whole schedule steps accumulated
            block["gradient_accumulation_steps"] = 2
        if dp > 1 and rng.random() < 0.4:
            block["fsdp_reshard_after_forward"] = rng.choice(["default", "always", "never"])
        elif dp == 1:
            block.pop("fsdp_reshard_after_forward", None)
    elif rng.random() < 0.25:  # its context parallelism, flex attention's K/V all-gathers
        cp = rng.choice([2, 4])
        inner = tp if cp * tp <= MAX_WORLD and rng.random() < 0.5 else 1  # TP inside, each rank its K/V heads
        model["s"] = 128 * cp  # flex CP splits the sequence into whole 128-token blocks
        model["kv_heads"] = rng.choice([k for k in (1, 2, a) if a % k == 0 and k % inner == 0] or [a])
        par = {"scheme": "cp", "cp": cp, "micro_batch": par["micro_batch"], "activation_checkpointing": ac}
        if inner > 1:
            par |= {"tp": inner, "sequence_parallel": True}
        if 2 * cp * inner <= MAX_WORLD and rng.random() < 0.5:  # FSDP2 over dp x cp, the batch over dp
            par["dp"] = 2
        block.pop("fsdp_reshard_after_forward", None)
    elif par["scheme"] == "fsdp" and tp == 1 and 2 * dp <= MAX_WORLD and rng.random() < 0.4:
        par["dp_replicate"] = 2  # HSDP: replicas of the sharded model
    if par.get("pp", 1) == 1 and not (par.get("tp", 1) > 1 and par.get("dp", 1) > 1) and rng.random() < 0.25:
        # Llama 3.2's tying (torchtitan refuses it under PP; with FSDP2 x TP it is not modelled yet)
        model["tied_embeddings"] = True
    if par.get("pp", 1) == 1 and rng.random() < 0.3:  # gradient accumulation: global_batch_size > local x dp
        par["micro_batches"] = rng.choice([2, 3])
    doc = {
        "schema_version": 1,
        "name": f"gen-torchtitan-{index}",
        "trainer": "torchtitan",
        "torchtitan": block,
        "model": model,
        "parallelism": par,
        "steps": 2,
        "warmup_steps": 1,
    }
    return Draw(doc=doc, files={})


def megatron(rng: random.Random, index: int) -> Draw:
    """A Megatron-core job: its GPTModel (local spec) under its DDP (distributed optimizer or not, overlapped
    buckets or one), TP with or without sequence parallelism, its 1F1B pipeline, or several; tied embeddings
    or not; bf16 with fp32 or bf16 reduction; full or selective recompute."""
    a = rng.choice([2, 4])
    tp = rng.choice([1, 2])
    pp = rng.choice([1, 2])
    dp = rng.choice([d for d in (1, 2) if 1 < d * tp * pp <= 4])
    bf16 = rng.random() < 0.3
    block: dict[str, Any] = {}
    if dp > 1 and rng.random() < 0.6:
        block["use_distributed_optimizer"] = True
        if rng.random() < 0.4:
            block["overlap_param_gather"] = True
    if rng.random() < 0.6:
        block["overlap_grad_reduce"] = True
        if rng.random() < 0.7:
            block["bucket_size"] = rng.choice([4000, 20000, 40000])
    if bf16 and rng.random() < 0.5:
        block["grad_reduce_in_fp32"] = True
    if rng.random() < 0.3:
        block["average_in_collective"] = True
    par: dict[str, Any] = {"scheme": "tp" if dp == 1 else "ddp", "dp": dp}
    if tp > 1:
        par |= {"scheme": "tp", "tp": tp, "sequence_parallel": rng.random() < 0.6}
    if pp > 1:
        par |= {"scheme": "3d" if tp > 1 else "pp", "pp": pp, "pipeline": {"engine": "megatron"}}
    par |= {"micro_batch": rng.choice([1, 2]), "micro_batches": rng.choice([1, 2, 3])}
    if rng.random() < 0.4:  # its recompute: every layer (full) or the core attention (selective)
        par["activation_checkpointing"] = True
        if rng.random() < 0.4:
            block["recompute_granularity"] = "selective"
    doc = {
        "schema_version": 1,
        "name": f"gen-megatron-{index}",
        "trainer": "megatron",
        "model": {
            "architecture": "gpt-neox",
            "L": pp * rng.choice([1, 2]),
            "h": a * rng.choice([8, 16]),
            "a": a,
            "V": rng.choice([128, 256, 320]),
            "s": rng.choice([16, 32]),
            "dtype": "bf16" if bf16 else "fp32",
            "tied_embeddings": rng.random() < 0.4,
        },
        "parallelism": par,
        "steps": 2,
        "warmup_steps": 1,
    }
    if block:
        doc["megatron"] = block
    return Draw(doc=doc, files={})


DRAWERS: dict[str, Callable[[random.Random, int], Draw]] = {"torchtitan": torchtitan, "hf": hf, "megatron": megatron}
"""The generator of each trainer's jobs (a trainer commgate runs as itself has one)."""


def write(draw: Draw, where: Path) -> Path:
    """The draw's files and its scenario file under ``where``; returns the scenario file."""
    where.mkdir(parents=True, exist_ok=True)
    for name, content in draw.files.items():
        (where / name).write_text(json.dumps(content, indent=2))
    path = where / f"{draw.doc['name']}.yaml"
    path.write_text(yaml.safe_dump(draw.doc, sort_keys=False))
    return path


@dataclass(frozen=True)
class Job:
    scenario: Scenario
    file: Path
    refused: tuple[str, ...]
    """The one-line refusals of the draws before it (what the trainer's rules do not model)."""


def job(trainer: str, seed: int, index: int, where: Path, attempts: int = 200) -> Job:
    """The ``index``-th valid job of ``trainer`` drawn with ``seed`` (refused draws are drawn again), written
    under ``where``. Raises if ``attempts`` draws are all refused: a generator that finds nothing is a bug."""
    rng = random.Random(f"{seed}-{trainer}-{index}")
    refused: list[str] = []
    for attempt in range(attempts):
        draw = DRAWERS[trainer](rng, index)
        path = write(draw, where / f"draw{attempt}")
        try:
            (s,) = load_file(path)
        except ScenarioError as exc:
            refused.append(str(exc).splitlines()[0])
            continue
        if s.world_size <= MAX_WORLD:
            return Job(scenario=s, file=path, refused=tuple(refused))
    raise AssertionError(f"{trainer}: {attempts} draws with seed {seed} all refused; the last: {refused[-1:]}")


if __name__ == "__main__":
    seed, count = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("generated-trainers")
    for name in DRAWERS:
        for i in range(count):
            j = job(name, seed, i, out / name / str(i))
            print(f"{j.file}  ({len(j.refused)} refused before it)")
