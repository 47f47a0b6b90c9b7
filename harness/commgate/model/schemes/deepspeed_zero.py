"""DeepSpeed ZeRO stages 1-3 as DeepSpeed 0.19 runs them on torch 2.x (measured through the capture and
read from ``deepspeed/runtime/engine.py`` and ``deepspeed/runtime/zero/``), with the workload's config
(``commgate.run.workloads.zero``): client AdamW, ``reduce_bucket_size = allgather_bucket_size =
bucket_elements``, the scenario's ``deepspeed:`` block over it, DeepSpeed's defaults for the rest.

ZeRO-1/2 (``stage_1_and_2.py``)
* Construction: ``_broadcast_model`` broadcasts every parameter from rank 0, as bytes (a uint8 view).
* Backward: gradients are reduced with **all-reduce** (not the reduce-scatter Eq. 2 assumes), in
  buckets flushed before one would pass ``reduce_bucket_size`` elements: ZeRO-2 as the gradients become
  ready (reverse registration), ZeRO-1 at the accumulation boundary in registration order (with
  ``overlap_comm`` on, in the boundary micro-batch's backward hooks, as the gradients become ready).
* Optimizer: the gradient norm is all-reduced (one fp32, whatever the parameters' dtype), with bf16 or
  fp16 parameters also an overflow flag (one uint8); then the updated partitions (kept in fp32, the
  master weights) are all-gathered into the flat parameter buffer in the parameters' dtype (one call).

ZeRO-3 (``stage3.py``, ``partitioned_param_coordinator.py``)
* Construction: every parameter is broadcast twice as bytes and each trainable one all-gathered once;
  three barriers.
* Each step: the parameters are all-gathered as the coordinator fetches them (``zero3_fetch`` replays it:
  with its knobs at 0 every module's own parameters before its forward and again before its backward,
  one call per module, and with activation checkpointing once more in each layer's recompute, all but
  the last module's; with DeepSpeed's defaults prefetched in larger calls, kept for their reuse, and the
  persistent ones kept gathered and re-gathered after each optimizer step); the gradients are
  reduce-scattered in buckets as above; the gradient norm is all-reduced (one float64), once per
  optimizer sub-group (``sub_groups``: ``sub_group_size``).
* Steps 0 and 1 also carry the coordinator's trace broadcasts (int64, ``assert_ints_same_as_other_ranks``
  in ``partitioned_param_coordinator.reset_step``): step 0 one of 1 element and one empty; step 1 three of
  1 element, one of the recorded module order (every module that runs, once in the forward and once in
  the backward) and two of the parameter order (each module's parameters, in the forward and the
  backward; a tied output layer uses the word embedding as an external parameter).

ZeRO++ (the same engine with ``zero_hpz_partition_size``): hpZ keeps a secondary copy of the
parameters partitioned within groups of hpz ranks, made when a gathered parameter is released (and by
the initial partitioning) and dropped after each optimizer step; a parameter that has one is gathered
from it, over those groups; everything else is ZeRO-3's. Its quantized weights and
gradients (qwZ, qgZ) run on GPUs only (DeepSpeed's quantizer has no CPU kernel); for them the paper-level
ZeRO++ model stands.

Gradient accumulation (m = ``gradient_accumulation_steps`` > 1, ``engine.backward`` per micro-batch,
``engine.step`` after each): ZeRO-1 reduces the accumulated gradients once, at the boundary; ZeRO-2
reduces every micro-batch's gradients as they are produced (its hooks fire in every backward); ZeRO-3
gathers every module's parameters in every micro-batch's forward and backward and reduce-scatters every
micro-batch's gradients. The gradient norm, and ZeRO-1/2's all-gather of the updated partitions, happen
once per step. ZeRO-3's coordinator counts micro-batches: its trace broadcasts of micro-batches 0 and 1
fall in steps 0 and 1 // m. The volume beyond one micro-batch is the named term "gradient accumulation".

Partition padding: ZeRO-1/2 pad their flat buffer to a multiple of 2 x d elements, ZeRO-3 each
parameter to a multiple of d; the padded sizes are what is gathered and reduce-scattered, and the
difference to Eq. 2/3 is the named term "partition padding".
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model import dsconfig
from commgate.model.collectives import OPS, Op
from commgate.model.expectation import Context, ExpectedCollective, Phase, Residual
from commgate.model.scenario import Scenario
from commgate.model.schemes import zero3_fetch
from commgate.model.schemes._common import frozen, padded
from commgate.model.schemes.data_parallel import DataParallel
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.schemes.zero3 import Zero3
from commgate.model.transformer import ParamTensor


def _padding(
    ctx: Context, term: str, rows: list[ExpectedCollective], unpadded: list[ExpectedCollective]
) -> list[Residual]:
    """The named term for partition padding: rank 0's paper-weighted bytes of the padded rows minus
    those of the same rows unpadded (none when nothing is padded)."""

    extra = _volume(rows, term) - _volume(unpadded, term)
    if not extra:
        return []
    d = ctx.scenario.parallelism.dp
    detail = f"DeepSpeed pads partitioned parameters so that each of the d={d} ranks holds an equal share"
    return [Residual(term=term, name="partition padding", bytes=extra, detail=detail)]


def without_comm_dtype(ctx: Context) -> Context:
    """The scenario with its DeepSpeed block's ``communication_data_type`` left out (``ctx`` itself if it
    has none)."""
    cfg = ctx.scenario.deepspeed_config
    if "communication_data_type" not in cfg:
        return ctx
    plain = {k: v for k, v in cfg.items() if k != "communication_data_type"}
    return Context(scenario=replace(ctx.scenario, deepspeed=json.dumps(plain)))


def comm_dtype_residual(ctx: Context, term: str, volume: Callable[[Context], Fraction]) -> list[Residual]:
    """The named term "communication dtype": ``volume`` (rank 0's bytes towards ``term``) of the scenario
    minus that of the scenario without ``communication_data_type``."""
    if "communication_data_type" not in ctx.scenario.deepspeed_config:
        return []
    extra = volume(ctx) - volume(without_comm_dtype(ctx))
    if not extra:
        return []
    detail = (
        f"gradients are reduced in {ctx.scenario.deepspeed_config.get('communication_data_type')} "
        f"(communication_data_type), the parameters are {ctx.scenario.model.dtype}"
    )
    return [Residual(term=term, name="communication dtype", bytes=extra, detail=detail)]


def _accumulation(
    ctx: Context, term: str, component: DeepSpeedZero12 | DeepSpeedZero3, unpadded: list[ExpectedCollective]
) -> list[Residual]:
    """The named terms for what the paper's one pass per step in the parameters' dtype leaves out, each
    the model's own unpadded rows differenced (``unpadded``: the scenario's own per-step rows, unpadded):
    the gradients' communication dtype, then the recompute's extra gathers (ZeRO-3 with activation
    checkpointing), then the other m - 1 micro-batches."""
    par = ctx.scenario.parallelism
    cfg = ctx.scenario.deepspeed_config
    plain = {k: v for k, v in cfg.items() if k != "communication_data_type"}

    def at(ds: dict[str, object], **changes: object) -> Context:
        if ds == cfg and not changes:
            return ctx
        scenario = replace(ctx.scenario, deepspeed=json.dumps(ds), parallelism=replace(par, **changes))  # type: ignore[arg-type]
        return Context(scenario=scenario)

    volumes: dict[object, Fraction] = {ctx.scenario: _volume(unpadded, term)}

    def volume(c: Context) -> Fraction:  # the steps difference some scenarios twice: each computed once
        if c.scenario not in volumes:
            volumes[c.scenario] = _volume(component.collectives(c, pad=False, init=False), term)
        return volumes[c.scenario]

    what = "reduces gradients" if par.zero.stage < 3 else "gathers parameters and reduce-scatters gradients"
    out = comm_dtype_residual(ctx, term, volume)
    steps = []
    if par.zero.stage == 3 and not zero3_fetch.knobs(ctx).inert:
        # the coordinator's knobs, then the rest with parameters released after use and nothing prefetched
        zo = plain.get("zero_optimization", {})
        inert = plain | {"zero_optimization": (zo if isinstance(zo, dict) else {}) | zero3_fetch.INERT}
        k = zero3_fetch.knobs(ctx)
        steps.append(
            (
                at(plain),
                at(inert),
                "ZeRO-3 prefetch, reuse and persistence",
                f"DeepSpeed's coordinator keeps parameters gathered for reuse within {k.reuse:,} elements "
                f"(stage3_max_reuse_distance), prefetches up to {k.prefetch:,} (stage3_prefetch_bucket_size, at "
                f"most {k.max_live:,} live) and keeps parameters of at most {k.persistence:,} elements "
                "(stage3_param_persistence_threshold) gathered, re-gathering them after each optimizer step; "
                "Eq. 3 gathers every parameter in each forward and backward",
            )
        )
        plain = inert
    steps += [
        (
            at(plain, micro_batches=1),
            at(plain, micro_batches=1, activation_checkpointing=False),
            "activation-checkpoint recompute",
            "each layer's recompute in the backward gathers its modules' parameters again",
        ),
        (
            at(plain),
            at(plain, micro_batches=1),
            "gradient accumulation",
            f"ZeRO-{par.zero.stage} {what} in each of the m={par.micro_batches} micro-batches; {term} counts one "
            "pass a step",
        ),
    ]
    for now, before, name, detail in steps:
        extra = volume(now) - volume(before)
        if extra:
            out.append(Residual(term=term, name=name, bytes=extra, detail=detail))
    return out


def grad_dtype(ctx: Context) -> str:
    """The dtype ZeRO reduces gradients in: ``communication_data_type`` if the config sets it, else the
    parameters'. In any case, as DeepSpeed reads it (``get_communication_data_type`` lower-cases it)."""
    dtype = ctx.scenario.deepspeed_config.get("communication_data_type")
    return str(dtype).lower() if dtype else ctx.scenario.model.dtype


