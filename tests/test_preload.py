"""The trainers the scenarios to run name are imported once, by the ranks' forkserver (``commgate.run.preload``),
not by every rank of every scenario: what a rank forked from it finds imported, and a preload that raises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commgate.model.loader import trainers_named
from commgate.run import preload
from commgate.run.launcher import gpu_visible

TRAINER_MODULES = {
    "hf": "transformers.trainer",
    "torchtitan": "torchtitan.trainer",
    "megatron": "megatron.core.optimizer",
}
"""A module each trainer's ranks import for seconds (the adapters' ``preload``), by trainer."""

PROBE = """
import os, sys

def loaded(conn, modules):
    threads = len(os.listdir(f"/proc/{os.getppid()}/task"))  # the forkserver's, as it forked this process
    conn.send([sorted(m for m in modules if m in sys.modules), threads])
"""

FORKED = """
import json, sys
sys.path.insert(0, {here!r})
import probe
from commgate.run import launcher

ctx = launcher._context({trainers!r})
parent, child = ctx.Pipe()
p = ctx.Process(target=probe.loaded, args=(child, {modules!r}))
p.start()
found = parent.recv()
p.join()
print(json.dumps(found))
"""


def loaded_in_a_rank(tmp_path: Path, trainers: list[str]) -> list[str]:
    """The trainers' modules a process forked from the forkserver of a fresh process finds imported, the
    forkserver started for ``trainers``; the forkserver forked it with one thread (pyarrow, imported with the
    trainers, starts its allocator's background thread unless told not to: ``preload.ONE_THREAD``)."""
    (tmp_path / "probe.py").write_text(PROBE)
    code = FORKED.format(here=str(tmp_path), trainers=trainers, modules=sorted(TRAINER_MODULES.values()))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found, threads = json.loads(done.stdout.strip().splitlines()[-1])
    assert threads == 1, f"the forkserver forked with {threads} threads"
    return list(found)


@pytest.mark.skipif(
    gpu_visible(), reason="the forkserver preloads DeepSpeed and the trainers only where no GPU is visible"
)
def test_a_rank_finds_the_trainers_of_the_scenarios_to_run_imported_and_no_other(tmp_path: Path) -> None:
    installed = [t for t, m in TRAINER_MODULES.items() if importlib.util.find_spec(m.split(".")[0]) is not None]
    if not installed:
        pytest.skip("no trainer installed (pip install 'commgate[trainers]')")
    assert loaded_in_a_rank(tmp_path, installed) == sorted(TRAINER_MODULES[t] for t in installed)
    assert loaded_in_a_rank(tmp_path, ["commgate"]) == []  # commgate's own workloads' runs pay for none


def test_a_trainer_whose_preload_raises_is_said_and_left_to_its_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preload that raises must not stop the forkserver (every rank of every scenario forks from it): it is
    said in the forkserver's log (its stdout), the others preloaded."""
    done: list[str] = []

    def broken() -> None:
        raise ImportError("no module named 'transformers'")

    monkeypatch.setitem(preload.PRELOADS, "hf", broken)
    monkeypatch.setitem(preload.PRELOADS, "megatron", lambda: done.append("megatron"))
    assert preload.preload("hf,megatron,") == ["hf"]
    assert done == ["megatron"]
    out = capsys.readouterr().out
    assert "commgate: preloading trainer 'hf' failed; its ranks import it themselves:" in out
    assert "ImportError: no module named 'transformers'" in out


def test_the_trainers_a_suite_names_are_read_without_loading_it(tmp_path: Path) -> None:
    """What ``commgate run`` starts the forkserver with before the scenarios load: the top-level ``trainer:``
    of each file; a file that is broken, not a mapping, or an alias bomb names none (its load says why)."""
    (tmp_path / "a.yaml").write_text("schema_version: 1\nname: a\ntrainer: hf\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("schema_version: 1\nname: b\ntrainer: torchtitan\nmodel: {L: 2}\n")
    (tmp_path / "c.yaml").write_text("schema_version: 1\nname: c\nmodel: {trainer: megatron}\n")  # not top level
    (tmp_path / "broken.yaml").write_text("trainer: [megatron\n")
    (tmp_path / "list.yaml").write_text("- trainer: megatron\n")
    rows = [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "\n".join(rows)  # 9 * 4**8 nodes once expanded
    (tmp_path / "bomb.yaml").write_text(bomb + "\ntrainer: commgate\n")
    assert trainers_named([tmp_path]) == {"hf", "torchtitan", "commgate"}
    assert trainers_named([tmp_path / "a.yaml", tmp_path / "missing.yaml"]) == {"hf"}


def test_a_run_whose_scenarios_fail_to_load_says_so_in_one_line_and_leaves_no_forkserver(tmp_path: Path) -> None:
    """``commgate run`` starts the ranks' forkserver before it loads the scenarios: a scenario that does not
    load is still one line, and the forkserver started meanwhile does not outlive the command."""
    (tmp_path / "bad.yaml").write_text(
        "schema_version: 1\nname: bad\ntrainer: hf\nmodel: {preset: 19M-cpu}\nsteps: -1\n"
    )
    mark = f"commgate-test-{tmp_path.name}"
    env = {**os.environ, "COMMGATE_TEST_MARK": mark}
    done = subprocess.run(
        [sys.executable, "-m", "commgate", "run", str(tmp_path / "bad.yaml")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "bad.yaml" in done.stderr, done.stderr
    deadline = time.monotonic() + 30
    while (left := marked(mark)) and time.monotonic() < deadline:  # killed at exit; reaped by init
        time.sleep(0.2)
    assert not left, f"processes of the command left running: {left}"


def marked(mark: str) -> list[int]:
    """The pids of the live processes whose environment holds ``COMMGATE_TEST_MARK=mark``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"COMMGATE_TEST_MARK={mark}".encode() in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_the_environments_own_ninja_builds_its_ops_whatever_path_finds_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch builds with whichever ``ninja`` ``PATH`` finds; the environment's (1.13) and the system's (1.11)
    each took the other's build of DeepSpeed's op as changed, so a shell with the environment activated and one
    without rebuilt it alternately, 50 s a run against 10 s here (found by an adversarial pass). The forkserver
    puts the environment's first, once; a build in the user's own process does so only while it builds."""
    from commgate.run.extensions import ninja_first, own_ninja

    here = Path(sys.prefix) / "bin"
    if not (here / "ninja").is_file():
        pytest.skip(f"this environment has no ninja of its own ({here}): PATH's is the only one")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    with own_ninja():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(here)
    assert os.environ["PATH"] == os.pathsep.join(["/usr/bin", "/bin"])
    ninja_first()
    ninja_first()  # once first, not twice
    assert os.environ["PATH"].split(os.pathsep) == [str(here), "/usr/bin", "/bin"]
