"""The trainers commgate knows: one ``Trainer`` record each (``commgate.model.trainers.trainer``), the second
registry beside ``commgate.model.schemes.SCHEMES``. A scenario names its trainer (``trainer:``, default
``commgate``); the schema's enum, the consistency rules (the schemes a trainer runs, whose options block a
scenario may hold, its own rules), the document a trainer completes from its own configuration and the
components that model what it sends are derived from ``TRAINERS``. What runs a trainer's job on a rank is
the run layer's registry (``commgate.run.workloads.TRAINER_WORKLOADS``), keyed by the trainer's name.

Adding a trainer: its model-layer module here (its record's options schema, rules, ``derive`` and
components), its adapter under ``commgate.run.trainers``, one record below, one line in
``TRAINER_WORKLOADS``, and its PyPI packages as an extra in ``pyproject.toml``.
"""

from __future__ import annotations

from commgate.model.scenario import Scenario
from commgate.model.schemes.scheme import Check, Component, Rule, Scheme
from commgate.model.trainers import hf
from commgate.model.trainers.megatron import MEGATRON
from commgate.model.trainers.torchtitan import TORCHTITAN
from commgate.model.trainers.trainer import Trainer

__all__ = ["TRAINERS", "Trainer", "components", "derived", "rules"]

TRAINERS: dict[str, Trainer] = {
    t.name: t
    for t in (
        Trainer(
            name="commgate",
            summary="commgate's own workloads: its decoder (or your model.module) under each scheme's framework",
        ),
        TORCHTITAN,
        Trainer(
            name="hf",
            summary='Hugging Face transformers.Trainer: your config.json and DeepSpeed JSON ("auto" resolved as '
            "Trainer resolves it), under DDP, DeepSpeed ZeRO-1/2/3 or FSDP2 (accelerate's plugin)",
            schemes=(*hf.SCHEME_OF_STAGE.values(), "fsdp"),
            extra="hf",
            packages=("transformers", "accelerate"),
            options=hf.OPTIONS,
            derive=hf.derive,
            components=hf.components,
            model=hf.model,
            accumulates=True,
            derived=hf.derived,
        ),
        MEGATRON,
    )
}


def rules(trainer: Trainer) -> tuple[Rule, ...]:
    """The rules a scenario of ``trainer`` meets beyond the schemes': the schemes it runs, no other trainer's
    options block, and its own."""

    def runs_the_scheme(c: Check) -> None:
        if trainer.schemes is not None and c.par.scheme not in trainer.schemes:
            c.bad(
                ["parallelism", "scheme"],
                f"{c.par.scheme!r}: trainer {trainer.name!r} runs schemes {', '.join(trainer.schemes)}",
            )

    def no_other_block(c: Check) -> None:
        for name, other in TRAINERS.items():
            if other.options is not None and name != trainer.name and name in c.doc:
                c.bad([name], f"options of trainer {name!r}, but the scenario's trainer is {trainer.name!r}")

    return (runs_the_scheme, no_other_block, *trainer.rules)


def components(scenario: Scenario, scheme: Scheme) -> tuple[Component, ...]:
    """What models the collectives of ``scenario``: its trainer's components, or its scheme's."""
    trainer = TRAINERS[scenario.trainer]
    return trainer.components(scenario, scheme) if trainer.components else scheme.components


def derived(scenario: Scenario) -> tuple[str, ...]:
    """What its trainer decided for ``scenario``, one line each (``Trainer.derived``), for every output."""
    trainer = TRAINERS[scenario.trainer]
    return trainer.derived(scenario) if trainer.derived else ()