def _volume(rows: list[ExpectedCollective], term: str) -> Fraction:
    """Rank 0's paper-weighted bytes per step of the rows that count towards ``term`` (message bytes
    summed as integers per op and group size, weighted by the paper's factor once)."""
    counted: Counter[tuple[Op, int]] = Counter()
    for r in rows:
        if r.paper_term == term and not r.once and r.issued_by(0):
            counted[r.op, r.group_size] += r.bytes_per_step
    return sum((OPS[op].paper(n) * b for (op, n), b in counted.items()), Fraction(0))


def built_partitioned(s: Scenario) -> bool:
    """Whether the ZeRO-3 workload builds the decoder inside ``deepspeed.zero.Init``, each parameter
    partitioned (after one broadcast from the group's first rank) as it is created: in emulated runs, so
    that a full-size model never exists whole on the one machine."""
    return s.emulate and s.parallelism.zero.stage == 3 and not s.model.module


def _init_broadcasts(
    ctx: Context, base: ExpectedCollective, times: int, params: tuple[ParamTensor, ...] | None = None
) -> list[ExpectedCollective]:
    """The engine's broadcast of each parameter (a rank's tensor-parallel shard of it) at construction."""
    isz, tp = ctx.scenario.model.itemsize, ctx.scenario.parallelism.tp
    row = replace(
        base,
        op=Op.BROADCAST,
        dtype="uint8",
        calls=times,
        source="DeepSpeed initial parameter broadcast (per parameter, as bytes)",
    )
    return row.sized_each(p.numel_per_tp_rank(tp) * isz for p in (ctx.params if params is None else params))


