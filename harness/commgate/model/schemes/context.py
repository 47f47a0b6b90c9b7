"""Context parallelism as torch 2.13 runs it (read from
``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` and measured): each sequence is
split over the cp ranks of a context-parallel group, and every attention is torch's ring attention.

* Forward, per layer and micro-batch (``_templated_ring_attention``): the rank's K and V shards are
  flattened into one buffer of ``2 * b * (s/c) * kv_dim`` elements (kv_dim = key/value heads x head
  size, per tensor-parallel rank), in the activations' dtype. With ``cp_rotate: allgather`` (torch's
  default, ``_AllGatherRotater``) one all-gather collects every rank's buffer; with ``alltoall``
  (``_AllToAllRotater``) c-1 rotations pass it on, each an all-to-all whose one non-empty split goes to
  the next rank (``permute_tensor``).
* Backward, per layer and micro-batch (``_templated_ring_attention_backward``): the K/V buffer again
  (one all-gather, or c-1 rotations), and the gradients dK, dV rotated c times with the all-to-all
  rotater whatever ``cp_rotate`` says, accumulated in fp32 (``convert_to_f32``): the last rotation hands
  each rank the sums for its own shard.
* Activation checkpointing re-runs each layer's forward in its backward, attention included (the
  recomputation stops only after the MLP's input is saved again): one more forward ring per layer.
* The inputs, labels and positions are split by torch's head-tail load balancer (no communication);
  the loss is each rank's mean over its tokens; the gradients are all-reduced by DDP over dp x cp ranks
  (``commgate.model.schemes.ddp``), or reduce-scattered by FSDP2 sharding over them
  (``commgate.model.schemes.fsdp``, scheme fsdp), since every context-parallel rank holds a partial gradient.

Counterpart of the paper's equations (commgate's derivation; Anthony et al. stop before context
parallelism): per layer and micro-batch each rank receives the other c-1 ranks' K and V in the forward
and again in the backward, and the ring carries dK and dV c-1 hops, so with kv_dim the key/value width::

    V_cp = 6 * L * b * s * kv_dim * (c-1)/c      elements per rank per micro-batch

(an all-gather of the gathered buffer m moves m(c-1)/c in the paper's convention, so the ``allgather``
rotation is this term exactly.) The named terms: the ``alltoall`` rotation counted by the paper's
all-to-all convention, dK/dV in fp32, recomputation, micro-batches, lower-precision activations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from commgate.model.collectives import Op
from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from commgate.model.schemes._common import micro_batches, rank0_term
from commgate.model.schemes.scheme import Check, Rule
from commgate.model.schemes.tensor import activation_dtype
from commgate.model.transformer import WIRE_ITEMSIZE

TERM = "CP ring"
ACCUMULATE = "fp32"
"""torch's ``_cp_options.convert_to_f32``: the ring accumulates (and rotates) dK, dV in fp32."""


