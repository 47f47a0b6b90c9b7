"""The baseline store: one layout for baselines, obtained files and bandwidth curves; obtained files are never
read as baselines (``commgate compare`` of a baseline directory, the unused-baselines listing)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from commgate.cli import main
from commgate.judge import baseline as bl
from commgate.judge.store import BaselineStore

DATA = Path(__file__).parent / "data" / "baselines"


def test_the_layout(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    assert store.path("gloo", "tp[s=128]") == tmp_path / "gloo" / "tp[s=128].json"
    assert store.path("gloo", "a/b c") == tmp_path / "gloo" / "a_b_c.json"
    assert store.obtained_path("gloo", "tp[s=128]") == tmp_path / "gloo" / "tp[s=128].obtained.json"
    assert store.curve_path("gloo") == tmp_path / "bandwidth-gloo.json"


def test_a_scenario_id_too_long_for_a_file_name_is_shortened_by_its_hash(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    long_id = "s" * 250 + "[model.s=128]"  # a sweep id: valid, longer than a file name may be (265 characters)
    other = "s" * 250 + "[model.s=256]"
    names = {store.obtained_path("gloo", i).name for i in (long_id, other)} | {store.path("gloo", long_id).name}
    assert len(names) == 3 and max(len(n) for n in names) <= 255
    saved = store.save(dataclasses.replace(bl.load(DATA / "ddp.json"), scenario=long_id))
    assert store.load("gloo", long_id) is not None and saved.name.endswith(".json")


def test_save_load_and_the_obtained_file(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    b = bl.load(DATA / "ddp.json")
    assert store.load("gloo", b.scenario) is None
    path = store.save(b)
    assert path == store.path("gloo", b.scenario) and store.load("gloo", b.scenario) == b
    obtained = store.save_obtained(bl.load(DATA / "ddp-split-bucket.json"))
    assert obtained == store.obtained_path("gloo", b.scenario)
    assert store.load("gloo", b.scenario) == b  # the baseline stays what it was
    assert store.query() == [path]
    assert store.unused(set()) == [path] and store.unused({str(path.resolve())}) == []
    store.discard_obtained("gloo", b.scenario)
    store.discard_obtained("gloo", b.scenario)  # none left: nothing to do
    assert not obtained.exists()


def test_compare_of_a_baseline_directory_ignores_obtained_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for side in ("before", "after"):
        (tmp_path / side / "gloo").mkdir(parents=True)
        shutil.copy(DATA / "ddp.json", tmp_path / side / "gloo" / "ddp-19m-dp4.json")
    other = tmp_path / "after" / "gloo" / "ddp-19m-dp4.obtained.json"
    shutil.copy(DATA / "ddp-split-bucket.json", other)  # a run that differed, not yet accepted
    assert main(["compare", str(tmp_path / "before"), str(tmp_path / "after")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 of 1 scenario(s) changed")


def test_the_unused_baselines_are_those_of_the_backends_the_run_used(tmp_path: Path) -> None:
    """A run on gloo listed the emulated runs' baselines as used by no scenario, and an emulated run gloo's,
    though each side's scenarios use them (found by an adversarial pass): a user told so may delete them."""
    store = BaselineStore(tmp_path)
    for backend, name in (("gloo", "a"), ("gloo", "b"), ("emulated", "a")):
        store.path(backend, name).parent.mkdir(exist_ok=True)
        store.path(backend, name).write_text("{}")
    used = {str(store.path("gloo", "a").resolve())}
    assert store.unused(used) == [store.path("gloo", "b")]
    assert store.unused({str(store.path("emulated", "a").resolve())}) == []


def test_links_that_lead_nowhere_are_one_line_errors_or_no_baselines(tmp_path: Path) -> None:
    """Found by an adversarial pass: a stray symbolic-link loop in a backend's folder made a passing gate exit
    1 with a traceback (the unused-baselines listing resolved it); a scenario's own baseline a loop, or a file
    where the backend's folder goes, were tracebacks too. A loop is no baseline; the others are one line."""
    from commgate.core.errors import WriteError
    from commgate.core.fsutil import atomic_write_bytes

    store = BaselineStore(tmp_path)
    b = bl.load(DATA / "ddp.json")
    used = str(store.save(b).resolve())
    (tmp_path / "gloo" / "stray.json").symlink_to("stray.json")
    assert store.unused({used}) == [] and store.query() == [store.path("gloo", b.scenario)]
    own = store.path("gloo", "other")
    own.symlink_to(own.name)
    with pytest.raises(bl.BaselineError, match=r"other\.json: a symbolic-link loop, not a baseline; remove it"):
        store.load("gloo", "other")
    with pytest.raises(WriteError, match=r"other\.json: a symbolic-link loop; remove it"):
        atomic_write_bytes(own, b"{}")
    (tmp_path / "nccl").write_text("x")
    for call in (store.load, store.discard_obtained):
        with pytest.raises(WriteError, match=r"nccl: not a directory, where commgate keeps the nccl baselines"):
            call("nccl", b.scenario)
