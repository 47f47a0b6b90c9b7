"""``predict(scenario)``: the scheme's components (``commgate.model.schemes``) composed into a
``Prediction`` (``commgate.model.expectation``)."""

from __future__ import annotations

from commgate.model.expectation import Context, ExpectedCollective, PaperTerm, Prediction, Residual
from commgate.model.paper import eq1_param_count
from commgate.model.scenario import Scenario
from commgate.model.schemes import SCHEMES
from commgate.model.trainers import components


def predict(scenario: Scenario) -> Prediction:
    """The per-collective expectation of ``scenario`` and its paper terms."""
    ctx = Context(scenario=scenario)
    rows: list[ExpectedCollective] = []
    terms: list[PaperTerm] = []
    residuals: list[Residual] = []
    for component in components(scenario, SCHEMES[scenario.parallelism.scheme]):
        rows += component.collectives(ctx)
        terms += component.paper_terms(ctx)
        residuals += component.residuals(ctx)
    m = scenario.model
    return Prediction(
        scenario=scenario,
        param_count=ctx.param_count,
        param_count_eq1=eq1_param_count(V=m.V, h=m.h, s=m.s, L=m.L),
        collectives=tuple(rows),
        paper_terms=tuple(terms),
        residuals=tuple(r for r in residuals if r.bytes != 0),
    )
