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


def tiny(scenario: Any) -> tuple[Any, Any]:
    """The planted trainer's model, built by its record (``Trainer.model``), named by no import string."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    return Tiny(), lambda seed: (torch.ones(scenario.parallelism.micro_batch, 4),)


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
    TRAINERS["builds"] = Trainer(
        name="builds", summary="builds its model", model=tiny, derived=lambda s: (f"b={s.parallelism.micro_batch}",)
    )
    loader.schema.cache_clear()
    loader._validator.cache_clear()
    try:
        yield
    finally:
        del TRAINERS["planted"], TRAINERS["absent"], TRAINERS["builds"]
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


@pytest.mark.usefixtures("planted")
def test_a_trainer_builds_its_model_and_shows_what_it_decided() -> None:
    """A trainer whose record builds the model (``Trainer.model``): the scenario's ``model.module`` names it for
    people (here nothing importable), the model is read off the record's build on the meta device, and what
    the trainer decided (``Trainer.derived``) is in the prediction's text and document."""
    from commgate.report.render import prediction_document, prediction_text

    (s,) = load_text(
        BASE + "trainer: builds\nmodel: {module: 'nowhere.at_all:tiny'}\nparallelism: {scheme: ddp, dp: 2}\n"
    )
    p = predict(s)
    assert p.param_count == 4 * 2 + 2
    assert "nowhere.at_all:tiny (built by trainer builds, read on the meta device)" in prediction_text(p)
    assert "  builds: b=1" in prediction_text(p).splitlines()
    assert prediction_document(p)["trainer"]["derived"] == ["b=1"]
    with pytest.raises(ScenarioError, match="cannot be imported"):  # trainer commgate imports what it names
        load_text(BASE + "model: {module: 'nowhere.at_all:tiny'}\nparallelism: {scheme: ddp, dp: 2}\n")


@pytest.mark.usefixtures("planted")
def test_a_trainer_installed_broken_is_one_line_naming_what_its_import_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package found but whose import raises (a version clash: transformers against its huggingface_hub):
    a parent package's ``find_spec`` raised it from the registry's check, and a trainer's own import of it
    in ``derive`` came out as a traceback (found by an adversarial pass). Both are one line naming it."""
    pkg = tmp_path / "broken_pkg_x"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('broken_pkg_x: a version clash')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cracked = Trainer(name="cracked", summary="installed broken", extra="cracked", packages=("broken_pkg_x.core",))
    assert cracked.unavailable() == (
        "trainer 'cracked' needs broken_pkg_x.core, which this environment cannot import (importing broken_pkg_x "
        "raised ImportError: broken_pkg_x: a version clash: installed broken? reinstall it): "
        "pip install 'commgate[cracked]'"
    )

    def derive(doc: Mapping[str, Any], file: str) -> dict[str, Any]:
        import broken_pkg_x  # noqa: F401

        raise AssertionError("imported")

    monkeypatch.setitem(TRAINERS, "planted", replace(TRAINERS["planted"], derive=derive))
    with pytest.raises(ScenarioError) as info:
        load_text(BASE + "trainer: planted\nplanted: {ranks: 3}\n")
    assert str(info.value) == (
        "<string>:4: $.planted: trainer 'planted': importing a package it needs raised ImportError: broken_pkg_x: a "
        "version clash (installed broken? a version clash): reinstall it"
    )


def test_a_run_whose_trainer_is_installed_broken_is_one_line(tmp_path: Path) -> None:
    """torchtitan found on the path but raising as it is imported, in the ranks: one line naming the trainer and
    what its import raised, and the extra to reinstall; it was the rank's traceback (an adversarial pass)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchtitan", reason="trainer torchtitan needs torchtitan: pip install 'commgate[torchtitan]'")
    shim = tmp_path / "shim" / "torchtitan"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('torchtitan: broken install')\n")
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "torchtitan-fsdp.yaml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "commgate", "run", "--report-dir", str(tmp_path / "out"), str(scenario)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "raised CommgateError: trainer 'torchtitan': importing a package it needs raised ImportError: torchtitan: "
        "broken install (installed broken? a version clash): pip install --force-reinstall 'commgate[torchtitan]'"
    ) in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr
