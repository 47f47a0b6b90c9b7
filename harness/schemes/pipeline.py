"""Pipeline parallelism (DeepSpeed's pipeline engine): per micro-batch every stage boundary carries
the activations forward and their gradients backward, b*s*h elements each way; with tied embeddings
the first and last stages all-reduce the shared embedding's gradient. Paper: Eq. 4.

Plain model: the engine's tensor-metadata exchange on the first step and its loss broadcast are
refined with the real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from harness.collectives import Op
from harness.expectation import Context, ExpectedCollective, PaperTerm, Phase, Residual
from harness.paper import eq4_pipeline
from harness.schemes._common import micro_batches

TERM = "Eq. 4"


@dataclass(frozen=True, slots=True)
class PipelineParallel:
    def collectives(self, ctx: Context) -> list[ExpectedCollective]:
        m, par, lay = ctx.scenario.model, ctx.scenario.parallelism, ctx.layout
        rows: list[ExpectedCollective] = []
        for k in range(par.pp - 1):
            for phase, src, dst, what in (
                (Phase.FORWARD, k, k + 1, "activation"),
                (Phase.BACKWARD, k + 1, k, "gradient"),
            ):
                for op, pairs in ((Op.SEND, lay.stage_pairs(src, dst)), (Op.RECV, lay.stage_pairs(dst, src))):
                    rows.append(
                        ExpectedCollective(
                            op=op,
                            axis="pp",
                            groups=pairs,
                            dtype=m.dtype,
                            elements=ctx.bsh,
                            calls=par.micro_batches,
                            phase=phase,
                            paper_term=TERM,
                            source=f"PP {what} {op} (stage {src} -> {dst})",
                        )
                    )
        if m.tied_embeddings:
            ends = tuple((g[0], g[-1]) for g in lay.pp_groups())
            rows.append(
                ExpectedCollective(
                    op=Op.ALL_REDUCE,
                    axis="pp",
                    groups=ends,
                    dtype=m.dtype,
                    elements=m.V * m.h // par.tp,
                    calls=1,
                    phase=Phase.BACKWARD,
                    source="PP tied-embedding gradient all-reduce (first <-> last stage)",
                )
            )
        return rows

    def _eq4(self, ctx: Context) -> Fraction:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return eq4_pipeline(b=par.micro_batch, s=m.s, h=m.h, p=par.pp)

    def paper_terms(self, ctx: Context) -> list[PaperTerm]:
        m, par = ctx.scenario.model, ctx.scenario.parallelism
        return [
            PaperTerm(
                equation=TERM,
                formula=f"2*b*s*h*(p-1), b={par.micro_batch}, s={m.s}, h={m.h}, p={par.pp}",
                elements=self._eq4(ctx),
                itemsize=m.itemsize,
                ranks=frozenset(ctx.layout.pp_groups()[0]),
                scope="one pipeline, summed over stages",
            )
        ]

    def residuals(self, ctx: Context) -> list[Residual]:
        mb = ctx.scenario.parallelism.micro_batches
        return [micro_batches(TERM, self._eq4(ctx) * ctx.scenario.model.itemsize, mb)] if mb > 1 else []
