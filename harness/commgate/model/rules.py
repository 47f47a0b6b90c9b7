"""The consistency rules every scenario meets whatever its scheme: the world's size, the model's shape,
which axes and option blocks its scheme needs and allows (read off the ``Scheme`` record, so that a new
scheme states them as flags), a user's own module or workload, and emulation.

The rules of one feature (tensor, pipeline, context parallelism, FSDP2, ZeRO and DeepSpeed's keys, MoE)
live with the scheme component that models it (``RULES`` of ``commgate.model.schemes.<component>``); a
trainer's with the trainer (``commgate.model.trainers``). ``commgate.model.loader`` runs them all.
"""

from __future__ import annotations

import functools

from commgate.core.errors import CommgateError
from commgate.model.schemes.scheme import Check, OptionalAxis, Rule, Scheme

MAX_WORLD = 1 << 20
"""The most ranks a scenario may have (a million: beyond any cluster, and what a prediction enumerates)."""
P = "parallelism"


def world(c: Check) -> None:
    par = c.par
    if par.world_size > MAX_WORLD:
        c.bad([P], f"{par.axes} = {par.world_size:,} ranks, more than {MAX_WORLD:,}")
    if "world_size" in c.doc and c.doc["world_size"] != par.world_size:
        c.bad(["world_size"], f"{c.doc['world_size']} != {par.axes} = {par.world_size}")