def _init_row(ctx: Context, op: Op) -> ExpectedCollective:
    """A once-per-run row over the data-parallel groups, in the model's dtype, to derive the others from."""
    return ExpectedCollective(
        op=op,
        axis="dp",
        groups=ctx.layout.dp_groups(),
        dtype=ctx.scenario.model.dtype,
        elements=0,
        calls=1,
        phase=Phase.INIT,
        source="",
        once=True,
    )


MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
"""The bucket of DeepSpeed's engine when no ZeRO optimizer reduces (``engine.allreduce_gradients``)."""


def sliced(ctx: Context) -> bool:
    """Whether ZeRO-1/2 reduce an oversized gradient in slices (``average_tensor`` with
    ``reduce_scatter`` over the contiguous gradient buffer: DeepSpeed's defaults) or whole (either one
    off: ``gradient_reduction_w_predivide`` or ``buffered_reduce_fallback``)."""
    zo = ctx.scenario.deepspeed_config.get("zero_optimization", {})
    if not isinstance(zo, dict):
        return True
    return bool(zo.get("reduce_scatter", True)) and bool(zo.get("contiguous_gradients", True))


def in_hooks(ctx: Context) -> bool:
    """Whether ZeRO-1/2 reduce the gradients in their backward hooks, as each becomes ready
    (``process_gradients``: ``partition_gradients or overlap_comm``): ZeRO-2 always, ZeRO-1 with
    ``overlap_comm`` on (only in the boundary micro-batch's backward). Otherwise ZeRO-1 reduces them
    after the backward, in registration order (``reduce_gradients``)."""
    zo = ctx.scenario.deepspeed_config.get("zero_optimization", {})
    overlap = isinstance(zo, dict) and zo.get("overlap_comm") is True
    return ctx.scenario.parallelism.zero.stage >= 2 or overlap


