"""A trainer is a record (``commgate.model.trainers.TRAINERS``), and a planted one shows what the record
drives: the schema's ``trainer`` enum and the trainer's options block, the document it completes from its
own configuration (``derive``) before validation, the components that model what it sends, the refusal of
another trainer's block and of schemes it does not run, and, where its packages are missing, a warning at
load and an error (never a pass or a skip) naming the extra that installs them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from commgate.core.errors import ScenarioError
from commgate.model import loader
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.schemes import SCHEMES
from commgate.model.trainers import TRAINERS, Trainer
from commgate.pipeline import Options, run_scenario
from commgate.run.workloads import TRAINER_WORKLOADS

BASE = "schema_version: 1\nname: t\n"
PLAIN = BASE + "model: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"


def derive(doc: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The planted trainer's job: its block names the data-parallel degree; what the document states stays."""
    out = dict(doc)
    out.setdefault("model", {"preset": "19M-cpu"})
    out.setdefault("parallelism", {"scheme": "ddp", "dp": doc["planted"]["ranks"]})
    return out


@pytest.fixture
def planted() -> Iterator[None]:
    """Two trainers planted in the registry: one with options, derive and its own components (the
    scheme's DDP component twice), one whose package cannot be imported."""
    ddp = SCHEMES["ddp"].components[0]
    TRAINERS["planted"] = Trainer(
        name="planted",
        summary="a planted trainer",
        schemes=("ddp",),
        options={"type": "object", "additionalProperties": False, "properties": {"ranks": {"type": "integer"}}},
        derive=derive,
        components=lambda scenario, scheme: (ddp, ddp),
    )
    TRAINERS["absent"] = Trainer(name="absent", summary="not installed", extra="absent", packages=("no_such_pkg_x",))
    loader.schema.cache_clear()
    loader._validator.cache_clear()
    try:
        yield
    finally:
        del TRAINERS["planted"], TRAINERS["absent"]
        loader.schema.cache_clear()
        loader._validator.cache_clear()


def test_the_default_trainer_is_commgates_own_and_an_unknown_one_is_named() -> None:
    (s,) = load_text(PLAIN)
    assert (s.trainer, s.trainer_config) == ("commgate", {})
    with pytest.raises(ScenarioError, match=r"\$.trainer: \"nope\" is not one of: commgate"):
        load_text(PLAIN + "trainer: nope\n")


def test_every_trainer_has_its_entry_in_the_run_layer() -> None:
    assert set(TRAINER_WORKLOADS) == set(TRAINERS)


@pytest.mark.usefixtures("planted")
def test_a_trainer_completes_the_document_and_models_what_it_sends() -> None:
    (s,) = load_text(BASE + "trainer: planted\nplanted: {ranks: 3}\n")
    assert (s.trainer, s.trainer_config, s.world_size) == ("planted", {"ranks": 3}, 3)
    own = [replace(c, source="") for c in predict(replace(s, trainer="commgate")).collectives]
    assert [replace(c, source="") for c in predict(s).collectives] == own + own  # its components, not the scheme's
    with pytest.raises(ScenarioError, match=r"planted.ranks: \"3\" is a string, expected integer"):
        load_text(BASE + "trainer: planted\nplanted: {ranks: '3'}\n")


@pytest.mark.usefixtures("planted")
def test_another_trainers_block_and_a_scheme_it_does_not_run_are_refused() -> None:
    with pytest.raises(ScenarioError, match=r"\$.planted: options of trainer 'planted', but the scenario's trainer"):
        load_text(PLAIN + "planted: {ranks: 2}\n")
    doc = BASE + "trainer: planted\nplanted: {ranks: 2}\n"
    with pytest.raises(ScenarioError, match=r"'zero1': trainer 'planted' runs schemes ddp"):
        load_text(doc.replace("planted: {ranks: 2}", "planted: {ranks: 2}\nparallelism: {scheme: zero1, dp: 2}"))


@pytest.mark.usefixtures("planted")
def test_a_trainer_that_is_not_installed_is_a_warning_then_an_error_naming_the_extra(tmp_path: Path) -> None:
    class Never:
        def skip_reason(self, scenario: object) -> None:
            return None

        def run(self, scenario: object) -> None:
            raise AssertionError("a scenario whose trainer is not installed must not run")

    (s,) = load_text(PLAIN + "trainer: absent\n")
    assert any("pip install 'commgate[absent]'" in w for w in s.warnings)
    result = run_scenario(s, Never(), Options(baseline_dir=tmp_path))  # type: ignore[arg-type]
    assert result is not None and result.status == "error"
    assert result.reason == (
        "trainer 'absent' needs no_such_pkg_x, which this environment cannot import: pip install 'commgate[absent]'"
    )