def model_shape(c: Check) -> None:
    """What the architecture's shapes need (a user's module has its own)."""
    m = c.model
    if m.module is not None:
        return
    if m.h % m.a:
        c.bad(["model", "a"], f"hidden size h={m.h} is not divisible by heads a={m.a}")
    if m.llama and m.position != "rotary":
        c.bad(["model", "position"], f"{m.position!r}: architecture llama uses rotary positions")
    if m.kv_heads is not None and m.kv_heads != m.a and not m.llama and c.trainer != "megatron":
        c.bad(["model", "kv_heads"], f"{m.kv_heads}: grouped-query attention needs architecture: llama")
    if m.qkv_bias and not m.llama:
        c.bad(
            ["model", "qkv_bias"], "true: Q, K and V biases are Qwen2's Llama-style layout: needs architecture: llama"
        )
    if m.a % m.kv:
        c.bad(["model", "kv_heads"], f"{m.kv}: heads a={m.a} are not divisible by kv_heads")
    if m.position == "rotary" and (m.h // m.a) % 2:
        c.bad(["model", "h"], f"{m.h}: rotary positions need an even head dimension, h/a = {m.h}/{m.a} is odd")


def axes(c: Check) -> None:
    """The tensor-, pipeline- and context-parallel degrees: >= 2 where the scheme needs the axis, 1 where it
    neither needs nor allows it."""
    par, r = c.par, c.scheme
    axes: tuple[tuple[OptionalAxis, int, str], ...] = (
        ("tp", par.tp, "tensor"),
        ("pp", par.pp, "pipeline"),
        ("cp", par.cp, "context"),
    )
    for axis, degree, what in axes:
        if r.needs(axis) and degree < 2:
            c.bad([P, axis], f"{degree}: scheme {r.name!r} needs {axis} >= 2")
        elif not r.allows(axis) and degree != 1:
            use = c.names(functools.partial(Scheme.allows, axis=axis))
            c.bad([P, axis], f"{degree}: scheme {r.name!r} has no {what} parallelism; use scheme {use}")


def data_axis(c: Check) -> None:
    par, rule = c.par, c.scheme
    if par.data_ranks < rule.min_dp:  # FSDP2 shards over dp x cp: dp = 1 with cp = 2 shards over 2 ranks
        c.bad([P, "dp"], f"{par.dp}: scheme {rule.name!r} needs dp >= {rule.min_dp}")
    if par.dp_replicate > 1 and not rule.fsdp:
        hsdp = c.names(lambda r: r.fsdp)
        why = f"replicas of a sharded model are HSDP, scheme {hsdp}, not {rule.name!r}"
        c.bad([P, "dp_replicate"], f"{par.dp_replicate}: {why}")


def option_blocks(c: Check) -> None:
    """The option blocks a scheme alone allows: ``fsdp`` (FSDP2's), ``moe``; ZeRO stages and ZeRO++."""
    par, rule, s = c.par, c.scheme, c.scheme.name
    if "fsdp" in c.declared and not rule.fsdp:
        c.bad([P, "fsdp"], f"FSDP2 options need scheme {c.names(lambda r: r.fsdp)}, not {s!r}")
    if rule.moe and par.moe is None:
        c.bad([P], f"scheme {s!r} needs a 'moe' block with 'experts'")
    elif not rule.moe and par.moe is not None:
        c.bad([P, "moe"], f"MoE settings need scheme {c.names(lambda r: r.moe)}, not {s!r}")
    stage = par.zero.stage
    if not rule.zero and stage:
        staged = c.names(lambda r: r.zero_stage == stage and not r.zero_plus_plus)
        c.bad([P, "zero", "stage"], f"{stage}: {rule.summary} has no ZeRO; use scheme {staged}")
    zpp = par.zero.hpz > 1 or par.zero.qwz or par.zero.qgz
    if rule.zero_plus_plus and not zpp:
        c.bad([P, "zero"], f"scheme {s!r} needs at least one of hpz > 1, qwz: true, qgz: true")
    if not rule.zero_plus_plus and zpp and c.trainer != "commgate":  # its DeepSpeed JSON asked: no scheme to name
        c.bad(
            [c.trainer],
            f"ZeRO++ (zero_optimization's zero_hpz_partition_size > 1, zero_quantized_weights or "
            f"zero_quantized_gradients) is not modelled for trainer {c.trainer!r}: leave them out of its DeepSpeed "
            "config (commgate's own workloads run ZeRO++: scheme zero++)",
        )
    elif not rule.zero_plus_plus and zpp:
        zero_pp = c.names(lambda r: r.zero_plus_plus)
        c.bad([P, "zero"], f"ZeRO++ options (hpz, qwz, qgz) need scheme {zero_pp}, not {s!r}")


def autocast(c: Check) -> None:
    m, s = c.model, c.scheme.name
    if m.autocast is not None and (not c.scheme.autocast or m.dtype != "fp32"):
        ddp = ", ".join(n for n, r in c.schemes.items() if r.autocast)
        c.bad(
            ["model", "autocast"],
            f"{m.autocast}: autocast is run under scheme {ddp} with fp32 parameters (the model's dtype "
            f"{m.dtype!r}, scheme {s!r}); for 16-bit parameters set model.dtype instead",
        )


def user_module(c: Check) -> None:
    """``model.module`` names an importable ``build`` under a scheme whose engine sees only parameters."""
    from commgate.model.usermodule import resolve

    spec, s = c.model.module, c.scheme.name
    if spec is None:
        return
    if c.model.builder is not None:  # the trainer builds it (Trainer.model) and models it under its schemes
        return
    if not c.scheme.user_module:
        able = ", ".join(n for n, r in c.schemes.items() if r.user_module)
        c.bad(
            ["model", "module"],
            f"{spec!r}: a user's module is modelled under {able}, not {s!r} "
            "(for another scheme, give your own training step as workload:)",
        )
        return
    try:
        resolve(spec)
    except CommgateError as exc:
        c.bad(["model", "module"], str(exc).removeprefix(f"model.module {spec!r}: "))


def user_workload(c: Check) -> None:
    """``workload:`` names an importable callable (imported now, so that validate finds what a run would)."""
    from commgate.model.usermodule import resolve

    spec = c.doc.get("workload")
    if not isinstance(spec, str):
        return
    try:
        fn = resolve(spec, "workload")
    except CommgateError as exc:
        c.bad(["workload"], str(exc).removeprefix(f"workload {spec!r}: "))
        return
    if not callable(fn):
        c.bad(["workload"], f"{spec!r} is a {type(fn).__name__}, not a callable")


def emulation_refusal(backend: str, workload: str | None, trainer: str = "commgate") -> str | None:
    """Why a scenario cannot run emulated, or None: in a file (``emulate: true``) and under ``commgate run
    --emulate`` alike (that flag let a trainer's scenario run emulated where its file was refused: found by an
    adversarial pass). A started rank stands for the ranks that run the same code on the same shapes as it:
    its data-parallel peers (data, context, expert parallelism); pipeline stages hold different layers and run
    as real processes, one per stage and tensor shard (``commgate.run.emulate.started_ranks``)."""
    if backend == "nccl":
        return "an emulated run exchanges nothing, on CPU (backend gloo or auto, not nccl)"
    if workload is not None:
        return "your own workload runs on real ranks only (its step may rely on its peers' data)"
    if trainer != "commgate":
        return f"{trainer}'s ranks all run (an emulated {trainer} run is not supported yet)"
    return None


def emulation(c: Check) -> None:
    if not c.doc.get("emulate"):
        return
    workload = c.doc.get("workload") if isinstance(c.doc.get("workload"), str) else None
    if why := emulation_refusal(c.doc.get("backend", "auto"), workload, c.trainer):
        c.bad(["emulate"], f"true: {why}")


RULES: tuple[Rule, ...] = (
    world,
    user_workload,
    model_shape,
    axes,
    data_axis,
    option_blocks,
    autocast,
    user_module,
    emulation,
)
"""The rules of every scenario, in the order their problems are reported."""
