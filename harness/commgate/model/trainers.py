"""Who builds, parallelizes and steps the job: one ``Trainer`` record each, the second registry beside
``commgate.model.schemes.SCHEMES``. A scenario names its trainer (``trainer:``, default ``commgate``); the
schema's enum, the consistency rules (the schemes a trainer runs, its own rules) and the message naming
the extra to install are derived from ``TRAINERS``. How a trainer's run is started is the run layer's
registry (``commgate.run.workloads.TRAINER_WORKLOADS``), keyed by the trainer's name.

Adding a trainer: its record here (with its rules), its adapter under ``commgate.run``, one line in the
run layer's registry, and its PyPI packages as an extra in ``pyproject.toml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from commgate.model.schemes.scheme import Check, Rule


@dataclass(frozen=True, slots=True, kw_only=True)
class Trainer:
    name: str
    summary: str
    """One line for ``--help`` and the docs."""
    schemes: tuple[str, ...] | None = None
    """The schemes (``SCHEMES`` names) it runs; None: every one."""
    extra: str | None = None
    """``pip install commgate[EXTRA]`` installs it; None: it comes with commgate."""
    packages: tuple[str, ...] = ()
    """The distributions it imports (their versions go into the run's provenance)."""
    rules: tuple[Rule, ...] = ()
    """Its own consistency rules (what its configuration allows), beside the schemes'."""


def _runs_scheme(c: Check, trainer: Trainer) -> None:
    if trainer.schemes is not None and c.par.scheme not in trainer.schemes:
        c.bad(
            ["parallelism", "scheme"],
            f"{c.par.scheme!r}: trainer {trainer.name!r} runs schemes {', '.join(trainer.schemes)}",
        )


TRAINERS: dict[str, Trainer] = {
    t.name: t
    for t in (
        Trainer(
            name="commgate",
            summary="commgate's own workloads: its decoder (or your model.module) under each scheme's framework",
        ),
    )
}


def rules(trainer: Trainer) -> tuple[Rule, ...]:
    """The rules a scenario of ``trainer`` meets beyond the schemes': the schemes it runs, and its own."""
    return (lambda c: _runs_scheme(c, trainer), *trainer.rules)