def reduction_buckets(
    sizes: list[int],
    stage: int,
    limit: int,
    d: int,
    *,
    slices: bool = True,
    ready: list[int] | None = None,
    hooked: bool | None = None,
) -> list[int]:
    """Elements per gradient all-reduce of DeepSpeed's engine for one parameter group, ``sizes`` in
    registration order, reduced over ``d`` ranks. Stage 0 (the engine itself, ``allreduce_no_retain``):
    registration order, a bucket sent once it has passed ``MEMORY_OPT_ALLREDUCE_SIZE`` (the zero config's
    bucket size does not apply). ZeRO-1/2: ``hooked`` (``in_hooks``; by default ZeRO-2's) as gradients
    become ready (``ready``, else reverse registration), otherwise in registration order; both flushed
    before a gradient would take the bucket past ``limit`` (``reduce_bucket_size``), and a gradient larger
    than that reduced on its own in slices (``oversized``)."""
    out: list[int] = []
    if stage == 0:
        current = 0
        for n in sizes:
            current += n
            if current > MEMORY_OPT_ALLREDUCE_SIZE:
                out.append(current)
                current = 0
        return [*out, current] if current else out
    hooked = stage >= 2 if hooked is None else hooked
    order = (ready or list(reversed(range(len(sizes))))) if hooked else list(range(len(sizes)))
    bucket: list[int] = []
    for i in order:
        if bucket and sum(sizes[j] for j in bucket) + sizes[i] > limit:
            out += _sent(sizes, bucket, limit, d, slices)
            bucket = []
        bucket.append(i)
    return out + _sent(sizes, bucket, limit, d, slices) if bucket else out


def _sent(sizes: list[int], bucket: list[int], limit: int, d: int, slices: bool) -> list[int]:
    if slices and len(bucket) == 1 and sizes[bucket[0]] > limit:
        return oversized(sizes, bucket[0], limit, d)
    return [sum(sizes[j] for j in bucket)]


def oversized(sizes: list[int], index: int, limit: int, d: int) -> list[int]:
    """ZeRO-1/2's reduction of a gradient larger than ``reduce_bucket_size`` (``average_tensor`` with
    ``reduce_scatter`` and multi-rank bucket all-reduce, DeepSpeed's defaults): the gradient is cut where
    the flat buffer's partitions (one per data-parallel rank; the buffer holds the group's parameters in
    registration order, padded to a multiple of 2 x d) begin, and the slices are all-reduced in groups, a
    group sent as soon as it passes the bucket size."""
    start, n = sum(sizes[:index]), sizes[index]
    size = padded(sum(sizes), 2 * d) // d
    cuts = [start, *(k * size for k in range(1, d) if start < k * size < start + n), start + n]
    out, group = [], 0
    for a, b in itertools.pairwise(cuts):
        group += b - a
        if group > limit:
            out.append(group)
            group = 0
    return [*out, group] if group else out


def _ready_order(ctx: Context) -> tuple[ParamTensor, ...]:
    """The order gradients reach ZeRO-3's reduction: a module's gradients together, modules in the order
    their first gradient becomes ready (the built-in decoder's in reverse), each module's parameters in
    registration order (a linear layer's weight, then bias)."""
    return _ready_order_of(ctx.trainable, ctx.ready_order)


@functools.lru_cache(maxsize=16)
def _ready_order_of(trainable: tuple[ParamTensor, ...], ready: tuple[ParamTensor, ...]) -> tuple[ParamTensor, ...]:
    """``_ready_order`` of the parameters (once per model: the named terms' variants of a scenario share it)."""
    owners: dict[str, list[ParamTensor]] = {}
    for p in trainable:
        owners.setdefault(p.name.rsplit(".", 1)[0], []).append(p)
    first: dict[str, int] = {}
    for i, p in enumerate(ready):
        first.setdefault(p.name.rsplit(".", 1)[0], i)
    return tuple(p for owner in sorted(owners, key=lambda o: first[o]) for p in owners[owner])


def gradient_buckets(ctx: Context, over: int = 1) -> list[int]:
    """Elements of each gradient reduction, in gradient-ready order (``_ready_order``). ZeRO-1/2: as
    ``reduction_buckets``. ZeRO-3: a bucket is flushed before a gradient whose own (unpadded) size would
    take it past ``reduce_bucket_size``, and each gradient is sent padded to a multiple of ``over``."""
    par = ctx.scenario.parallelism
    if par.zero.stage < 3:
        sizes = [p.numel for p in ctx.trainable]
        index = {p.name: i for i, p in enumerate(ctx.trainable)}
        ready = [index[p.name] for p in ctx.ready_order]
        return reduction_buckets(
            sizes,
            par.zero.stage,
            par.zero.bucket_elements,
            par.dp,
            slices=sliced(ctx),
            ready=ready,
            hooked=in_hooks(ctx),
        )
    return list(_zero3_buckets(_ready_order(ctx), par.zero.bucket_elements, over))


@functools.lru_cache(maxsize=16)
def _zero3_buckets(order: tuple[ParamTensor, ...], limit: int, over: int) -> tuple[int, ...]:
    """ZeRO-3's reductions of ``gradient_buckets``, once per parameter order, bucket size and padding."""
    out, current, sent = [], 0, 0
    for p in order:
        if current and current + p.numel > limit:
            out.append(sent)
            current = sent = 0
        current += p.numel
        sent += padded(p.numel, over)
    if current:
        out.append(sent)
    return tuple(out)


