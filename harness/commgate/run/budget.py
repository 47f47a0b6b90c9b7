"""What a local run would need, estimated before any rank starts: memory per rank, so that a scenario this
machine cannot hold is refused in one line instead of swapping or being killed by the kernel's OOM killer,
and (on CPUs) the compute of its steps, so that one that cannot finish before its deadline is refused
instead of running into it (``slow``).

Per rank (the largest pipeline stage; a tensor-parallel rank's shard; DeepSpeed's and torch's own
accounting, as the scenario would run):

* parameters in their dtype; ZeRO-3 and FSDP2 keep 1/dp of them, plus what they hold gathered
  (``zero3_unsharded``: what DeepSpeed's coordinator keeps for reuse or prefetches, by its knobs;
  ``fsdp_unsharded``: the root group through the pass, two blocks and an all-gather output; a user's module
  whole), a tensor-parallel rank its shard, a pipeline rank its stage; but commgate's own workloads build
  the whole model first (every tensor shard, every stage), except ZeRO-3 emulated (``deepspeed.zero.Init``:
  ``built_partitioned``) and FSDP2 emulated without pipeline stages (the meta device: ``built_on_meta``); a
  trainer's FSDP2 job is counted built whole (Hugging Face's, on every rank), its other jobs as kept;
* gradients in the parameters' dtype; ZeRO-2/3 and FSDP2 keep 1/dp, plus, unsharded, ZeRO-3's reduce bucket
  twice (laid out again for the reduce-scatter) and FSDP2's as much as it holds gathered; torch DDP twice
  (its buckets hold a copy: an HF Trainer job of Llama 3.2 1B on two ranks was killed by the OOM killer
  when this was left out);
* optimizer: AdamW's two moments, in fp32 on fp32 master weights under DeepSpeed (a copy for 16-bit
  parameters), in the parameters' dtype under torch; ZeRO-1/2/3 and FSDP2 keep 1/dp;
* activations of one micro-batch: 34·b·s·h bytes per layer at 16 bits (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models"), scaled by the dtype and divided by tp; with
  activation checkpointing only each layer's input, 2·b·s·h·itemsize, plus one layer's worth;
* the runtime: RANK_MEMORY (torch and DeepSpeed imported).

An estimate, erring high; a run is refused only when its ranks together would need more than the
memory available now (``COMMGATE_SKIP_MEMORY_CHECK=1`` turns the check off).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from fractions import Fraction

from commgate.core import env
from commgate.core.provenance import cpuinfo
from commgate.model.expectation import Context
from commgate.model.scenario import Scenario
from commgate.model.schemes import SCHEMES, deepspeed_zero, zero3_fetch
from commgate.model.schemes.deepspeed_zero import built_partitioned
from commgate.model.schemes.fsdp import built_on_meta, dtypes, groups
from commgate.model.transformer import WIRE_ITEMSIZE, step_flops
from commgate.run.emulate import started_ranks

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Estimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.runtime

    def text(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "runtime")
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)


def per_rank(scenario: Scenario, runtime: int) -> Estimate:
    """The memory one rank of ``scenario`` needs (bytes), by part."""
    ctx = Context(scenario=scenario)
    m, par = scenario.model, scenario.parallelism
    fsdp = SCHEMES[par.scheme].fsdp  # FSDP2 shards like ZeRO-3, over dp x cp
    isz, d, stage = m.itemsize, (par.data_ranks if fsdp else par.dp), (3 if fsdp else par.zero.stage)
    # commgate's even split of the stages; a user's module, or a trainer's uneven split (torchtitan's),
    # counts the whole model: an upper bound
    even = not m.module and m.L % par.pp == 0
    n = max(ctx.rank_params(k) for k in range(par.pp)) if even else ctx.param_count
    params, unsharded_grads = n * isz, 0
    if stage >= 3 and m.module:
        params = (n // d + n) * isz  # a user's module: gathered whole at once, an upper bound
    elif fsdp:
        unsharded, unsharded_grads = fsdp_unsharded(ctx, even=even)
        params = n // d * isz + unsharded
    elif stage >= 3:
        gathered, reducing = zero3_unsharded(ctx, n)
        params = (n // d + gathered) * isz
        unsharded_grads = int(reducing * max(Fraction(isz), WIRE_ITEMSIZE[deepspeed_zero.grad_dtype(ctx)]))
    # built whole (every tensor shard, every stage) before DTensor, a pipeline, ZeRO or FSDP2 keeps its share
    # (an MoE rank builds its own experts only)
    own = scenario.trainer == "commgate"
    meta = fsdp and built_on_meta(scenario)
    if (own and not (meta or built_partitioned(scenario))) or (fsdp and not own):
        experts = ctx.expert_param_count
        params = max(params, (ctx.param_count - experts + experts // par.ep) * isz)
    grads = n * isz // (d if stage >= 2 else 1) + unsharded_grads
    if not SCHEMES[par.scheme].deepspeed and not fsdp and par.dp * par.dp_replicate * par.cp > 1:
        grads *= 2  # torch DDP's reducer copies the gradients into its flat buckets (gradient_as_bucket_view off)
    # DeepSpeed: fp32 moments on fp32 master weights (a copy for 16-bit parameters); torch's AdamW keeps
    # its moments in the parameters' dtype
    per_param = 8 + (4 if isz < 4 else 0) if SCHEMES[par.scheme].deepspeed else 2 * isz
    optimizer = n * per_param // (d if stage >= 1 else 1)
    bsh = par.micro_batch * m.s * m.h if not m.module else 0
    layers = max(1, m.L // par.pp) if not m.module else 0
    if par.activation_checkpointing:
        activations = 2 * bsh * isz * layers + 17 * bsh * isz // par.tp
    else:
        activations = 17 * bsh * isz * layers // par.tp
    return Estimate(params=params, grads=grads, optimizer=optimizer, activations=activations, runtime=runtime)


def fsdp_unsharded(ctx: Context, *, even: bool = True) -> tuple[int, int]:
    """(parameters, gradients) in bytes that FSDP2 holds unsharded at once on one rank, at most. Parameters: its
    root group (the embeddings, final norm and head: ``fsdp.groups``), kept gathered from the forward through
    the backward; two blocks (the one running and the next, prefetched); and the largest group's all-gather
    output beside the parameters it is copied out to (``foreach_all_gather_copy_out``). Gradients: as much as
    the root group and two blocks (in the backward, or a group's gradients and its reduce-scatter input at the
    root's), in the larger of the parameters' and the reduction's dtype. Emulated, an 8B Llama 3 of 4 layers at
    dp 8 held 12.5 GiB in its rank (8.2 GiB at tp 2), most of it its root group's 4.2 GB gathered and its
    gradients, where one block counted as gathered had estimated 5.9 GiB."""
    gather, reduce = (WIRE_ITEMSIZE[t] for t in dtypes(ctx))
    if not even:  # a trainer's uneven split of the stages (torchtitan's): the whole model's groups, an upper bound
        par = ctx.scenario.parallelism
        ctx = Context(scenario=dataclasses.replace(ctx.scenario, parallelism=dataclasses.replace(par, pp=1)))
    params = grads = 0
    for stage in range(ctx.scenario.parallelism.pp):
        sizes = groups(ctx, stage)
        root = sum(g.padded for g in sizes if g.root)
        blocks = sorted((g.padded for g in sizes if not g.root), reverse=True)[:2]
        params = max(params, root + sum(blocks) + max([root, *blocks]))
        grads = max(grads, root + sum(blocks))
    return int(params * gather), int(grads * max(gather, reduce))


def zero3_unsharded(ctx: Context, n: int) -> tuple[int, int]:
    """(parameters, gradients) in elements that ZeRO-3 holds unsharded at once on one rank, at most, of ``n``
    elements per rank. Parameters: what DeepSpeed's coordinator keeps gathered for reuse within
    ``stage3_max_reuse_distance`` or prefetches within ``stage3_max_live_parameters`` (the larger), with the
    module it fetches (``zero3_fetch.knobs``, ``module_tree``); and one gather being put together (its flat
    buffer beside each parameter's ``torch.cat``: the larger of a module and ``stage3_prefetch_bucket_size``).
    Gradients: the largest reduce bucket (``reduce_bucket_size``) twice (the bucket, and its partitions laid out
    padded for the reduce-scatter: ``coalesced_collectives.py``'s ``torch.cat``) and a module's gradients beside
    it. Emulated, an 8B Llama 3 of 4 layers at dp 8 held 12.7 GiB in its rank and the 1.3B preset at dp 256 in
    bf16 4.5 GiB, where one layer counted as gathered had estimated 5.9 and 0.7 GiB."""
    k, tp = zero3_fetch.knobs(ctx), ctx.scenario.parallelism.tp
    todo, largest = [zero3_fetch.module_tree(ctx.params)], 0
    while todo:
        mod = todo.pop()
        largest = max(largest, sum(p.numel_per_tp_rank(tp) for p in mod.params))
        todo.extend(mod.children)
    params = min(n, max(k.max_live, k.reuse) + largest) + min(n, max(largest, k.prefetch))
    return params, 2 * max(deepspeed_zero.gradient_buckets(ctx), default=0) + largest


CORE_FLOPS = 50e9
"""FLOP/s one CPU core is granted: generous, so that the compute estimate errs short."""

CORE_FLOPS_16BIT_FALLBACK = 10e9
"""FLOP/s one CPU core is granted for a 16-bit dtype that torch cannot hand to oneDNN on this CPU
(``fast_on_cpu``), where its matrix products run in torch's own loops. Measured on one core of an AMD EPYC with
AVX2 alone (torch 2.13), ``F.linear`` from 128 x 256 x 128 to 64 x 4096 x 4096: bf16 forward 8.7-10.6 and
backward 0.4-1.3 GFLOP/s, fp32 46-83 and 16-78; the llama-tp-dp scenario's bf16 steps ran at 3.3 GFLOP/s a
core by Megatron-LM's count. Generous, as ``CORE_FLOPS`` is."""

_ONEDNN_16BIT: dict[str, tuple[set[str], ...]] = {
    # torch's own check (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` and ``_fp16_``: oneDNN's effective ISA),
    # read from the CPU's flags so that the launcher need not import torch: AVX-512 (F, BW, VL, DQ) for bf16,
    # with AVX512-FP16 for fp16; or AVX-VNNI-INT8 with AVX-NE-CONVERT (oneDNN's avx2_vnni_2) for both
    "bf16": ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, {"avx_vnni_int8", "avx_ne_convert"}),
    "fp16": ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_fp16"}, {"avx_vnni_int8", "avx_ne_convert"}),
}
_NEEDS = {
    "bf16": "AVX-512, or AVX-VNNI-INT8 with AVX-NE-CONVERT",
    "fp16": "AVX512-FP16, or AVX-VNNI-INT8 with AVX-NE-CONVERT",
}


def _cpu_flags() -> frozenset[str] | None:
    """An x86 CPU's feature flags (``/proc/cpuinfo``); None elsewhere or where they cannot be read."""
    flags = cpuinfo("flags")
    return None if flags is None else frozenset(flags.split())


def fast_on_cpu(dtype: str) -> bool:
    """Whether torch computes ``dtype``'s matrix products on this CPU with oneDNN's kernels; True where it cannot
    be told (not x86 Linux), so that the estimate still errs short."""
    flags = _cpu_flags()
    if dtype not in _ONEDNN_16BIT or flags is None:
        return True
    return any(need <= flags for need in _ONEDNN_16BIT[dtype])


def compute_dtype(scenario: Scenario) -> str:
    """The dtype the layers compute in: ``autocast``'s, else FSDP2's ``param_dtype``, else the model's."""
    return scenario.model.autocast or scenario.parallelism.fsdp.compute_dtype(scenario.model.dtype)


def core_flops(scenario: Scenario) -> float:
    """FLOP/s one of this machine's cores is granted for ``scenario``'s compute."""
    return CORE_FLOPS if fast_on_cpu(compute_dtype(scenario)) else CORE_FLOPS_16BIT_FALLBACK


def slow_compute(scenario: Scenario) -> str | None:
    """Why ``scenario``'s steps compute on this CPU far slower than their FLOPs at fp32's rate would say (one
    clause), or None."""
    dtype = compute_dtype(scenario)
    if fast_on_cpu(dtype):
        return None
    return (
        f"this CPU lacks what oneDNN's {dtype} kernels need ({_NEEDS[dtype]}), so torch computes {dtype} matrix "
        "products in its own loops, tens of times slower than fp32"
    )


def compute_s(scenario: Scenario) -> float | None:
    """A lower estimate of the seconds a CPU run's steps compute: every rank's training FLOPs (Megatron-LM's
    count, ``transformer.step_flops``) for warm-up and measured steps, shared by this machine's cores at
    ``core_flops`` each. None for a user's module (no dimensions)."""
    m, par = scenario.model, scenario.parallelism
    if m.module:
        return None
    per_rank = step_flops(m, par)
    steps = scenario.warmup_steps + scenario.steps
    return steps * per_rank * len(started_ranks(scenario)) / ((os.cpu_count() or 1) * core_flops(scenario))


def slow(scenario: Scenario, deadline_s: float) -> str | None:
    """Why ``scenario``'s steps cannot finish within ``deadline_s`` on this machine's CPUs (one line), or None."""
    need = compute_s(scenario)
    if need is None or need <= deadline_s:
        return None
    rate = f"at {core_flops(scenario) / 1e9:g} GFLOP/s each"
    if because := slow_compute(scenario):
        rate += f" for {compute_dtype(scenario)}: {because}"
    return (
        f"{scenario.id}: its {scenario.warmup_steps + scenario.steps} steps need at least "
        f"{f'{need:,.0f}' if need >= 10 else f'{need:.2g}'} s of compute "
        f"on {os.cpu_count()} cores ({rate}), more than the deadline of "
        f"{deadline_s:g} s: use a reduced-scale model or fewer steps, raise deadline_s, or run it on GPUs"
    )


def available() -> int | None:
    """Memory available now (``MemAvailable``, Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


SKIP = "COMMGATE_SKIP_MEMORY_CHECK"
YES, NO = env.ON, ("", *env.OFF)


def refusal(scenario: Scenario, runtime: int) -> str | None:
    """Why ``scenario`` cannot run on this machine's memory (one line), or None."""
    skip = os.environ.get(SKIP, "")
    if skip.strip().lower() not in YES + NO:
        return f"{SKIP}={skip!r}: expected 1, true or yes to skip the memory check, or 0, false or no"
    have = available()
    if have is None or skip.strip().lower() in YES:
        return None
    one = per_rank(scenario, runtime)
    started = len(started_ranks(scenario))
    need = one.total * started
    if need <= have:
        return None
    emulated = f" (of {scenario.world_size}, the others emulated)" if started < scenario.world_size else ""
    return (
        f"{scenario.id}: needs about {need / GIB:.1f} GiB for {started} local rank(s){emulated}, "
        f"{one.total / GIB:.2f} GiB each ({one.text()} GiB); this machine has {have / GIB:.1f} GiB available: "
        f"{REDUCE.get(scenario.trainer, REDUCE['commgate'])}, or run it on a cluster under torchrun"
    )


REDUCE = {
    "commgate": "use a reduced-scale model (a -cpu preset, commgate import --cpu)",
    "torchtitan": "use a reduced-scale model (commgate import --torchtitan CONFIG --cpu)",
    "hf": "give hf.config a smaller config.json (fewer layers, a smaller hidden size and vocabulary)",
    "megatron": "use a reduced-scale model (fewer layers, a smaller hidden size)",
}
"""How a user makes a scenario of each trainer fit this machine."""
