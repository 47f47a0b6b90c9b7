"""What a scenario is expected to send: per-collective rows, the paper's terms, and the named residuals.

``commgate.model.predict.predict(scenario)`` composes the scheme's components (``commgate.model.schemes``) into a
``Prediction``.
Bytes of one row are per participating rank; job-wide figures multiply by the participants.
``Prediction.comparison()`` puts each paper equation next to the model rows it corresponds to and the
named terms that explain the difference; what is left is ``unexplained`` and is 0 by construction
of a correct model (a test checks it over a grid of scenarios).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, fields
from fractions import Fraction
from functools import cached_property
from typing import Any, TypeVar

from commgate.model import dsconfig
from commgate.model.collectives import OPS, Op, add_traffic
from commgate.model.layout import Axis, Group, Layout
from commgate.model.paper import eq1_param_count, llama_param_count
from commgate.model.scenario import Scenario
from commgate.model.transformer import WIRE_ITEMSIZE, Params, ParamTensor, inventory, param_stages, stage_split
from commgate.model.usermodule import Buffer

T = TypeVar("T")


class Phase(enum.Enum):
    INIT = "init"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PIPELINE = "pipeline"
    """Inside a pipeline engine's step, whose schedule interleaves forwards, backwards and the update."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedCollective:
    """One kind of call a training step issues: the same op, groups, size and phase, ``calls`` times."""

    op: Op
    axis: Axis
    groups: tuple[Group, ...]
    """Every process group that issues it; for send/recv, (self, peer) pairs."""
    dtype: str
    elements: int
    """Message size m of one call, in elements (see commgate.model.collectives for which buffer)."""
    calls: int
    """Calls per step on each participating rank (INIT rows: per run)."""
    phase: Phase
    source: str
    """What issues it, in words a framework engineer recognises."""
    paper_term: str | None = None
    """The equation ("Eq. 2" ...) whose volume this row is part of; None if the paper has no such traffic."""
    once: bool = False
    """``calls`` happen once per run, at step ``at_step`` (initialisation when None), not every step."""
    at_step: int | None = None
    from_step: int = 0
    """A per-step row applies from this step on (DDP's rebuilt buckets serve from the second iteration)."""
    overlaps: bool = False
    """The framework issues these calls without waiting on them, so they can run behind the compute
    that follows in their phase (DDP's buckets, FSDP2's prefetched all-gathers and reduce-scatters, the
    ring rotations of context parallelism): the time model's exposed communication leaves them out
    while that compute lasts (``commgate.report.timemodel``)."""

    @property
    def when(self) -> str:
        """When the row's calls happen, in words: ``init``, ``step 1``, ``every step``, ``steps >= 1``."""
        if self.once:
            return "init" if self.at_step is None else f"step {self.at_step}"
        return "every step" if self.from_step == 0 else f"steps >= {self.from_step}"

    def calls_in(self, steps: range | None) -> int:
        """Calls on one participating rank within ``steps`` (None: the initialisation window)."""
        if self.once:
            hit = self.at_step is None if steps is None else (self.at_step is not None and self.at_step in steps)
            return self.calls if hit else 0
        if steps is None:
            return 0
        return self.calls * sum(1 for k in steps if k >= self.from_step)

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def sized(self, elements: int) -> ExpectedCollective:
        """This row with message size ``elements``: ``replace(self, elements=elements)`` without its
        per-call look-up of the fields (a 13B model's per-parameter rows number a thousand)."""
        new = object.__new__(ExpectedCollective)
        for name in _ROW_FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "elements", elements)
        return new

    def sized_each(self, sizes: Iterable[int]) -> list[ExpectedCollective]:
        """``[self.sized(n) for n in sizes]``, one row made per distinct size: a row is frozen, so a repeated
        size repeats the same row (a 13B model's thousand per-parameter rows have a dozen sizes)."""
        made: dict[int, ExpectedCollective] = {}
        return [made.get(n) or made.setdefault(n, self.sized(n)) for n in sizes]

    @property
    def bytes_per_call(self) -> int:
        return math.ceil(self.elements * WIRE_ITEMSIZE[self.dtype])

    @property
    def bytes_per_step(self) -> int:
        """Message bytes per step on one participating rank."""
        return self.bytes_per_call * self.calls

    @property
    def bus_factor(self) -> Fraction:
        return OPS[self.op].bus(self.group_size)

    @property
    def wire_bytes_per_step(self) -> Fraction:
        return self.bytes_per_step * self.bus_factor

    @property
    def paper_bytes_per_step(self) -> Fraction:
        """Volume per rank per step by the paper's definition of the op."""
        return self.bytes_per_step * OPS[self.op].paper(self.group_size)

    def issued_by(self, rank: int) -> bool:
        """Whether ``rank`` issues this row (``rank in participants()``, without building the set)."""
        if OPS[self.op].p2p:
            return any(g[0] == rank for g in self.groups)
        return any(rank in g for g in self.groups)

    def participants(self) -> frozenset[int]:
        """Ranks that issue this row (for send/recv, the rank that calls send or recv)."""
        if OPS[self.op].p2p:
            return frozenset(next(zip(*self.groups, strict=False)))
        return frozenset().union(*self.groups)

    @property
    def participant_count(self) -> int:
        return len(self.groups) if OPS[self.op].p2p else len(self.groups) * self.group_size