def _bf16_optimizer(ctx: Context, step: ExpectedCollective, *, pad: bool) -> list[ExpectedCollective]:
    """ZeRO-1 with bf16 parameters and fp32 gradient accumulation (``data_types.grad_accum_dtype``) runs
    DeepSpeed's ``BF16_Optimizer``: at the boundary the engine all-reduces its flat fp32 gradient buffer
    (padded to a multiple of 2 x d) in one call, in the communication dtype (``buffered_allreduce_fallback``);
    the norm needs no collective without model parallelism; the updated partitions are all-gathered in
    bf16 (``all_gather_dp_groups``)."""
    n = padded(ctx.trainable_count, 2 * ctx.scenario.parallelism.dp) if pad else ctx.trainable_count
    return [
        replace(step, elements=n, dtype=grad_dtype(ctx), source="BF16_Optimizer gradient all-reduce (flat buffer)"),
        replace(
            step,
            op=Op.ALL_GATHER,
            elements=n,
            phase=Phase.OPTIMIZER,
            source="BF16_Optimizer all-gather of the updated partitions",
        ),
    ]


@dataclass(frozen=True, slots=True)
class DeepSpeedZero12(DataParallel):
    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context, *, pad: bool = True, init: bool = True) -> list[ExpectedCollective]:
        """``init=False`` leaves out the once-per-run rows (the residuals difference only per-step ones)."""
        zs, d = ctx.scenario.parallelism.zero.stage, ctx.scenario.parallelism.dp
        base = _init_row(ctx, Op.ALL_REDUCE)
        rows = _init_broadcasts(ctx, base, 1) if init else []
        step = replace(base, once=False, phase=Phase.BACKWARD, paper_term="Eq. 2")
        if ctx.optimizer == "BF16_Optimizer":
            return rows + _bf16_optimizer(ctx, step, pad=pad)
        per_step = ctx.scenario.parallelism.micro_batches if zs >= 2 else 1  # ZeRO-1: at the boundary only
        for i, b in enumerate(buckets := gradient_buckets(ctx)):
            rows.append(
                replace(
                    step,
                    elements=b,
                    calls=per_step,
                    dtype=grad_dtype(ctx),
                    source=f"ZeRO-{zs} gradient all-reduce, bucket {i} of {len(buckets)}",
                )
            )
        norm = replace(
            step,
            op=Op.ALL_REDUCE,
            dtype="fp32",  # the norm is computed in fp32 whatever the parameters' dtype
            elements=1,
            calls=1,
            phase=Phase.OPTIMIZER,
            paper_term=None,
            source=f"ZeRO-{zs} gradient-norm all-reduce (fp32)",
        )
        rows.append(norm)
        if ctx.scenario.model.dtype != "fp32":  # mixed precision: the overflow check of the 16-bit gradients
            rows.append(replace(norm, dtype="uint8", source=f"ZeRO-{zs} gradient overflow check (uint8)"))
        rows.append(
            replace(
                step,
                op=Op.ALL_GATHER,
                # the flat buffer is padded to a multiple of 2 x d elements (nccl_start_alignment_factor)
                elements=padded(ctx.trainable_count, 2 * d) if pad else ctx.trainable_count,
                phase=Phase.OPTIMIZER,
                source=f"ZeRO-{zs} all-gather of the updated fp32 partitions",
            )
        )
        return rows

    def residuals(self, ctx: Context) -> list[Residual]:
        d = ctx.scenario.parallelism.dp
        extra = Residual(
            term="Eq. 2",
            name="gradients all-reduced, not reduce-scattered",
            bytes=Fraction(d - 1, d) * ctx.trainable_count * ctx.scenario.model.itemsize,
            detail="DeepSpeed reduces ZeRO-1/2 gradients with all_reduce (2N(d-1)/d); Eq. 2 assumes "
            "reduce_scatter (N(d-1)/d) + all_gather",
        )
        unpadded = self.collectives(ctx, pad=False, init=False)
        padding = _padding(ctx, "Eq. 2", self.collectives(ctx, init=False), unpadded)
        return [*DataParallel.residuals(self, ctx), extra, *_accumulation(ctx, "Eq. 2", self, unpadded), *padding]


