"""A seeded generator of random valid scenarios over the whole configuration space commgate runs on CPU
gloo: scheme, model dimensions and switches, dp/tp/pp, micro-batch size and count, activation
checkpointing, parameter dtype, architecture (GPT-NeoX or Llama-style, or a user's own module), bucket
sizes, ZeRO stages, hpZ, MoE, DeepSpeed knobs, FSDP2's resharding and mixed precision, HSDP, sequence
parallelism, torch.distributed.pipelining's schedules (FSDP2 in their stages too: 2-D and 3-D), context
parallelism (its rotation, with TP, DDP or FSDP2). Used by ``tests/test_generated.py``; the same seed always
gives the same scenarios, so a failure is replayed with its seed.

    python tests/scenario_gen.py SEED [COUNT]    # print the scenario documents as YAML
"""

from __future__ import annotations

import random
import sys
from typing import Any

from commgate.core.errors import ScenarioError
from commgate.model.loader import load_document
from commgate.model.scenario import Scenario
from commgate.model.schemes import SCHEMES
from commgate.run.workloads import skip_reason

MAX_WORLD = 8
"""Ranks on one 2-core machine: more only wait on each other."""


def draw(rng: random.Random, index: int = 0) -> dict[str, Any]:
    """One scenario document (maybe invalid: ``scenarios`` keeps the valid ones)."""
    scheme = rng.choice([s for s in SCHEMES])
    rule = SCHEMES[scheme]
    a = rng.choice([2, 4])
    model: dict[str, Any] = {
        "L": rng.choice([2, 3, 4]),
        "a": a,
        "h": a * rng.choice([4, 8]),
        "V": rng.choice([128, 256, 384]),
        "s": rng.choice([16, 32, 64]),
        "x": rng.choice([2, 4]),
        "tied_embeddings": rng.random() < 0.3,
        "position": rng.choice(["learned", "learned", "rotary"]),
        "dtype": rng.choice(["fp32", "fp32", "bf16", "fp16"]),
    }
    if rng.random() < 0.4:  # Llama-style: grouped-query attention, SwiGLU of its own width, rotary
        del model["position"], model["x"]
        model["architecture"] = "llama"
        model["kv_heads"] = rng.choice([k for k in (1, 2, 4) if a % k == 0])
        model["ffn_hidden"] = rng.choice([2, 3, 5]) * model["h"] // 2 + rng.choice([0, 2, 6])
    if rule.user_module and rng.random() < 0.15:  # a user's own module instead of the decoder
        # the example, or a LoRA-style one with frozen parameters and buffers (tests/user_lora.py)
        model = {"module": rng.choice(["commgate.examples.mixer:build", "user_lora:build"]), "dtype": model["dtype"]}
    par: dict[str, Any] = {
        "scheme": scheme,
        "dp": rng.choice([1, 2, 3, 4]) if rule.min_dp == 1 else rng.choice([2, 3, 4]),
        "micro_batch": rng.choice([1, 2]),
        "micro_batches": rng.choice([1, 1, 2, 3, 4]),
        "activation_checkpointing": rng.random() < 0.3,
    }
    if rule.tensor:
        par["tp"] = 2
        if not rule.pipeline and rng.random() < 0.4:
            par["sequence_parallel"] = True
    torch_pp = False
    if rule.pipeline:
        par["pp"] = 2
        model["L"] = rng.choice([2, 4])
        if scheme == "pp" and "module" not in model and rng.random() < 0.4:  # torch.distributed.pipelining
            torch_pp = True
            schedule = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
            v = (
                rng.choice([2, 3])
                if schedule == "interleaved-1f1b"
                else rng.choice([1, 2])
                if schedule == "zero-bubble"
                else 1
            )
            par["pp"] = rng.choice([2, 3]) if v == 1 else 2
            model["L"] = par["pp"] * v * rng.choice([1, 2])
            par["pipeline"] = {"engine": "torch", "schedule": schedule, "virtual_stages": v}
            par["dp"], par["activation_checkpointing"] = 1, False
            par["micro_batches"] = rng.choice([1, 2, 3, 4, 6])  # the scenario rules keep what torch accepts
    if "module" in model:
        par["activation_checkpointing"] = False
    zero: dict[str, Any] = {}
    if (rule.zero_stage is not None or rule.moe or rule.pipeline) and rng.random() < 0.6:
        zero["bucket_elements"] = rng.choice([2_000, 20_000, 200_000, 500_000_000])
    if scheme == "pp" and rng.random() < 0.5:
        zero["stage"] = 1
    if torch_pp:
        zero.clear()
    if rule.zero_plus_plus:
        par["dp"] = 4
        zero["hpz"] = 2
    if rule.moe:
        experts = rng.choice([2, 4])
        ep = rng.choice([e for e in (1, 2, 4) if par["dp"] % e == 0 and experts % e == 0])
        par["moe"] = {"experts": experts, "ep": ep, "top_k": rng.choice([1, 2]), "every": rng.choice([1, 2])}
        zero["stage"] = rng.choice([0, 1, 2])
    if scheme == "ddp" and rng.random() < 0.5:
        par["ddp_bucket_mb"] = rng.choice([0.01, 0.05, 25])
    if scheme == "ddp" and model.get("dtype") == "fp32" and rng.random() < 0.3:  # mixed precision by autocast
        model["autocast"] = "bf16"
    if rule.fsdp:  # torch FSDP2: its options, each left to torch's default or drawn
        fsdp: dict[str, Any] = {}
        if rng.random() < 0.6:
            fsdp["reshard_after_forward"] = rng.choice([True, False, None, 2])  # 2: to pairs (dp even)
        if rng.random() < 0.4:
            fsdp["reshard_after_backward"] = rng.random() < 0.5
        if rng.random() < 0.5:
            fsdp["param_dtype"] = rng.choice(["fp32", "bf16"])
        if rng.random() < 0.5:
            fsdp["reduce_dtype"] = rng.choice(["fp32", "bf16"])
        if fsdp:
            par["fsdp"] = fsdp
        if rng.random() < 0.3:  # HSDP
            par["dp_replicate"] = 2
        elif rng.random() < 0.3 and fsdp.get("reshard_after_forward") != 2:  # 2-D (int resharding hangs it), SP or not
            par["tp"] = 2
            par["sequence_parallel"] = rng.random() < 0.5
        plain = "module" not in model and "dp_replicate" not in par and not par.get("sequence_parallel")
        if plain and fsdp.get("reshard_after_forward") != 2:
            if rng.random() < 0.3:  # torchtitan's FSDP2 x CP (x TP)
                _context(rng, par, model)
            elif rng.random() < 0.4:  # FSDP2 (x TP) in torch.distributed.pipelining's stages: 2-D or 3-D
                par["pp"] = rng.choice([2, 2, 3])
                model["L"] = par["pp"] * rng.choice([1, 2])
                schedule = rng.choice(["gpipe", "1f1b"])
                par["pipeline"] = {"engine": "torch", "schedule": schedule}
                par["micro_batches"] = rng.choice([1, 2, 3, 4, 5]) if schedule == "gpipe" else rng.choice([3, 4, 6])
                par["activation_checkpointing"] = False
                if rng.random() < 0.4:  # 3-D
                    par["tp"] = 2
                ranks = par["pp"] * par.get("tp", 1)
                par["dp"] = rng.choice([d for d in (1, 2, 3, 4) if 2 <= d * ranks <= MAX_WORLD and d > 1] or [2])
    if rule.context:  # ring attention, TP inside or not
        if rng.random() < 0.35:
            par["tp"] = 2
        _context(rng, par, model)
    if zero:
        par["zero"] = zero
    doc: dict[str, Any] = {}
    if (
        rule.deepspeed and not torch_pp and rng.random() < (0.8 if rule.zero_stage == 3 else 0.5)
    ):  # the user's own DeepSpeed keys
        zo: dict[str, Any] = {}
        stage = zero.get("stage", rule.zero_stage or 0)
        if stage >= 2 or rng.random() < 0.3:
            zo["overlap_comm"] = rng.random() < 0.5
        if rng.random() < 0.4:
            zo["contiguous_gradients"] = rng.random() < 0.5
        if stage in (1, 2) and rng.random() < 0.4:
            zo["reduce_scatter"] = rng.random() < 0.5
        if stage == 3:  # the coordinator's knobs, each left to DeepSpeed's default or drawn
            for key, values in (
                ("stage3_param_persistence_threshold", [0, 0, 100, 1_000, 100_000]),
                ("stage3_prefetch_bucket_size", [0, 500, 3_000, 50_000_000]),
                ("stage3_max_live_parameters", [0, 2_000, 20_000, 1_000_000_000]),
                ("stage3_max_reuse_distance", [0, 1_000, 10_000, 1_000_000_000]),
            ):
                if rng.random() < 0.6:
                    zo[key] = rng.choice(values)
            if rng.random() < 0.3:  # optimizer sub-groups: one norm all-reduce each
                zo["sub_group_size"] = rng.choice([300, 3_000, 1_000_000_000])
        if "bucket_elements" in zero and rng.random() < 0.5:
            zo["reduce_bucket_size"] = zo["allgather_bucket_size"] = zero.pop("bucket_elements")
        if zo:
            doc["zero_optimization"] = zo
        if rng.random() < 0.4:
            doc["gradient_clipping"] = 1.0
        if rng.random() < 0.3:
            doc["communication_data_type"] = rng.choice(["fp32", "bf16"])
        if model.get("dtype") == "bf16" and stage >= 1 and rng.random() < 0.3:  # fp32 accumulation
            doc["data_types"] = {"grad_accum_dtype": "fp32"}
    out: dict[str, Any] = {
        "schema_version": 1,
        "name": f"gen{index}-{scheme.replace('+', 'p')}",
        "model": model,
        "parallelism": par,
        "steps": 2,
        "warmup_steps": 1,
    }
    if doc:
        out["deepspeed"] = doc
    return out


