"""What a trainer is: who builds, parallelizes and steps the job (commgate's own workloads, torchtitan,
Hugging Face's Trainer, Megatron-core), the record everything else derives from, beside the scheme's
(``commgate.model.schemes.scheme``). The registry, ``TRAINERS``, is ``commgate.model.trainers``; what runs
a trainer's job on a rank is the run layer's (``commgate.run.workloads.TRAINER_WORKLOADS``).

A trainer may take options in a block of the scenario named after it (``torchtitan: {...}``, as
``deepspeed:`` holds DeepSpeed's), complete the scenario document from its own configuration before it is
validated (``derive``: Hugging Face's "auto" values resolved as Trainer resolves them), and model what
it sends with components of its own (``components``: torchtitan's FSDP2 groups are not commgate's).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from commgate.core.errors import CommgateError, first_line
from commgate.model.scenario import ModelBuilder, Scenario
from commgate.model.schemes.scheme import Component, Rule, Scheme

Derive = Callable[[Mapping[str, Any], str], dict[str, Any]]
"""(the scenario document, its file) -> the document completed from the trainer's own configuration
(model, parallelism, deepspeed); raises ``CommgateError`` (one line) on what it cannot read."""
Components = Callable[[Scenario, Scheme], tuple[Component, ...]]
"""(the scenario, its scheme) -> the components whose collectives model what the trainer sends."""
Warnings = Callable[[Mapping[str, Any]], tuple[str, ...]]
"""What a scenario of the trainer warns of, from its document as written (its trainer block, parallelism ...)."""
"""(the trainer's options block) -> what a run of it leaves out or changes, one line each."""
Derived = Callable[[Scenario], tuple[str, ...]]
"""(the scenario) -> what the trainer decided for it, one line each (a resolved "auto" and what resolved it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Trainer:
    name: str
    summary: str
    """One line for ``--help`` and the docs."""
    schemes: tuple[str, ...] | None = None
    """The schemes (``SCHEMES`` names) it runs; None: every one."""
    extra: str | None = None
    """``pip install 'commgate[EXTRA]'`` installs it; None: it comes with commgate."""
    packages: tuple[str, ...] = ()
    """The modules it imports (to run, and to ``derive``): all must be importable."""
    options: Mapping[str, Any] | None = None
    """The JSON Schema of its options, the scenario's top-level block named after it (None: it takes none);
    the scenario schema holds it as that property."""
    derive: Derive | None = None
    components: Components | None = None
    """None: the scheme's own components model it (commgate's workloads are the schemes')."""
    rules: tuple[Rule, ...] = ()
    """Its own consistency rules, beside the schemes'."""
    warnings: Warnings | None = None
    """What its options leave out of a run (the scenario's warnings: every prediction and run names them)."""
    model: ModelBuilder | None = None
    """Builds the job's model from the scenario (``commgate.model.usermodule``'s hook contract: on torch's
    current device, with a function from a seed to one micro-batch's inputs), where the trainer's own
    configuration names the model (a Hugging Face ``config.json``): the scenario's ``model.module`` then
    names the model for people, and the model is read off this build on the meta device, as a user's
    module is."""
    splits_stages: bool = False
    """It splits the model into pipeline stages itself (its components read that split): commgate's own
    rule that the layers divide evenly over the stages does not apply."""
    accumulates: bool = False
    """It counts a step's micro-batches itself and sets DeepSpeed's gradient-accumulation boundary on each
    backward (transformers' Trainer, through accelerate's ``DeepSpeedEngineWrapper.backward``): the DeepSpeed
    config's ``gradient_accumulation_steps`` then sets only DeepSpeed's batch check, not
    ``parallelism.micro_batches``."""
    derived: Derived | None = None
    """What it decided for the scenario, shown with the prediction and the result (nothing it resolves is
    silent); None: nothing beyond the document as written."""

    def unavailable(self) -> str | None:
        """Why this environment cannot run it (in one line, naming the extra that installs what is missing: a
        package absent, a dotted one whose parent is absent too, or one installed broken, whose import raises),
        or None."""
        found = {p: _importable(p) for p in self.packages}
        if not (missing := [p for p, able in found.items() if able is not True]):
            return None
        how = f"pip install 'commgate[{self.extra}]'" if self.extra else f"pip install {' '.join(missing)}"
        broken = [why for why in found.values() if isinstance(why, str)]
        said = f" ({'; '.join(broken)}: installed broken? reinstall it)" if broken else ""
        return f"trainer {self.name!r} needs {', '.join(missing)}, which this environment cannot import{said}: {how}"

    def broken(self, exc: ImportError) -> CommgateError:
        """A package it needs raised ``exc`` as it was imported (installed, but broken: a version clash), in
        one line naming the trainer, the error and the extra to reinstall."""
        how = f"pip install --force-reinstall 'commgate[{self.extra}]'" if self.extra else "reinstall it"
        return CommgateError(
            f"trainer {self.name!r}: importing {exc.name or 'a package it needs'} raised {type(exc).__name__}: "
            f"{first_line(exc)} (installed broken? a version clash): {how}"
        )

    def require(self) -> None:
        """Raise ``unavailable()`` as a one-line ``CommgateError``."""
        if why := self.unavailable():
            raise CommgateError(why)


def _importable(name: str) -> bool | str:
    """Whether ``name`` can be imported; ``find_spec`` of ``a.b`` imports ``a`` and raises where it is absent,
    or where ``a`` is installed broken (its import raises: what it raised, in one line)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    except Exception as exc:  # the parent package's own import failed
        return f"importing {name.rsplit('.', 1)[0]} raised {type(exc).__name__}: {first_line(exc)}"