def _coordinator_gathers(ctx: Context, step: ExpectedCollective, over: int) -> list[ExpectedCollective]:
    """The parameter all-gathers of DeepSpeed's coordinator (``zero3_fetch``), replayed over steps 0 and 1
    (later steps repeat step 1): step 0 records the trace, then prefetching and reuse apply; and after
    every optimizer step the persistent parameters' re-gathering (one call each)."""
    m = ctx.scenario.parallelism.micro_batches
    runs = zero3_fetch.passes(ctx, 2)

    hpz = {"axis": "hpz", "groups": ctx.layout.hpz_groups()}

    def tally(passes: list[zero3_fetch.PassGathers]) -> Counter[zero3_fetch.Kind]:
        counts: Counter[zero3_fetch.Kind] = Counter()
        distinct = {id(p): p for p in passes}  # later passes repeat earlier ones (the same list)
        for key, n in Counter(id(p) for p in passes).items():
            for kind, calls in distinct[key].tally(over).items():
                counts[kind] += calls * n
        return counts

    def rows(counts: Counter[zero3_fetch.Kind], **when: object) -> list[ExpectedCollective]:
        out = []
        for (backward, recompute, prefetch, secondary, size), calls in sorted(counts.items()):
            phase = Phase.BACKWARD if backward else Phase.FORWARD
            what = "prefetch" if prefetch else "module parameter"
            where = f"{phase}{', hpZ' if secondary else ''}{', recompute' if recompute else ''}"
            source = f"ZeRO-3 {what} all-gather ({where})"
            group = hpz if secondary else {}
            out.append(replace(step, phase=phase, elements=size, calls=calls, source=source, **group, **when))  # type: ignore[arg-type]
        return out

    first, later = tally(runs[:m]), tally(runs[m:])
    out = rows(later) if first == later else [*rows(first, once=True, at_step=0), *rows(later, from_step=1)]
    kept = zero3_fetch.persistent(ctx.params, zero3_fetch.knobs(ctx))
    sizes = Counter(padded(p.numel, over) for p in ctx.params if p.name in kept)
    out += [
        replace(
            step,
            phase=Phase.OPTIMIZER,
            elements=size,
            calls=calls,
            source="ZeRO-3 persistent parameters re-gathered after the optimizer step (per parameter)",
        )
        for size, calls in sorted(sizes.items())
    ]
    return out


SUB_GROUP_SIZE = 1_000_000_000
"""``zero_optimization.sub_group_size``'s default (``DeepSpeedZeroConfig``)."""


def sub_groups(ctx: Context) -> int:
    """How many optimizer sub-groups ZeRO-3 cuts its parameters into (``stage3._create_fp16_sub_groups``):
    in registration order, a sub-group closed once its parameters' partitions (each parameter's
    ceil(numel / d) elements) reach ``sub_group_size``; one sub-group when the whole partition is no
    larger. ZeRO-3 all-reduces the gradient norm once per sub-group."""
    zo = ctx.scenario.deepspeed_config.get("zero_optimization", {})
    size = zo.get("sub_group_size", SUB_GROUP_SIZE) if isinstance(zo, dict) else SUB_GROUP_SIZE
    d = ctx.scenario.parallelism.dp
    parts = [padded(p.numel, d) // d for p in ctx.trainable]
    if size >= sum(parts):
        return 1
    count = current = 0
    for i, n in enumerate(parts):
        current += n
        if current >= size or i == len(parts) - 1:
            count, current = count + 1, 0
    return count


@dataclass(frozen=True, slots=True)
class DeepSpeedZero3(Zero3):
    built_partitioned: bool | None = None
    """Whether the model was built inside ``deepspeed.zero.Init`` (each parameter broadcast once as it is
    partitioned, and not again by the engine); None: as commgate's workload builds it (``built_partitioned``
    of the scenario). Hugging Face's ``from_config`` under a ZeRO-3 config builds it so."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context, *, pad: bool = True, init: bool = True) -> list[ExpectedCollective]:
        """``init=False`` leaves out the once-per-run rows (the residuals difference only per-step ones)."""
        z, d = ctx.scenario.parallelism.zero, ctx.scenario.parallelism.dp
        if z.qwz or z.qgz:  # quantized collectives: DeepSpeed runs them on GPUs only; the plain model
            return Zero3.collectives(self, ctx)
        over = d if pad else 1  # each parameter is partitioned (padded) on its own
        base = _init_row(ctx, Op.ALL_GATHER)
        # each parameter broadcast as bytes twice: by the engine and when partitioned in initialize; once
        # when it was partitioned as it was built
        partitioned = built_partitioned(ctx.scenario) if self.built_partitioned is None else self.built_partitioned
        rows = _init_broadcasts(ctx, base, 1 if partitioned else 2) if init else []
        gather = replace(base, source="ZeRO-3 initial all-gather (per parameter)")
        rows += gather.sized_each(padded(p.numel, over) for p in (ctx.trainable if init else ()))  # not a frozen one
        # the rest is the same with or without the once-per-run rows above: built once per context
        return rows + ctx.once(("ZeRO-3 rows", over), lambda: self._after_init(ctx, base, over))

    def _after_init(self, ctx: Context, base: ExpectedCollective, over: int) -> list[ExpectedCollective]:
        """The construction barriers, the trace broadcasts and every step's rows."""
        rows = [replace(base, op=Op.BARRIER, dtype="none", calls=3, source="ZeRO-3 construction barriers")]
        trace = replace(base, op=Op.BROADCAST, dtype="int64", phase=Phase.FORWARD, source="ZeRO-3 trace broadcast")
        par = ctx.scenario.parallelism
        traced_modules, traced_params = zero3_fetch.traced(ctx)
        m = par.micro_batches
        second = 1 // m  # the step of the coordinator's second micro-batch
        rows += [
            replace(trace, elements=1, at_step=0),
            replace(trace, elements=0, at_step=0),
            replace(trace, elements=1, calls=3, at_step=second),
            replace(trace, elements=traced_modules, at_step=second),
            replace(trace, elements=traced_params, calls=2, at_step=second),
        ]
        step = replace(base, once=False, phase=Phase.FORWARD, paper_term="Eq. 3", calls=m)
        rows += _coordinator_gathers(ctx, step, over)
        for i, b in enumerate(buckets := gradient_buckets(ctx, over)):
            rows.append(
                replace(
                    step,
                    op=Op.REDUCE_SCATTER,
                    phase=Phase.BACKWARD,
                    elements=b,
                    source=f"ZeRO-3 gradient reduce-scatter, bucket {i} of {len(buckets)}",
                    calls=m,
                    dtype=grad_dtype(ctx),
                )
            )
        groups = sub_groups(ctx)
        # offloaded, the optimizer sums its norms on the CPU into a FloatTensor
        # (complete_grad_norm_calculation_for_cpu_offload); else get_grad_norm_direct's norm dtype, float64
        offloaded = dsconfig.offloads_optimizer(ctx.scenario.deepspeed_config)
        norm = "fp32" if offloaded else "float64"
        rows.append(
            replace(
                step,
                op=Op.ALL_REDUCE,
                dtype=norm,
                elements=1,
                calls=groups,
                phase=Phase.OPTIMIZER,
                paper_term=None,
                source=f"ZeRO-3 gradient-norm all-reduce ({norm}{', optimizer offloaded' if offloaded else ''})"
                + (f", one per optimizer sub-group ({groups})" if groups > 1 else ""),
            )
        )
        return rows

    def residuals(self, ctx: Context) -> list[Residual]:
        unpadded = self.collectives(ctx, pad=False, init=False)
        padding = _padding(ctx, "Eq. 3", self.collectives(ctx, init=False), unpadded)
        skipped = _not_gathered_for_backward(ctx)
        why = (
            f"{skipped:,} elements belong to modules whose backward never runs (no gradient reaches them), "
            "so the backward does not gather them"
        )
        return [
            *Zero3.residuals(self, ctx),
            *frozen(
                ctx,
                "Eq. 3",
                Fraction(ctx.scenario.parallelism.dp - 1, ctx.scenario.parallelism.dp),
                unused=skipped,
                why=why,
            ),
            *_shared_parameters(ctx),
            *_accumulation(ctx, "Eq. 3", self, unpadded),
            *padding,
        ]


def _eq3_pass(ctx: Context) -> list[zero3_fetch.Gather]:
    """The coordinator's gathers in a steady pass of Eq. 3's regime: its knobs inert (each module's
    parameters gathered for its use and released after), one micro-batch, no recompute."""
    par, cfg = ctx.scenario.parallelism, ctx.scenario.deepspeed_config
    zo = cfg.get("zero_optimization", {})
    inert = cfg | {"zero_optimization": (zo if isinstance(zo, dict) else {}) | zero3_fetch.INERT}
    scenario = replace(
        ctx.scenario,
        deepspeed=json.dumps(inert),
        parallelism=replace(par, micro_batches=1, activation_checkpointing=False),
    )
    return zero3_fetch.passes(Context(scenario=scenario), 2)[-1]


def _not_gathered_for_backward(ctx: Context) -> int:
    """Elements a pass's backward leaves ungathered in Eq. 3's regime: those of modules whose backward
    never runs, which only frozen parameters cause (none for the built-in models)."""
    if ctx.param_count == ctx.trainable_count:
        return 0
    gathered = {p.name for g in _eq3_pass(ctx) if g.backward for p in g.params}
    return sum(p.numel for p in ctx.params if p.name not in gathered)


def _shared_parameters(ctx: Context) -> list[Residual]:
    """Gathers of a parameter several modules hold (a user's tied weights, ``wte.weight =
    lm_head.weight``): in Eq. 3's regime DeepSpeed's coordinator gathers it in each holder's forward and
    backward, where Eq. 3 gathers every parameter once in each (the built-in decoder's tied embedding is
    read by the output layer as an external parameter of the root, gathered once: no term)."""
    if not ctx.scenario.model.module:
        return []
    seen: Counter[tuple[str, bool]] = Counter()
    extra, names = Fraction(0), {}
    d, hpz, isz = ctx.scenario.parallelism.dp, ctx.scenario.parallelism.zero.hpz, ctx.scenario.model.itemsize
    for g in _eq3_pass(ctx):
        for p in g.params:
            seen[p.name, g.backward] += 1
            if seen[p.name, g.backward] > 1:
                extra += OPS[Op.ALL_GATHER].paper(hpz if g.secondary else d) * p.numel * isz
                names[p.name] = p.numel
    if not extra:
        return []
    held = ", ".join(f"{name} ({numel:,})" for name, numel in names.items())
    detail = (
        f"{held} held by several modules (tied weights): DeepSpeed's coordinator gathers such a parameter in "
        "each holder's forward and backward; Eq. 3 gathers every parameter once in each"
    )
    return [Residual(term="Eq. 3", name="shared parameters", bytes=extra, detail=detail)]


P = "parallelism"


def zero_options(c: Check) -> None:
    """What DeepSpeed's ZeRO stages run with: even buckets, the pipeline engine at stage 0 or 1, no stage 3
    with tensor parallelism, hpZ partitions dividing dp."""
    par, stage = c.par, c.par.zero.stage
    if stage in (1, 2) and par.zero.bucket_elements % 2:
        c.bad(
            [P, "zero", "bucket_elements"],
            f"{par.zero.bucket_elements}: DeepSpeed's ZeRO-1/2 need an even bucket size "
            "(allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2)",
        )
    if par.pp > 1 and stage >= 2:
        c.bad([P, "zero", "stage"], f"{stage}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only")
    if par.tp > 1 and stage >= 3:
        c.bad([P, "zero", "stage"], f"{stage}: ZeRO-3 with tensor parallelism (tp={par.tp}) is unsupported")
    if par.zero.hpz > 1 and par.dp % par.zero.hpz:
        c.bad([P, "zero", "hpz"], f"{par.zero.hpz}: dp={par.dp} is not divisible by the hpZ partition size")


def deepspeed_keys(c: Check) -> None:
    """The ``deepspeed:`` block's keys: refused ones, ones the model does not follow (unless the model check
    is off), the batch size it states."""
    par = c.par
    for path, message in dsconfig.refused_keys(c.ds):
        c.bad(["deepspeed", *path], message)
    if c.checked:
        dsconfig.unmodelled(c.ds, par.zero.stage, c.bad)
    batch = c.ds.get("train_batch_size", "auto")
    if dsconfig.given(batch) and batch != par.dp * par.micro_batch * par.micro_batches:
        c.bad(
            ["deepspeed", "train_batch_size"],
            f"{batch} != dp*b*m = {par.dp}*{par.micro_batch}*{par.micro_batches}",
        )


def optimizer_wrapper(c: Check) -> None:
    """The optimizer wrapper DeepSpeed's engine would choose (``dsconfig.optimizer``): a mix it refuses is an
    error, one the model does not follow yet an error unless the model check is off. Not where Megatron's
    own engine runs the stages (trainer megatron under scheme 3d: no DeepSpeed at all)."""
    if not c.scheme.deepspeed or c.par.pipeline.engine == "megatron":
        return
    par, dtype = c.par, c.model.dtype
    where: list[str | int] = ["deepspeed", "data_types", "grad_accum_dtype"]
    section = c.ds.get("data_types")
    acc = section.get("grad_accum_dtype") if isinstance(section, Mapping) else None
    if acc is not None and str(acc) not in dsconfig.DTYPES:
        c.bad(where, f"{acc!r}: DeepSpeed's dtypes are {', '.join(sorted(dsconfig.DTYPES))}")
        return
    try:
        wrapper = dsconfig.optimizer(c.ds, dtype, par.zero.stage, pipeline=par.pp > 1)
    except ValueError as exc:
        c.bad(where, str(exc))
        return
    at: list[str | int] = where if acc is not None else ["model", "dtype"]
    if wrapper == "BF16_Optimizer" and par.tp > 1:
        c.bad(
            at,
            f"{acc or dtype}: DeepSpeed's BF16_Optimizer fails with tensor parallelism on DTensor (tp={par.tp}): "
            "its gradient norm skips every parameter not marked model_parallel and stacks an empty list on "
            "tensor-parallel ranks > 0; use ZeRO-1 with bf16 gradient accumulation, or fp32",
        )
    elif c.checked and wrapper == "BF16_Optimizer" and par.moe is not None:
        c.bad(
            at,
            f"{acc or dtype}: MoE under DeepSpeed's BF16_Optimizer is not modelled yet; "
            "expectations: {model: {check: false}} runs it as a baseline-only gate",
        )


RULES: tuple[Rule, ...] = (zero_options, deepspeed_keys, optimizer_wrapper)