def _context(rng: random.Random, par: dict[str, Any], model: dict[str, Any]) -> None:
    """Context parallelism: cp ranks (an odd ring too), the rotation, and a dp that keeps the world small."""
    par["cp"] = rng.choice([2, 2, 3, 4])
    if rng.random() < 0.5:
        par["cp_rotate"] = rng.choice(["allgather", "alltoall"])
    if "module" not in model:  # the sequence splits evenly; torch load-balances when 2*cp divides it
        model["s"] = par["cp"] * rng.choice([4, 5, 8, 16])
    ranks = par["cp"] * par.get("tp", 1)
    par["dp"] = rng.choice([d for d in (1, 2, 3, 4) if d * ranks <= MAX_WORLD])


def scenarios(seed: int, count: int) -> list[Scenario]:
    """``count`` valid scenarios drawn with ``seed`` (invalid draws are drawn again)."""
    rng = random.Random(seed)
    out: list[Scenario] = []
    while len(out) < count:
        doc = draw(rng, len(out))
        try:
            (s,) = load_document(doc, file=f"<generated, seed {seed}>")
        except ScenarioError:
            continue
        if s.world_size <= MAX_WORLD and skip_reason(s, gpus=False) is None:
            out.append(s)
    return out


if __name__ == "__main__":
    import yaml

    seed, count = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 12
    rng = random.Random(seed)
    docs = []
    while len(docs) < count:
        d = draw(rng, len(docs))
        try:
            load_document(d, file="-")
        except ScenarioError:
            continue
        docs.append(d)
    print(yaml.safe_dump_all(docs, sort_keys=False))