_ROW_FIELDS = tuple(f.name for f in fields(ExpectedCollective))


@dataclass(frozen=True, slots=True, kw_only=True)
class PaperTerm:
    equation: str
    formula: str
    """The equation with the scenario's numbers substituted."""
    elements: Fraction
    itemsize: int
    ranks: frozenset[int]
    """Whose volume the equation gives: one rank (Eqs. 2, 3, 5), or every stage of one pipeline (Eq. 4)."""
    scope: str

    @property
    def bytes(self) -> Fraction:
        return self.elements * self.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Residual:
    """A named reason why the model differs from a paper equation, with its size in bytes per step."""

    term: str
    name: str
    bytes: Fraction
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TermComparison:
    term: PaperTerm
    model_bytes: Fraction
    residuals: tuple[Residual, ...]

    @property
    def unexplained_bytes(self) -> Fraction:
        return self.model_bytes - self.term.bytes - sum((r.bytes for r in self.residuals), Fraction(0))


@dataclass(frozen=True, kw_only=True)  # no slots: cached_property needs a __dict__
class Context:
    """Everything a scheme component needs to know about a scenario, computed once."""

    scenario: Scenario

    def once(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed once per context and ``key``: what a component's collectives and its
        residuals both read (the same rows, padded, with and without the once-per-run ones)."""
        memo: dict[Hashable, Any] = self.__dict__.setdefault("_once", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]  # type: ignore[no-any-return]

    @cached_property
    def layout(self) -> Layout:
        par = self.scenario.parallelism
        return Layout(
            dp=par.data_ranks, tp=par.tp, pp=par.pp, ep=par.ep, hpz=par.zero.hpz, replicate=par.dp_replicate, cp=par.cp
        )

    @cached_property
    def params(self) -> tuple[ParamTensor, ...]:
        if self.scenario.model.module:
            from commgate.model.usermodule import describe

            return Params(describe(self.scenario).params)
        moe = self.scenario.parallelism.moe
        return inventory(self.scenario.model, experts=moe.experts if moe else 0, moe_every=moe.every if moe else 1)

    @cached_property
    def trainable(self) -> tuple[ParamTensor, ...]:
        """The parameters with gradients (all but a user's module's frozen ones), in registration order."""
        return tuple(p for p in self.params if not p.frozen)

    @cached_property
    def trainable_count(self) -> int:
        return sum(p.numel for p in self.trainable)

    @cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """A user's module's buffers (the built-in models have none)."""
        if self.scenario.model.module:
            from commgate.model.usermodule import describe

            return describe(self.scenario).buffers
        return ()

    @cached_property
    def ready_order(self) -> tuple[ParamTensor, ...]:
        """The parameters in the order their gradients become ready in the backward: the built-in
        decoder's in reverse registration order, a user's module's as autograd produced them on the meta
        device (``commgate.model.usermodule``)."""
        if self.scenario.model.module:
            from commgate.model.usermodule import describe

            by_name = {p.name: p for p in self.params}
            return tuple(by_name[n] for n in describe(self.scenario).ready)
        return tuple(reversed(self.trainable))

    @cached_property
    def optimizer(self) -> str | None:
        """The optimizer wrapper DeepSpeed's engine runs (``dsconfig.optimizer``): ``"ZeRO"``,
        ``"BF16_Optimizer"``, ``"FP16_Optimizer"`` or None."""
        s = self.scenario
        return dsconfig.optimizer(
            s.deepspeed_config, s.model.dtype, s.parallelism.zero.stage, pipeline=s.parallelism.pp > 1
        )

    @cached_property
    def _stage_split(self) -> tuple[tuple[int, int], ...]:
        par = self.scenario.parallelism
        return stage_split(self.params, L=self.scenario.model.L, tp=par.tp, pp=par.pp)

    def stage_params(self, stage: int) -> tuple[ParamTensor, ...]:
        """The parameter tensors pipeline ``stage`` holds, in registration order."""
        m, pp = self.scenario.model, self.scenario.parallelism.pp
        return tuple(p for p in self.params if stage in param_stages(p, L=m.L, pp=pp, tied=m.tied_embeddings))

    def rank_params(self, stage: int, *, expert: bool | None = None) -> int:
        """Parameters a rank of pipeline ``stage`` holds (tensor-parallel shard; experts: its own share).

        ``expert`` None counts all parameters, False the non-expert ones, True the rank's experts.
        """
        dense, experts = self._stage_split[stage]
        ep = self.scenario.parallelism.ep
        return {None: dense + experts // ep, False: dense, True: experts // ep}[expert]

    @cached_property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def expert_param_count(self) -> int:
        return sum(p.numel for p in self.params if p.expert)

    @cached_property
    def eq1(self) -> int:
        """Eq. 1 with the scenario's switches (tied embeddings, positions, MLP width), or for a Llama-style
        model its counterpart (``eq1_name``)."""
        m = self.scenario.model
        if m.module:
            return self.param_count
        if m.llama:
            return llama_param_count(
                V=m.V, h=m.h, L=m.L, a=m.a, kv_heads=m.kv, ffn=m.ffn, tied_embeddings=m.tied_embeddings
            )
        return eq1_param_count(
            V=m.V, h=m.h, s=m.s, L=m.L, tied_embeddings=m.tied_embeddings, position=m.position, ffn=m.ffn
        )

    @property
    def eq1_name(self) -> str:
        m = self.scenario.model
        return "the module's parameter count" if m.module else "Llama counterpart of Eq. 1" if m.llama else "Eq. 1"

    @property
    def seq(self) -> int:
        """The sequence length a rank computes: s, or its context-parallel part s/cp."""
        return self.scenario.model.s // self.scenario.parallelism.cp

    @property
    def bsh(self) -> int:
        m, par = self.scenario.model, self.scenario.parallelism
        return par.micro_batch * self.seq * m.h


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    scenario: Scenario
    param_count: int
    """Parameters of the model as built."""
    param_count_eq1: int
    """Eq. 1 taken literally (untied embeddings, learned positions, x = 4)."""
    collectives: tuple[ExpectedCollective, ...]
    paper_terms: tuple[PaperTerm, ...]
    residuals: tuple[Residual, ...]

    @property
    def steady(self) -> tuple[ExpectedCollective, ...]:
        """Rows issued every step (not once per run)."""
        return tuple(c for c in self.collectives if not c.once)

    @property
    def paper_volume_elements(self) -> Fraction:
        return sum((t.elements for t in self.paper_terms), Fraction(0))

    def comparison(self) -> tuple[TermComparison, ...]:
        out = []
        for term in self.paper_terms:
            # message bytes per (op, group size), summed as integers, weighted by the paper's factor once
            counted: Counter[tuple[Op, int]] = Counter()
            for c in self.steady:
                if c.paper_term == term.equation:
                    counted[c.op, c.group_size] += c.bytes_per_step * sum(1 for r in term.ranks if c.issued_by(r))
            model = sum((OPS[op].paper(n) * b for (op, n), b in counted.items()), Fraction(0))
            residuals = tuple(r for r in self.residuals if r.term == term.equation)
            out.append(TermComparison(term=term, model_bytes=model, residuals=residuals))
        return tuple(out)

    def not_in_paper(self, rank: int = 0) -> tuple[tuple[str, int], ...]:
        """(source, bytes per step on ``rank``) of the steady rows no paper equation covers."""
        return tuple((c.source, c.bytes_per_step) for c in self.steady if c.paper_term is None and c.issued_by(rank))

    def job_bytes_per_step(self) -> int:
        return sum(c.bytes_per_step * c.participant_count for c in self.steady)

    def job_wire_bytes_per_step(self) -> Fraction:
        """Bytes crossing links per step, whole job: what the traffic matrix sums to."""
        return sum(
            (c.wire_bytes_per_step * len(c.groups) * OPS[c.op].senders(c.group_size) for c in self.steady if c.calls),
            Fraction(0),
        )

    def message_sizes(self) -> dict[int, int]:
        """Histogram of message sizes: bytes per call -> calls per step over the whole job."""
        hist: Counter[int] = Counter()
        for c in self.steady:
            hist[c.bytes_per_call] += c.calls * c.participant_count
        return dict(sorted(hist.items()))

    def traffic_matrix(self) -> dict[tuple[int, int], Fraction]:
        """Bytes per step rank -> rank (sparse), by the traffic model of ``commgate.model.collectives``."""
        wire: dict[tuple[Op, tuple[int, ...]], Fraction] = {}  # each traffic pattern is linear in the bytes:
        for c in self.steady:  # the rows of one op and group summed first (ZeRO-3's thousand, over one group)
            if c.wire_bytes_per_step:
                for g in c.groups:
                    wire[(c.op, g)] = wire.get((c.op, g), Fraction(0)) + c.wire_bytes_per_step
        out: dict[tuple[int, int], Fraction] = {}
        for (op, g), nbytes in wire.items():
            add_traffic(op, g, nbytes, out)
        return out