def kv_dim(ctx: Context) -> int:
    """Key/value width per tensor-parallel rank: key/value heads x head size / t."""
    m, par = ctx.scenario.model, ctx.scenario.parallelism
    return m.kv * (m.h // m.a) // par.tp


def kv_buffer(ctx: Context) -> int:
    """Elements of one rank's K/V buffer: ``2 * b * (s/c) * kv_dim``."""
    return 2 * ctx.scenario.parallelism.micro_batch * ctx.seq * kv_dim(ctx)


@dataclass(frozen=True, slots=True)
class ContextParallel:
    @property
    def rules(self) -> tuple[Rule, ...]:
        """The consistency rules of the feature this component models (``RULES`` below)."""
        return RULES

    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        par, L = ctx.scenario.parallelism, ctx.scenario.model.L
        c, mb = par.cp, par.micro_batches
        if c == 1:
            return []
        buf = kv_buffer(ctx)
        ring = ExpectedCollective(
            op=Op.ALL_GATHER,
            axis="cp",
            groups=ctx.layout.cp_groups(),
            dtype=activation_dtype(ctx),
            elements=c * buf,
            calls=L * mb,
            phase=Phase.FORWARD,
            source="",
            paper_term=TERM,
        )
        if par.cp_rotate == "alltoall":
            # each rotation is issued before the chunk's attention and waited after it
            ring = replace(ring, op=Op.ALL_TO_ALL, elements=buf, calls=(c - 1) * L * mb, overlaps=True)
        how = "all-gather" if par.cp_rotate == "allgather" else "rotation (all-to-all to the next rank)"
        rows = [
            replace(ring, source=f"CP ring attention: K/V {how}, forward"),
            replace(ring, phase=Phase.BACKWARD, source=f"CP ring attention: K/V {how}, backward"),
            replace(
                ring,
                op=Op.ALL_TO_ALL,
                dtype=ACCUMULATE,
                elements=buf,
                calls=c * L * mb,
                phase=Phase.BACKWARD,
                source="CP ring attention: dK/dV rotation (all-to-all to the next rank, fp32)",
                overlaps=True,
            ),
        ]
        if par.activation_checkpointing:
            rows.append(replace(ring, phase=Phase.BACKWARD, source=f"CP ring attention: K/V {how}, recomputed forward"))
        return rows

    def _eq(self, ctx: Context) -> Fraction:
        """V_cp for one micro-batch, in elements."""
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        return 6 * m.L * par.micro_batch * m.s * kv_dim(ctx) * Fraction(par.cp - 1, par.cp)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        par, m = ctx.scenario.parallelism, ctx.scenario.model
        if par.cp == 1:
            return []
        kv = f"kv_dim={kv_dim(ctx)} (kv heads {m.kv} x h/a {m.h // m.a}" + (f" / t={par.tp})" if par.tp > 1 else ")")
        return [
            rank0_term(
                ctx,
                equation=TERM,
                formula=f"6*L*b*s*kv_dim*(c-1)/c, L={m.L}, b={par.micro_batch}, s={m.s}, {kv}, c={par.cp}",
                elements=self._eq(ctx),
            )
        ]

    def residuals(self, ctx: Context) -> list[Residual]:
        par, model = ctx.scenario.parallelism, ctx.scenario.model
        c, L, mb, isz = par.cp, model.L, par.micro_batches, model.itemsize
        if c == 1:
            return []
        buf, share = kv_buffer(ctx), Fraction(par.cp - 1, par.cp)
        block = c * buf * share  # one K/V pass as derived: the c-1 blocks a rank receives
        # one K/V pass as sent, by the paper's convention for its op
        sent = block if par.cp_rotate == "allgather" else (c - 1) * buf * share
        passes = 2 + par.activation_checkpointing
        out = []
        if sent != block:
            out.append(
                Residual(
                    term=TERM,
                    name="K/V rotations by the all-to-all convention",
                    bytes=2 * L * (sent - block) * isz,
                    detail=f"c-1={c - 1} all-to-all rotations of the K/V buffer count (c-1)^2/c of it by the "
                    "paper's all-to-all volume m(c-1)/c (each sends its m whole to the next rank); the "
                    "derivation counts the c-1 blocks each rank receives",
                )
            )
        if par.activation_checkpointing:
            out.append(
                Residual(
                    term=TERM,
                    name="recomputed forward",
                    bytes=L * sent * isz,
                    detail="activation checkpointing re-runs each layer's ring attention forward in its backward",
                )
            )
        if mb > 1:
            out.append(micro_batches(TERM, L * (passes * sent + block) * isz, mb))
        act = activation_dtype(ctx)
        if WIRE_ITEMSIZE[act] != isz:
            out.append(
                Residual(
                    term=TERM,
                    name="activations in a lower precision",
                    bytes=mb * L * passes * sent * (WIRE_ITEMSIZE[act] - isz),
                    detail=f"K and V move in {act}; the derivation counts {model.dtype}",
                )
            )
        if WIRE_ITEMSIZE[ACCUMULATE] != isz:
            out.append(
                Residual(
                    term=TERM,
                    name="dK/dV in fp32",
                    bytes=mb * L * block * (WIRE_ITEMSIZE[ACCUMULATE] - isz),
                    detail="torch's ring accumulates and rotates the K/V gradients in fp32 (convert_to_f32); "
                    f"the derivation counts {model.dtype}",
                )
            )
        return out


P = "parallelism"


def ring(c: Check) -> None:
    """What the ring splits evenly (the sequence over cp ranks) and what does not run with it yet."""
    par, rule, m = c.par, c.scheme, c.model
    if "cp_rotate" in c.declared and par.cp < 2:
        able = c.names(lambda r: r.context or r.optional_context)
        c.bad([P, "cp_rotate"], f"{par.cp_rotate}: rotates K/V between context-parallel ranks; needs scheme {able}")
    if par.cp < 2 or not (rule.context or rule.optional_context):
        return
    if m.module is None and m.s % par.cp:  # (a user's module is refused under scheme cp with the others)
        c.bad([P, "cp"], f"{par.cp}: sequence length s={m.s} is not divisible by cp")
    if par.sequence_parallel and c.trainer == "commgate":  # a trainer's own rules say what it models
        c.bad([P, "sequence_parallel"], "true: sequence parallelism with context parallelism is not modelled yet")
    if par.dp_replicate > 1 and rule.fsdp:
        c.bad([P, "dp_replicate"], f"{par.dp_replicate}: HSDP with context parallelism is not modelled yet")
    if par.fsdp.reshard_group not in (None, 1, par.data_ranks):
        c.bad(
            [P, "fsdp", "reshard_after_forward"],
            f"{par.fsdp.reshard_group}: an int with context parallelism is not modelled yet; use true or false",
        )


RULES: tuple[Rule, ...] = (ring,)
