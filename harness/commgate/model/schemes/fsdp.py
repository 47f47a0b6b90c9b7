"""torch FSDP2 (``torch.distributed.fsdp.fully_shard``) as it runs on torch 2.13 (read from
``torch/distributed/fsdp/_fully_shard/`` and measured): Eq. 3, as for ZeRO-3, group by group.

* Wrapping as torchtitan does it: ``fully_shard`` on every transformer block, then on the root, whose
  group holds what is left (embeddings, final norm, head). Each group's parameters are one flat
  all-gather and its gradients one flat reduce-scatter over the data-parallel group
  (``foreach_all_gather``, ``foreach_reduce``), every parameter padded on dim 0 to a multiple of d
  (``_get_dim0_padded_size``): message m = d * sum(ceil(dim0 / d) * rest) elements.
* Construction communicates nothing: every rank keeps its own dim-0 shard of the same initial weights.
  Emulated (without pipeline stages), the decoder is built on the meta device and sharded there
  (``built_on_meta``), as torchtitan builds it: tensor parallelism's ``distribute_tensor`` then moves no
  data either (built whole, it scatters each sharded parameter from the group's first rank).
* Forward: each group is all-gathered before its forward. After it, a group with
  ``reshard_after_forward`` frees the gathered parameters and all-gathers them again for its backward.
  Left unset, torch reshards the blocks but not the root (``FSDPState._lazy_init``: "the parameters
  would be freed and all-gathered immediately"); set, the root follows it too.
* Backward: after each group's backward its gradients are reduce-scattered, in ``reduce_dtype``
  (``MixedPrecisionPolicy``; default ``param_dtype``, default the parameters' dtype). ReduceOp.AVG,
  no all-reduce without a replicate dimension.
* Gradient accumulation (m micro-batches): ``set_requires_gradient_sync(False)`` for all but the last, so
  one reduce-scatter per step; with ``set_reshard_after_backward(False)`` (``reshard_after_backward:
  false``) the parameters stay gathered between micro-batches, so only the first forward gathers.
* HSDP (``dp_replicate`` > 1, a (replicate, shard) mesh): gathers and reduce-scatters run within each
  replica's ``dp`` ranks; each reduce-scattered shard (padded / d elements) is then all-reduced across the
  replicas, in ``reduce_dtype``.
* Activation checkpointing (per block, torch's non-reentrant checkpoint) adds nothing: a block's
  recompute runs inside its backward, after the backward all-gather (or with the parameters still
  gathered), so it gathers nothing more.
* The optimizer steps on the local shards: no communication.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.scenario import Scenario
from commgate.model.schemes._common import beyond_eq1, sharding
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.schemes.zero3 import TERM, eq3_term
from commgate.model.transformer import WIRE_ITEMSIZE, ParamTensor, Shard


def built_on_meta(s: Scenario) -> bool:
    """Of a scenario whose scheme is FSDP2's (``Scheme.fsdp``: callers check that first): whether its workload
    builds the decoder on the meta device, shards it there (tensor parallelism and FSDP2) and fills each
    rank's own shards: in emulated runs without pipeline stages, so that a full-size model never exists whole
    on the one machine. DTensor's ``distribute_tensor`` of a meta parameter communicates nothing
    (``TensorParallel`` predicts no scatter at construction)."""
    return s.emulate and s.parallelism.pp == 1 and not s.model.module


@dataclass(frozen=True, slots=True)
class Group:
    """One ``fully_shard`` parameter group: its name, its padded elements and its all-gathers per step."""

    name: str
    padded: int
    """Elements of the flat all-gather output / reduce-scatter input: each parameter padded on dim 0."""
    unpadded: int
    forward: int
    backward: int
    root: bool = False
    """The root module's group (the embeddings, final norm and head; a pipeline stage's own): never resharded
    after the forward unless ``reshard_after_forward`` says so."""


def groups(ctx: Context, stage: int = 0) -> list[Group]:
    """The blocks' groups in order, then the root's, with their all-gathers per step (of pipeline ``stage``'s
    module, whose root holds the embeddings on the first stage and the final norm and head on the last)."""
    par = ctx.scenario.parallelism
    f, d, m = par.fsdp, par.data_ranks, par.micro_batches
    by_layer: dict[int | None, list[ParamTensor]] = {}
    for p in ctx.stage_params(stage) if par.pp > 1 else ctx.params:
        by_layer.setdefault(p.layer, []).append(p)
    forward = 1 + (m - 1) * f.reshard_after_backward  # kept gathered between micro-batches: one forward gathers
    out = []
    for layer in [*sorted(k for k in by_layer if k is not None), None]:
        params = by_layer.get(layer, [])
        if not params:
            continue
        root = layer is None
        reshard = (not root) if f.reshards is None else f.reshards
        gathers = pipelined_gathers(ctx, stage, reshard) if par.pp > 1 else (forward, m if reshard else 0)
        padded = sum(_padded(p, d, par.tp) for p in params)
        out.append(
            Group(
                name=("stage root" if par.pp > 1 else "root (embeddings, final norm, head)")
                if root
                else f"block {layer}",
                padded=padded,
                unpadded=sum(p.numel_per_tp_rank(par.tp) for p in params),
                forward=gathers[0],
                backward=gathers[1],
                root=root,
            )
        )
    return out


_ROOT = {False: "root (embeddings, final norm, head)", True: "stage root"}


def pipeline_order(ctx: Context, stage: int) -> str:
    """The forwards (F) and backwards (B) of one step on pipeline ``stage``, as torch 2.13's schedules run
    them (``schedules.py``): GPipe all m forwards, then the m backwards; 1F1B min(m, p - stage) forwards,
    then a backward and a forward in turn while forwards remain, then the rest of the backwards; interleaved
    1F1B (v stages a rank, stage s on rank s mod p) the stage's own actions in its rank's order, as torch's
    ``ScheduleInterleaved1F1B`` computes it (``interleaved_order``)."""
    par = ctx.scenario.parallelism
    m = par.micro_batches
    if par.pipeline.virtual_stages > 1:
        return interleaved_order(par.pipeline.schedule, par.pp, par.pipeline.virtual_stages, m, stage)
    if par.pipeline.schedule == "gpipe":
        return "F" * m + "B" * m
    warmup = min(m, par.pp - stage)
    return "F" * warmup + "BF" * (m - warmup) + "B" * warmup


@functools.cache
def interleaved_order(schedule: str, p: int, v: int, m: int, stage: int) -> str:
    """Stage ``stage``'s actions in an interleaved schedule over p ranks of v stages each and m micro-batches:
    forwards (F), full backwards (B), or zero-bubble's backward for the inputs (I) and for the weights (W),
    as torch's own ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``
    ``_calculate_single_rank_operations`` computes them (it reads only these numbers; ``__init__`` needs the
    built stages; the zero-bubble schedule's added bubbles only delay them), its rank's actions filtered to
    the stage."""
    from torch.distributed.pipelining import schedules

    cls: dict[str, Any] = {
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
    }
    rounds = max(1, m // p)
    me = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds)
    ops = cls[schedule]._calculate_single_rank_operations(me, stage % p)
    return "".join(str(a.computation_type.value) for a in ops if a is not None and a.stage_index == stage)


def pipelined_gathers(ctx: Context, stage: int, reshards: bool) -> tuple[int, int]:
    """(forward, backward) all-gathers per step of one FSDP2 group inside a pipeline stage, replaying the
    schedule's order (``pipeline_order``). The stage runs every backward but the step's last with
    ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` (``stage.py``,
    ``backward_maybe_with_nosync``), so a backward leaves the group gathered: a following backward gathers
    nothing, and neither does a following forward, after which a group that ``reshards`` (after the forward)
    is freed again. The reduce-scatter runs once, at the step's end (``perform_reduce_grad``)."""
    gathered, counts = False, {"F": 0, "B": 0}
    for action in pipeline_order(ctx, stage).replace("I", "B").replace("W", ""):  # zero-bubble: I gathers as B
        counts[action] += not gathered
        gathered = not (action == "F" and reshards)
    return counts["F"], counts["B"]


def post_forward_size(ctx: Context) -> int:
    """The ranks a resharded group's backward all-gather runs over: d, or the int ``reshard_after_forward``
    (torch's post-forward mesh; k = d is true, k = 1 false, as ``_get_post_forward_mesh_info`` maps them)."""
    k, d = ctx.scenario.parallelism.fsdp.reshard_group, ctx.scenario.parallelism.data_ranks
    return k if k is not None and k > 1 else d


def _padded(p: ParamTensor, d: int, t: int) -> int:
    """Elements of ``p`` in its group's flat all-gather: the rank's tensor-parallel shard (its dim 0 split
    for column- and vocabulary-parallel weights, its dim 1 for row-parallel ones), padded on dim 0 to a
    multiple of d."""
    local = p.numel_per_tp_rank(t)
    dim0 = p.shape[0] // t if t > 1 and p.shard in (Shard.COLUMN, Shard.VOCAB) else p.shape[0]
    return -(-dim0 // d) * d * (local // dim0)


def dtypes(ctx: Context) -> tuple[str, str]:
    """(all-gather dtype, reduce-scatter dtype) by the mixed-precision policy."""
    f, dtype = ctx.scenario.parallelism.fsdp, ctx.scenario.model.dtype
    gather = f.compute_dtype(dtype)
    return gather, f.reduce_dtype or gather


@dataclass(frozen=True, slots=True)
class FullyShard:
    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        return [row for stage in range(ctx.scenario.parallelism.pp) for row in self._stage(ctx, stage)]

    def _stage(self, ctx: Context, stage: int) -> list[ExpectedCollective]:
        pp, lay = ctx.scenario.parallelism.pp, ctx.layout
        dp = lay.dp_groups(stage) if pp > 1 else lay.dp_groups()
        where = f", stage {stage}" if pp > 1 else ""
        # in torch's pipeline schedule, outside autograd: the forwards and the step's final reduce-scatter
        outside = Phase.PIPELINE if pp > 1 else Phase.FORWARD
        gather, reduce = dtypes(ctx)
        rows = []
        for g in groups(ctx, stage):
            base = ExpectedCollective(
                op=Op.ALL_GATHER,
                axis="dp",
                groups=dp,
                dtype=gather,
                elements=g.padded,
                calls=g.forward,
                phase=outside,
                source=f"FSDP2 parameter all-gather, {g.name}{where} (forward)",
                paper_term=TERM,
                overlaps=True,  # prefetched: the next block's all-gather runs behind this one's compute
            )
            rows.append(base)
            if g.backward:
                k = post_forward_size(ctx)
                rows.append(
                    replace(
                        base,
                        axis="dp" if k == lay.dp else "hpz",
                        groups=dp if k == lay.dp else lay.dp_chunks(k),
                        calls=g.backward,
                        phase=Phase.BACKWARD,
                        source=f"FSDP2 parameter all-gather, {g.name}{where} (backward: resharded after forward)",
                    )
                )
            rows.append(
                replace(
                    base,
                    op=Op.REDUCE_SCATTER,
                    dtype=reduce,
                    calls=1,
                    phase=Phase.PIPELINE if pp > 1 else Phase.BACKWARD,
                    source=f"FSDP2 gradient reduce-scatter, {g.name}{where}",
                    overlaps=True,  # waited at the next block's reduce-scatter or the backward's end
                )
            )
            if lay.replicate > 1:  # HSDP: the reduce-scattered shard is all-reduced across the replicas
                rows.append(
                    replace(
                        base,
                        op=Op.ALL_REDUCE,
                        axis="rep",
                        groups=lay.replicate_groups(),
                        dtype=reduce,
                        elements=g.padded // lay.dp,
                        calls=1,
                        phase=Phase.BACKWARD,
                        source=f"HSDP gradient all-reduce across replicas, {g.name}",
                    )
                )
        return rows

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        return [eq3_term(ctx)]

    def residuals(self, ctx: Context) -> list[Residual]:
        """Eq. 3 (one forward and one backward all-gather and one reduce-scatter of N parameters in the
        model's dtype) to what FSDP2 sends, term by term; their sum is exact."""
        par, model = ctx.scenario.parallelism, ctx.scenario.model
        d, m, isz = par.data_ranks, par.micro_batches, model.itemsize
        share = Fraction(d - 1, d)
        gs = groups(ctx)
        gather, reduce = dtypes(ctx)
        g_isz, r_isz = WIRE_ITEMSIZE[gather], WIRE_ITEMSIZE[reduce]
        unpadded, padded = sum(g.unpadded for g in gs), sum(g.padded for g in gs)
        full = sum(p.numel for p in ctx.params)
        out = [beyond_eq1(ctx, term=TERM, factor=3 * share, counted=full)]
        if unpadded != full:  # 2-D: FSDP2 shards each rank's tensor-parallel shard
            out.append(sharding(ctx, term=TERM, factor=3 * share, full=full, rank0=unpadded))
        if padded != unpadded:
            out.append(
                Residual(
                    term=TERM,
                    name="dim-0 padding",
                    bytes=3 * share * (padded - unpadded) * isz,
                    detail=f"every parameter is padded on dim 0 to a multiple of d={d}: {padded - unpadded:,} elements",
                )
            )
        extra_fwd = sum((g.forward - 1) * g.padded for g in gs)
        if extra_fwd:
            out.append(
                Residual(
                    term=TERM,
                    name="forward all-gathers per micro-batch",
                    bytes=share * extra_fwd * isz,
                    detail=f"in the {par.pipeline.schedule} schedule on stage 0 ({pipeline_order(ctx, 0)}) a forward "
                    "after a forward gathers again, one after a backward finds the group gathered"
                    if par.pp > 1
                    else f"resharded after each backward, every one of the m={m} micro-batches gathers again",
                )
            )
        extra_bwd = sum((g.backward - 1) * g.padded for g in gs)
        if extra_bwd:
            why = {
                None: "torch does not reshard the root after the forward, so its backward gathers nothing",
                False: "reshard_after_forward false: nothing is gathered again for the backward",
                True: "reshard_after_forward true: the root is resharded and gathered again too",
            }[par.fsdp.reshards]
            if par.pp > 1:
                why = (
                    f"in the {par.pipeline.schedule} schedule on stage 0 ({pipeline_order(ctx, 0)}) a backward "
                    f"after a backward finds the group gathered (torch's stage turns resharding after backward "
                    f"off); {why}"
                )
            elif m > 1:
                why += f"; each of m={m} micro-batches' backwards gathers"
            out.append(
                Residual(
                    term=TERM,
                    name="backward all-gathers",
                    bytes=share * extra_bwd * isz,
                    detail=why,
                )
            )
        k = post_forward_size(ctx)
        if k != d:
            out.append(
                Residual(
                    term=TERM,
                    name="post-forward reshard to fewer ranks",
                    bytes=(Fraction(k - 1, k) - share) * sum(g.backward * g.padded for g in gs) * g_isz,
                    detail=f"reshard_after_forward={k}: the backward gathers within {k} ranks, Eq. 3 within d={d}",
                )
            )
        replicas = par.dp_replicate
        if replicas > 1:
            out.append(
                Residual(
                    term=TERM,
                    name="HSDP replica all-reduce",
                    bytes=2 * Fraction(replicas - 1, replicas) * sum(g.padded // d for g in gs) * r_isz,
                    detail=f"each rank's reduced gradient shard is all-reduced over the {replicas} replicas; "
                    f"Eq. 3 counts d={d}, the sharding group",
                )
            )
        precision = share * sum(
            (g.forward + g.backward) * g.padded * (g_isz - isz) + g.padded * (r_isz - isz) for g in gs
        )
        if precision:
            out.append(
                Residual(
                    term=TERM,
                    name="mixed precision",
                    bytes=precision,
                    detail=f"parameters gathered in {gather}, gradients reduced in {reduce}; "
                    f"Eq. 3 counts {model.dtype}",
                )
            )
        return out


P = "parallelism"


def hsdp_and_resharding(c: Check) -> None:
    """HSDP and ``reshard_after_forward`` as an int: what FSDP2 runs that the model follows."""
    par, rule = c.par, c.scheme
    if rule.optional_tensor and par.tp > 1 and par.dp_replicate > 1 and c.trainer == "commgate":
        c.bad(
            [P, "dp_replicate"], f"{par.dp_replicate}: HSDP with tensor parallelism is not modelled yet (tp={par.tp})"
        )
    k = par.fsdp.reshard_group
    if not rule.fsdp or k is None:
        return
    if par.dp % k:
        c.bad([P, "fsdp", "reshard_after_forward"], f"{k}: an int must divide dp={par.dp} (reshards to groups of it)")
    elif k not in (1, par.dp) and par.tp > 1:
        c.bad(
            [P, "fsdp", "reshard_after_forward"],
            f"{k}: an int with tensor parallelism hangs torch 2.13's first forward (seen here: ranks wait in "
            "different collectives while the post-forward mesh is built); use true or false with tp",
        )


def in_pipeline_stages(c: Check) -> None:
    """FSDP2 inside torch.distributed.pipelining's stages (3-D with tp): GPipe or 1F1B, one stage per rank
    (commgate's own workloads; a trainer's rules say which of its schedules it models)."""
    par, pl = c.par, c.par.pipeline
    if not (c.scheme.optional_pipeline and par.pp > 1):
        return
    if pl.engine != "torch":
        c.bad(
            [P, "pipeline", "engine"], "deepspeed: FSDP2 runs in torch.distributed.pipelining's stages: engine: torch"
        )
    elif pl.schedule not in ("gpipe", "1f1b") and c.trainer == "commgate":  # torchtitan's rules say its own
        c.bad(
            [P, "pipeline", "schedule"],
            f"{pl.schedule}: FSDP2 in pipeline stages is modelled under gpipe and 1f1b (one stage per rank) yet",
        )
    if par.dp_replicate > 1 and c.trainer == "commgate":  # torchtitan's rules say its own
        c.bad([P, "dp_replicate"], f"{par.dp_replicate}: HSDP in pipeline stages is not modelled yet (pp={par.pp})")
    if par.fsdp.reshard_group is not None:
        k = par.fsdp.reshard_group
        c.bad([P, "fsdp", "reshard_after_forward"], f"{k}: an int in pipeline stages is not modelled yet")
    if par.cp > 1:
        c.bad([P, "cp"], f"{par.cp}: context parallelism in pipeline stages is not modelled yet (pp={par.pp})")


RULES: tuple[Rule, ...] = (hsdp_and_resharding, in_pipeline_stages)
