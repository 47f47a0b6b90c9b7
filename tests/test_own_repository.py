"""The README's quick start for your own repository, step by step, in a directory outside the checkout
with a model module of its own: scenario folder named in the pytest configuration, the first run writes
the baselines and says so, the next passes against them, and the CI line (``ci/pr-gate.sh``) runs there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import torch
from torch import nn


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def build(scenario):
    b = scenario.parallelism.micro_batch

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(b, 32, generator=g), torch.randint(0, 4, (b,), generator=g)

    return TwoLayer(), inputs
"""

SCENARIO = """schema_version: 1
name: my-ddp
description: our model under DDP on 2 ranks
model: {module: "mynet:build"}
parallelism: {scheme: ddp, dp: 2}
steps: 2
"""


def test_the_quick_start_in_a_repository_of_your_own(tmp_path: Path) -> None:
    repo = tmp_path / "myrepo"
    (repo / "comm").mkdir(parents=True)
    (repo / "mynet.py").write_text(MODULE)
    (repo / "comm" / "ddp.yaml").write_text(SCENARIO)
    (repo / "pytest.ini").write_text("[pytest]\ncommgate_scenario_dirs = comm\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}

    def pytest(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
        return subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env)

    first = pytest()
    assert first.returncode == 1, first.stdout + first.stderr  # nothing passes without a baseline
    assert "no baseline yet: wrote" in first.stdout and (repo / "baselines" / "gloo" / "my-ddp.json").is_file()
    second = pytest()
    assert second.returncode == 0, second.stdout + second.stderr
    assert "1 passed" in second.stdout
    ci = subprocess.run(
        [str(ROOT / "ci" / "pr-gate.sh")],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env | {"SUITE": "comm", "PYTHON": sys.executable},
    )
    assert ci.returncode == 0, ci.stdout + ci.stderr
    assert (repo / "out" / "pr-gate" / "junit.xml").is_file() and (repo / "out" / "pr-gate" / "index.html").is_file()


def test_your_own_module_imports_from_the_directory_you_run_in(tmp_path: Path) -> None:
    """The console scripts (``commgate``, ``pytest``) import a scenario's ``model.module`` from the
    directory they run in, as ``python -m`` does, with no PYTHONPATH; from elsewhere the error says what
    to do."""
    repo = tmp_path / "myrepo"
    (repo / "comm").mkdir(parents=True)
    (repo / "mynet.py").write_text(MODULE)
    (repo / "comm" / "ddp.yaml").write_text(SCENARIO)
    (repo / "pytest.ini").write_text("[pytest]\ncommgate_scenario_dirs = comm\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = Path(sys.executable).parent

    def run(tool: str, *args: str, cwd: Path = repo) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / tool), *args], cwd=cwd, capture_output=True, text=True, env=env)

    ok = run("commgate", "validate", "comm/ddp.yaml")
    assert ok.returncode == 0 and "ok  my-ddp" in ok.stdout, ok.stderr
    collected = run("pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "comm")
    assert collected.returncode == 0 and "my-ddp" in collected.stdout, collected.stdout + collected.stderr
    elsewhere = run("commgate", "validate", str(repo / "comm" / "ddp.yaml"), cwd=tmp_path)
    assert elsewhere.returncode == 2 and len(elsewhere.stderr.strip().splitlines()) == 1
    assert "No module named 'mynet'" in elsewhere.stderr
    assert "run commgate from the directory that holds mynet" in elsewhere.stderr and "PYTHONPATH" in elsewhere.stderr


def test_the_readmes_own_repository_commands_run_as_written(tmp_path: Path) -> None:
    """The README's block for your own repository, line by line as written (but the install: commgate is
    installed here), in a directory outside the checkout holding a nanoGPT-style model: init writes the
    scenarios (DDP, ZeRO-2, ZeRO-3), the first pytest stores their baselines, the second passes, ci.sh passes
    and writes its JUnit XML and HTML; a second init refuses to overwrite, in one line."""
    import re
    import shlex

    block = re.search(r"<!-- own-repository -->\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md lost its <!-- own-repository --> block"
    commands = [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands[0].startswith("pip install -e PATH/TO/commgate")
    repo = tmp_path / "myrepo"
    repo.mkdir()
    (repo / "mygpt.py").write_text((ROOT / "tests" / "user_nanogpt.py").read_text())
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}  # python, commgate: this venv's
    env.pop("PYTHONPATH", None)
    for command in commands[1:]:
        argv = shlex.split(command)
        proc = subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if argv[:2] == ["commgate", "init"]:
            names = sorted(p.name for p in (repo / "comm").glob("*.yaml"))
            assert names == ["mygpt-ddp.yaml", "mygpt-zero2.yaml", "mygpt-zero3.yaml"], names
            # the sequence length, which the module's build reads, is written, not silently 1
            assert "  s: 64\n" in (repo / "comm" / "mygpt-ddp.yaml").read_text()
            # where ci.sh writes its reports, and what a run that differs leaves beside its baseline
            assert (repo / ".gitignore").read_text() == "out/\n*.obtained.json\n"
        if command.endswith("pytest comm/"):
            assert "3 passed" in proc.stdout, proc.stdout[-2000:]
    assert sorted(p.name for p in (repo / "baselines" / "gloo").iterdir()) == [
        "mygpt-ddp.json", "mygpt-zero2.json", "mygpt-zero3.json"
    ]  # fmt: skip
    assert (repo / "out" / "commgate" / "junit.xml").is_file() and (repo / "out" / "commgate" / "index.html").is_file()
    again = subprocess.run(shlex.split(commands[1]), cwd=repo, capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "exists; commgate init never overwrites" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr


def test_init_names_the_option_that_is_wrong(tmp_path: Path) -> None:
    """``--dir /abs/path`` was refused as "--dp 2 / --dir ...: give --dp >= 1 and a folder name", blaming a
    valid --dp (found by a newcomer's walkthrough): each option is refused on its own, saying what to give."""
    bindir = Path(sys.executable).parent
    init = [str(bindir / "commgate"), "init", "--module", "mynet:build"]
    bad_dir = subprocess.run([*init, "--dir", str(tmp_path / "x")], cwd=tmp_path, capture_output=True, text=True)
    assert bad_dir.returncode == 2 and "--dp" not in bad_dir.stderr
    assert f"--dir '{tmp_path / 'x'}': give a folder name inside the repository" in bad_dir.stderr
    bad_dp = subprocess.run([*init, "--dp", "0"], cwd=tmp_path, capture_output=True, text=True)
    assert bad_dp.returncode == 2 and "--dp 0: give 1 or more data-parallel ranks" in bad_dp.stderr
    assert "--dir" not in bad_dp.stderr and list(tmp_path.iterdir()) == []  # nothing written either time


def test_commands_without_paths_read_the_folder_the_pytest_configuration_names(tmp_path: Path) -> None:
    """In a repository ``commgate init`` set up (``commgate_scenario_dirs = comm``), ``commgate validate`` and
    ``run`` with no paths said "scenarios: $: cannot read" (found by a newcomer's walkthrough): they read the
    folder pytest reads, from pytest.ini or pyproject.toml, and with none there say what to give."""
    bindir = Path(sys.executable).parent
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "a.yaml").write_text(SCENARIO.replace("mynet:build", "commgate.examples.mixer:build"))
    (tmp_path / "pytest.ini").write_text("[pytest]\ncommgate_scenario_dirs = comm\n")
    ok = subprocess.run([str(bindir / "commgate"), "validate"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0 and "ok  my-ddp  (comm/a.yaml; ddp, world 2)" in ok.stdout, ok.stderr
    (tmp_path / "pytest.ini").unlink()
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ncommgate_scenario_dirs = ["comm"]\n')
    ok = subprocess.run([str(bindir / "commgate"), "validate"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0 and "my-ddp" in ok.stdout, ok.stderr
    (tmp_path / "pyproject.toml").unlink()
    for command in ("validate", "run"):
        none = subprocess.run([str(bindir / "commgate"), command], cwd=tmp_path, capture_output=True, text=True)
        assert none.returncode == 2 and none.stderr.strip() == (
            "commgate: error: no scenarios here: ./scenarios not found; give scenario files or folders, or start a "
            "folder with commgate init"
        )


def test_init_with_a_module_refuses_fsdp_naming_the_schemes_it_models(tmp_path: Path) -> None:
    """``--module`` with ``--schemes ddp,fsdp`` was refused naming ``comm/model-fsdp.yaml``, a file never written
    (found by an adversarial pass); the refusal names the option, and nothing is written."""
    from commgate.core.errors import UsageError
    from commgate.model.starter import start

    with pytest.raises(UsageError) as info:
        start(repo=tmp_path, module="model:build", schemes=("ddp", "fsdp"))
    assert str(info.value) == (
        "--schemes fsdp: a user's module (--module) is modelled under ddp, zero1, zero2, zero3; leave fsdp out, "
        "or start from --preset or --hf for it"
    )
    assert list(tmp_path.iterdir()) == []


def test_init_says_to_ignore_out_where_the_repository_ignores_files_already(tmp_path: Path) -> None:
    """ci.sh writes its reports to out/commgate, which showed as untracked (a newcomer's walkthrough): init
    writes a .gitignore naming out/ where there is none, and says what to add to one that lacks it."""
    from commgate.model.starter import start

    (tmp_path / ".gitignore").write_text("*.pyc\n")
    got = start(repo=tmp_path, preset="19M-cpu", schemes=("ddp",))
    assert tmp_path / ".gitignore" not in got.files
    assert f"{tmp_path / '.gitignore'}: add `out/` (ci.sh writes its reports to out/commgate" in " ".join(got.notes)
    assert f"{tmp_path / '.gitignore'}: add `*.obtained.json` (what a run that differs" in " ".join(got.notes)
    (tmp_path / ".gitignore").write_text("*.pyc\nout/\n*.obtained.json\n")
    assert not [n for n in start(repo=tmp_path, preset="19M-cpu", schemes=("ddp",)).notes if ".gitignore" in n]


def test_the_line_init_says_to_add_works_when_pasted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``add `commgate_scenario_dirs = comm``` was invalid TOML in pyproject.toml, and a second name for the
    setting in a pytest.ini that had it (a newcomer's walkthrough): the line is written as the file writes it,
    and pasted in, pytest reads it."""
    import re

    from commgate.model.starter import start

    monkeypatch.chdir(tmp_path)
    for config, section, existing in (
        ("pyproject.toml", "[tool.pytest.ini_options]\n", ""),
        ("pytest.ini", "[pytest]\n", "commgate_scenario_dirs = comm\n"),
    ):
        for old in ("pyproject.toml", "pytest.ini"):
            (tmp_path / old).unlink(missing_ok=True)
        (tmp_path / config).write_text(section + existing)
        (note,) = [
            n for n in start(repo=tmp_path, preset="19M-cpu", folder="comm2", schemes=("ddp",)).notes if config in n
        ]
        line = re.search(r"`((?:commgate_scenario_dirs = |    )[^`]*)`", note)
        assert line, note
        (tmp_path / config).write_text(section + existing + line[1] + "\n" if existing else section + line[1] + "\n")
        (tmp_path / "comm").mkdir(exist_ok=True)
        (tmp_path / "comm2").mkdir(exist_ok=True)
        shown = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert shown.returncode in (0, 5), shown.stdout + shown.stderr  # read (5: nothing to collect yet)
        assert "comm2" in line[1]


def test_init_writes_what_it_offers_and_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    """init offered zero++ (an invalid name, "19M-cpu-zero++", and no flag for its hpz) and tp/pp/3d/cp/moe
    with no flag to set their degree, accepted a --dp its own next step could not run, and a .gitignore directory was a
    traceback; its next: line named a bare ``python``, another interpreter than the one with commgate (found
    by an adversarial pass)."""
    from commgate.model.loader import load_paths
    from commgate.run.launcher import local_rank_limit

    bindir = Path(sys.executable).parent
    init = [str(bindir / "commgate"), "init", "--preset", "19M-cpu"]

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*init, *args], cwd=cwd, capture_output=True, text=True)

    for args, says in [
        (("--schemes", "ddp,tp,zero++"), "--schemes tp,zero++: init writes data-parallel scenarios (ddp, zero1,"),
        (("--dp", str(local_rank_limit() + 1)), f"--dp {local_rank_limit() + 1}: the scenarios run on this machine"),
    ]:
        bad = run(*args, cwd=tmp_path)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert list(tmp_path.iterdir()) == []
    (tmp_path / ".gitignore").mkdir()
    ok = run("--schemes", "zero1,fsdp", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"note: {tmp_path / '.gitignore'}: not a file" in ok.stdout
    assert sorted(s.name for s in load_paths([tmp_path / "comm"])) == ["19M-cpu-fsdp", "19M-cpu-zero1"]
    python = next(line for line in ok.stdout.splitlines() if line.startswith("next: ")).split()[1]
    version = subprocess.run([python, "-c", "import commgate"], cwd=tmp_path, capture_output=True, text=True)
    assert version.returncode == 0, (python, version.stderr)


@pytest.mark.parametrize(
    "toml",
    [
        'commgate_scenario_dirs = [\n    "comm",\n]\n',  # the array over several lines, as formatters write it
        'commgate_scenario_dirs = ["comm"]  # the CI\'s "gate" suite\n',  # quotes in a comment
        'commgate_scenario_dirs = "comm"\n',  # a string of names, as pytest also reads it
    ],
    ids=["multi-line", "comment", "string"],
)
def test_the_scenario_folders_are_read_from_pyproject_as_pytest_reads_them(tmp_path: Path, toml: str) -> None:
    """pytest collected ``comm/`` while ``commgate validate`` said "./scenarios not found" (or read a folder
    named in a comment): the CLI read pyproject.toml by a regular expression (an adversarial pass)."""
    from commgate.model.starter import scenario_dirs

    (tmp_path / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{toml}\n[tool.other]\nx = 1\n")
    assert [os.path.abspath(d) for d in scenario_dirs(tmp_path / "pyproject.toml")] == [str(tmp_path / "comm")]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("pytest.ini", "[pytest]\ncommgate_scenario_dirs = comm\n"),
        ("pytest.toml", '[pytest]\ncommgate_scenario_dirs = ["comm"]\n'),  # pytest 9's own file
        ("pyproject.toml", '[tool.pytest]\ncommgate_scenario_dirs = ["comm"]\n'),  # pytest 9's native table
        ("tox.ini", "[pytest]\ncommgate_scenario_dirs = comm\n"),
    ],
)
def test_from_a_subfolder_the_cli_reads_the_configuration_pytest_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    """In a subfolder of a repository whose pytest configuration names ``comm``, ``commgate validate`` said
    "./scenarios not found" where pytest finds the configuration above (an adversarial pass), and ``run --gate``
    would have kept baselines in the subfolder, where the gate keeps them in its rootdir. The CLI reads the
    configuration pytest finds, and keeps the gate's baselines."""
    from commgate.cli import main, parse

    (tmp_path / name).write_text(text)
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "d.yaml").write_text(
        "schema_version: 1\nname: d\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
    )
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert main(["validate"]) == 0
    assert capsys.readouterr().out == "ok  d  (../comm/d.yaml; ddp, world 2)\n1 scenario(s) valid.\n"
    assert parse(["run", "--gate"]).baseline_dir == Path("..", "baselines")
    assert parse(["run", "--baseline-dir", "mine"]).baseline_dir == Path("mine")
    monkeypatch.chdir(tmp_path)
    assert parse(["check", "cap"]).baseline_dir == Path("baselines")


def test_a_configuration_pytest_refuses_is_one_line_and_one_that_is_not_pytests_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setup.cfg with [pytest] above the working directory made every command a traceback (pytest's
    ``fail`` is no Exception); a pyproject.toml that does not configure pytest, above a project with its own
    ./scenarios, moved the CLI to the folder above it without a word (both found by an adversarial pass)."""
    from commgate.cli import main

    (tmp_path / "proj" / "scenarios").mkdir(parents=True)
    (tmp_path / "proj" / "scenarios" / "d.yaml").write_text(
        "schema_version: 1\nname: d\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
    )
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 100\n")
    monkeypatch.chdir(tmp_path / "proj")
    assert main(["validate"]) == 0
    assert capsys.readouterr().out == "ok  d  (scenarios/d.yaml; ddp, world 2)\n1 scenario(s) valid.\n"
    (tmp_path / "setup.cfg").write_text("[pytest]\naddopts = -q\n")
    for argv in (["validate"], ["calibrate", "report.json"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("commgate: error: pytest cannot read its configuration here: [pytest] section in ")
        assert err.endswith("; fix it (pytest refuses it too)\n") and len(err.splitlines()) == 1


def test_pytest_8_0s_search_is_asked_as_it_takes_its_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest 8.0's ``locate_config`` took the paths alone (8.1 added the invocation directory first), and
    pyproject.toml allows pytest>=8: asked the later way, it raised a TypeError the CLI took for a refused
    configuration."""
    from _pytest.config import findpaths
    from commgate.model.starter import find_pytest_config

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    asked: list[object] = []

    def locate_config(args: list[Path]) -> tuple[Path, Path, dict[str, str]]:  # 8.0's signature
        asked.append(args)
        return tmp_path, tmp_path / "pytest.ini", {}

    monkeypatch.setattr(findpaths, "locate_config", locate_config)
    assert find_pytest_config(tmp_path / "sub") == tmp_path / "pytest.ini" and asked == [[tmp_path / "sub"]]


def test_the_commands_init_prints_run_as_printed_without_an_activated_environment(tmp_path: Path) -> None:
    """init printed ``sh comm/ci.sh`` while ci.sh ran a bare ``python``: without the environment activated
    that was another interpreter, and pytest failed on commgate's options, not naming the cause (found by an
    adversarial pass). Each command init prints runs as printed, from a shell whose ``python`` lacks
    commgate; ci.sh run with such a ``python`` says so in one line."""
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHON")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p).resolve() != bindir.resolve())
    init = [str(bindir / "commgate"), "init", "--preset", "19M-cpu", "--schemes", "ddp"]
    out = subprocess.run(init, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("next: ")]
    update, _, rest = line.removeprefix("next: ").partition("   (stores baselines/: commit them), then ")
    gate, _, ci = rest.partition(" (the gate) and ")
    ci = ci.removesuffix(" (what CI runs)")
    assert ci.startswith(f"PYTHON={bindir}{os.sep}") and ci.endswith(" sh comm/ci.sh"), line
    for command in (update, gate, ci):
        proc = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    wrong = subprocess.run(["sh", "comm/ci.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**env, "PYTHON": "false"})  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr == (
        "ci.sh: commgate is not installed for false; install it there, or set PYTHON=/path/to/python that has it\n"
    )
