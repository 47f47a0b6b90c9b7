"""A captured job judged without a scenario (``commgate check DIR``: its baseline and the drift rules only),
and a scenario that points at a capture (``capture: DIR``), judged by ``pytest`` and ``commgate run`` exactly
as ``commgate check DIR --scenario`` judges it.

Real jobs: the plain DDP script of ``tests/data/jobs`` under ``torchrun --nproc-per-node 2`` on CPU gloo,
unchanged and with an extra all-reduce planted, each captured once for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_capture_job import BOUND_S, JOBS, TORCHRUN, commgate

PLANTED = "calls [steps] all_reduce fp32 4 B forward group [0, 1]: obtained 4, expected 0"
"""The extra all-reduce of the loss in the scenario's 2 measured steps (2 ranks a step)."""
PLANTED_ALL = "calls [steps] all_reduce fp32 4 B forward group [0, 1]: obtained 6, expected 0"
"""The same without a scenario: every captured step is judged (3; no warm-up is known)."""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("capture-check")


@pytest.fixture(scope="module")
def jobs(work: Path) -> dict[str, Path]:
    """The DDP job captured as it is (``plain``) and with an extra all-reduce of the loss (``planted``)."""
    out = {}
    for name, plant in (("plain", ()), ("planted", ("--extra-all-reduce",))):
        out[name] = work / name
        done = commgate("capture", "-o", out[name], "--", *TORCHRUN, "ddp_train.py", "--steps", "3", *plant)
        assert done.returncode == 0, done.stderr
    return out


# ------------------------------------------------------------------------------ check without a scenario


def test_without_a_scenario_the_baseline_keyed_by_the_job_s_name_gates_the_capture(
    jobs: dict[str, Path], work: Path
) -> None:
    store = work / "baselines-unscripted"
    first = commgate("check", jobs["plain"], "--baseline-dir", store)
    assert first.returncode == 1  # a missing baseline is written, and the check fails: never a silent pass
    assert "no baseline yet: wrote" in first.stdout and (store / "gloo" / "ddp_train.json").is_file()
    stored = commgate("check", jobs["plain"], "--baseline-dir", store, "--update-baselines")
    assert stored.returncode == 0, stored.stdout + stored.stderr
    report = work / "report-unscripted"
    again = commgate("check", jobs["plain"], "--baseline-dir", store, "--report-dir", report)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "no scenario: judged against the baseline 'ddp_train' and the drift rules only" in again.stdout
    assert "the model was not checked (no scenario describes the job)" in again.stdout
    assert "predicted" not in again.stdout and "comm fraction" not in again.stdout  # no stand-in's numbers
    (s,) = json.loads((report / "report.json").read_text())["scenarios"]
    assert s["status"] == "passed" and s["scheme"] == "no scenario" and "time_model" not in s
    assert "collectives" not in s and "traffic_matrix" not in s  # nothing compared with the stand-in model
    assert {c["op"] for c in s["capture"]["calls"]} == {"all_gather", "all_reduce", "broadcast"}
    assert (report / "index.html").is_file()
    assert [f["title"] for f in s["findings"] if f["kind"] == "model"] == [
        "the model was not checked (no scenario describes the job): only the baseline and drift gate this run"
    ]
    planted = commgate("check", jobs["planted"], "--baseline-dir", store)
    assert planted.returncode == 1, planted.stdout + planted.stderr
    assert "[baseline] communication differs from the baseline" in planted.stdout
    assert PLANTED_ALL in planted.stdout


def test_name_keys_the_baseline_and_bad_names_are_one_line(jobs: dict[str, Path], work: Path) -> None:
    store = work / "baselines-named"
    stored = commgate("check", jobs["plain"], "--name", "nightly.ddp", "--baseline-dir", store, "--update-baselines")
    assert stored.returncode == 0, stored.stdout + stored.stderr
    assert sorted(p.name for p in (store / "gloo").iterdir()) == ["nightly.ddp.json"]
    planted = commgate("check", jobs["planted"], "--name", "nightly.ddp", "--baseline-dir", store)
    assert planted.returncode == 1 and PLANTED_ALL in planted.stdout
    for args, says in (
        (("--name", "../x"), "--name '../x': at most 100 letters, digits"),
        (("--name", "x", "--scenario", "ddp-mlp.yaml"), "--scenario names it already"),
    ):
        done = commgate("check", jobs["plain"], *args, "--baseline-dir", store)
        assert done.returncode == 2 and says in done.stderr
        assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr


def test_refresh_latency_adds_a_captured_run_to_the_latency_history(jobs: dict[str, Path], work: Path) -> None:
    """Found by an adversarial pass: ``check`` had no ``--refresh-latency``, the flag its own latency note
    names, so a captured job's latency history never grew past its first run and latency was never judged."""
    store = work / "baselines-refreshed"
    stored = commgate("check", jobs["plain"], "--name", "refreshed", "--baseline-dir", store, "--update-baselines")
    assert stored.returncode == 0, stored.stdout + stored.stderr

    def runs() -> int:
        doc = json.loads((store / "gloo" / "refreshed.json").read_text())
        return sum(len(v) for v in doc["latency"].values())

    assert runs() == 1
    for n in (2, 3):
        again = commgate(
            "check", jobs["plain"], "--name", "refreshed", "--baseline-dir", store, "--update-baselines",
            "--refresh-latency",
        )  # fmt: skip
        assert again.returncode == 0, again.stdout + again.stderr
        assert runs() == n
    alone = commgate("check", jobs["plain"], "--name", "refreshed", "--baseline-dir", store, "--refresh-latency")
    assert alone.returncode == 2 and "--refresh-latency works with --update-baselines; add it" in alone.stderr


def test_a_command_with_no_script_needs_a_name(jobs: dict[str, Path], work: Path) -> None:
    cap = work / "nameless"
    shutil.copytree(jobs["plain"], cap)
    for r in (0, 1):
        meta = cap / f"rank{r}.meta.json"
        meta.write_text(json.dumps(json.loads(meta.read_text()) | {"command": "/opt/launch-my-job"}))
    done = commgate("check", cap, "--baseline-dir", work / "unused")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"{cap / 'rank0.meta.json'}: $.command: no job name in the command '/opt/launch-my-job'; give one: "
        "commgate check DIR --name NAME"
    )
    assert not (work / "unused").exists()  # nothing written


# ------------------------------------------------------------------------------ a scenario with capture:


def suite(root: Path, capture: str) -> Path:
    """``root/comm/job.yaml``: the DDP job's scenario (tests/data/jobs/ddp-mlp.yaml), pointing at ``capture``
    (relative to the file)."""
    comm = root / "comm"
    comm.mkdir(parents=True)
    text = (JOBS / "ddp-mlp.yaml").read_text().replace("name: captured-ddp-mlp", f"name: job\ncapture: {capture}")
    (comm / "job.yaml").write_text(text)
    return comm


def pytest_run(comm: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``pytest comm/`` in its own process (the plugin collects the scenario files), the job's module on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(JOBS), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "pytest", comm.name, "-p", "no:cacheprovider", "-q", *map(str, args)]
    return subprocess.run(argv, cwd=comm.parent, env=env, capture_output=True, text=True, timeout=BOUND_S)


def test_pytest_judges_a_scenario_s_capture_as_check_does(jobs: dict[str, Path], tmp_path: Path) -> None:
    store = tmp_path / "baselines"
    comm = suite(tmp_path, str(jobs["plain"]))
    written = pytest_run(comm, "--commgate-baseline-dir", store, "--commgate-update-baselines")
    assert (store / "gloo" / "job.json").is_file(), written.stdout[-3000:]
    passed = pytest_run(comm, "--commgate-baseline-dir", store, "--commgate-report-dir", tmp_path / "report")
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert "1 passed" in passed.stdout
    (s,) = json.loads((tmp_path / "report" / "report.json").read_text())["scenarios"]
    assert s["status"] == "passed" and {c["op"] for c in s["collectives"]} == {"all_reduce", "broadcast"}
    assert all(c["unexplained_bytes"] == 0 for c in s["collectives"])
    assert s["capture"]["stack"]["launcher"] == "torchrun"  # the captured job's, not a local run's
    # the same baseline judges the same capture through commgate check and commgate run
    checked = commgate("check", jobs["plain"], "--scenario", comm / "job.yaml", "--baseline-dir", store)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    run = commgate("run", comm, "--gate", "--baseline-dir", store)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED  job (ddp, 2 ranks" in run.stdout and "unexplained 0 B" in run.stdout


def test_a_planted_change_fails_pytest_and_run_naming_it(jobs: dict[str, Path], tmp_path: Path) -> None:
    store = tmp_path / "baselines"
    stored = commgate("check", jobs["plain"], "--scenario", suite(tmp_path / "a", str(jobs["plain"])) / "job.yaml",
                      "--baseline-dir", store, "--update-baselines")  # fmt: skip
    assert stored.returncode == 0, stored.stdout + stored.stderr
    comm = suite(tmp_path / "b", os.path.relpath(jobs["planted"], tmp_path / "b" / "comm"))  # beside the file
    failed = pytest_run(comm, "--commgate-baseline-dir", store)
    assert failed.returncode == 1 and "1 failed" in failed.stdout
    assert "communication differs from the baseline" in failed.stdout and PLANTED in failed.stdout
    run = commgate("run", comm, "--gate", "--baseline-dir", store)
    assert run.returncode == 1 and PLANTED in run.stdout
    mismatch = commgate("check", jobs["plain"], "--scenario", comm / "job.yaml", "--baseline-dir", store)
    assert mismatch.returncode == 2 and "give one of them" in mismatch.stderr  # two captures named: which?


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (("dp: 2", "dp: 4"), "world size 4, but {cap} holds 2 ranks"),
        (
            ("steps: 2", "steps: 5"),
            "warmup_steps 1 + steps 5 = 6, but {cap} holds 3 step(s); set them to add up to the captured job's steps",
        ),
    ],
    ids=["world", "steps"],
)
def test_a_scenario_that_cannot_describe_the_capture_is_one_line_before_anything_is_judged(
    jobs: dict[str, Path], tmp_path: Path, edit: tuple[str, str], says: str
) -> None:
    """The world size or the steps of ``--scenario`` against the capture: said after the capture's provenance
    and the scenario's progress line, as if it had begun to judge it (found by an adversarial pass)."""
    text = (JOBS / "ddp-mlp.yaml").read_text().replace(*edit)
    (tmp_path / "s.yaml").write_text(text)
    done = commgate("check", jobs["plain"], "--scenario", tmp_path / "s.yaml", "--baseline-dir", tmp_path / "b")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == f"commgate: error: {tmp_path / 's.yaml'}: {says.format(cap=jobs['plain'])}\n"


def test_a_capture_scenario_whose_steps_differ_is_its_own_error_and_the_run_goes_on(
    jobs: dict[str, Path], tmp_path: Path
) -> None:
    """``commgate run DIR`` stopped at such a scenario, with a report of the ones before it counted as passed and
    the ones after it never run (found by an adversarial pass); pytest failed that one test only."""
    comm = suite(tmp_path, str(jobs["plain"]))
    text = (comm / "job.yaml").read_text()
    (comm / "a-bad.yaml").write_text(text.replace("name: job", "name: a-bad").replace("steps: 2", "steps: 5"))
    run = commgate("run", comm, "--report-dir", tmp_path / "out")
    assert run.returncode == 1 and "commgate: error" not in run.stderr, run.stdout + run.stderr
    said = f"{comm / 'a-bad.yaml'}: warmup_steps 1 + steps 5 = 6, but {jobs['plain']} holds 3 step(s)"
    assert "ERROR   a-bad (ddp, 2 ranks" in run.stdout and said in run.stdout, run.stdout
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in doc["scenarios"]] == [("a-bad", "error"), ("job", "passed")]


def test_a_missing_or_empty_capture_is_one_line_naming_the_file_and_field(tmp_path: Path) -> None:
    comm = suite(tmp_path / "missing", "no-such-capture")
    done = commgate("validate", comm / "job.yaml")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert line.count("\n") == 0
    assert line.startswith(f"{comm / 'job.yaml'}:") and "$.capture: 'no-such-capture'" in line
    assert "no such directory; give the -o directory of commgate capture" in line
    (tmp_path / "empty" / "comm" / "empty").mkdir(parents=True)
    comm = tmp_path / "empty" / "comm"
    (comm / "job.yaml").write_text(
        (JOBS / "ddp-mlp.yaml").read_text().replace("name: captured-ddp-mlp", "name: job\ncapture: empty")
    )
    run = commgate("run", comm / "job.yaml", "--gate", "--baseline-dir", tmp_path / "baselines")
    assert run.returncode == 1
    assert "ERROR   job (ddp, 2 ranks" in run.stdout
    assert f"{comm / 'job.yaml'}: capture: {comm / 'empty'}: not a capture: no rank<N>.json in it" in run.stdout
    assert not (tmp_path / "baselines").exists()  # nothing written


# ------------------------------------------------------------------------------ hand-made capture directories


def hand_capture(d: Path, monkeypatch: pytest.MonkeyPatch, world: int = 2) -> Path:
    """A 2-step capture of ``world`` ranks (one all-reduce a step) written by the ranks' own writers
    (``commgate.run.external._meta``, ``write_rank_calls``), with ``job.json`` as ``commgate capture`` leaves
    it: no rank started."""
    from commgate.core.fsutil import atomic_write_json
    from commgate.model.collectives import Op
    from commgate.run import external
    from commgate.run.capture import CapturedCall, StepWindow, write_rank_calls

    d.mkdir(parents=True)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv(external.JOB_ENV, "job-1")
    monkeypatch.setenv(external.COMMAND_ENV, "torchrun --nproc-per-node 2 train.py")
    fixed = {"stack": {"hardware": "cpu x2", "cuda": None, "rocm": None, "backend_version": None},
             "versions": {"python": "3", "torch": "2", "deepspeed": None, "commgate": "0"}}  # fmt: skip
    group = tuple(range(world))
    for r in range(world):
        calls = [
            CapturedCall(rank=r, seq=s, step=s, phase="backward", op=Op("all_reduce"), group=group, peer=None,
                         dtype="fp32", elements=256, bytes=1024, tensors=1, start_ns=1000 * s + 10, duration_ns=50)
            for s in range(2)
        ]  # fmt: skip
        windows = [StepWindow(rank=r, step=s, start_ns=1000 * s, end_ns=1000 * s + 900) for s in range(2)]
        write_rank_calls(d / f"rank{r}.json", calls, windows)
        state = external._State(out=d, rank=r, inner="gloo", requested="gloo", fixed=fixed, optimizer_steps=2)
        atomic_write_json(d / f"rank{r}.meta.json", external._meta(state, "exited", 2))
    atomic_write_json(d / "job.json", {"command": "torchrun train.py", "job": "job-1", "exit_status": 0, "wall_s": 1})
    return d


DROP = object()
"""``edit``'s value that removes the key."""


def edit(file: Path, **changes: object) -> None:
    """Set (or, given ``DROP``, remove) top-level keys of the JSON object in ``file``."""
    doc = json.loads(file.read_text())
    for key, value in changes.items():
        if value is DROP:
            del doc[key]
        else:
            doc[key] = value
    file.write_text(json.dumps(doc))


def check_in_process(cap: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from commgate.cli import main

    status = main(["check", str(cap), "--name", "j", "--baseline-dir", str(store)])
    out, err = capsys.readouterr()
    return status, out, err.strip()


def test_a_hand_made_capture_is_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The helper's capture, as the ranks' writers write it, passes the meta's schema and is judged."""
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    status, out, err = check_in_process(cap, tmp_path / "b", capsys)
    assert status == 1 and err == "", err  # no baseline yet: written, and failed
    assert out.startswith(f"{cap}: unknown (COMMGATE_CAPTURE in the environment), 2 ranks on ")
    assert "2 step(s) by optimizer step hooks" in out and "; exit status 0" in out.splitlines()[0]
    assert (tmp_path / "b" / "gloo" / "j.json").is_file()
    # the ops the job issued, not the stand-in model's: it listed a broadcast "measured 0 B/step" the job never
    # made (found by an adversarial pass)
    assert [line.split()[0] for line in out.splitlines() if " measured " in line] == ["all_reduce"], out


FIX = "; capture the job again (commgate capture -o NEW_DIR -- COMMAND)"
MALFORMED_IDS = ["no-step-marks", "world-abc", "world-0", "world-neg", "world-float", "world-huge", "stack-str"]
MALFORMED_IDS += ["stack-value", "rank-str", "job-null", "backend-null", "meta-version"]


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"step_marks": DROP}, "$: 'step_marks' is a required property"),
        ({"world_size": "abc"}, "$.world_size: 'abc' is not of type 'integer'"),
        ({"world_size": 0}, "$.world_size: 0 is less than the minimum of 1"),
        ({"world_size": -1}, "$.world_size: -1 is less than the minimum of 1"),
        ({"world_size": 2.0}, "$.world_size: 2.0 is not of type 'integer'"),
        ({"world_size": 10_000_000_000}, "$.world_size: 10000000000 is greater than the maximum of 1048576"),
        ({"stack": "x"}, "$.stack: 'x' is not of type 'object'"),
        ({"stack": {"hardware": 3}}, "$.stack.hardware: 3 is not of type 'string', 'null'"),
        ({"rank": "0"}, "$.rank: '0' is not of type 'integer'"),
        ({"job": None}, "$.job: None is not of type 'string'"),
        ({"backend": None}, "$.backend: None is not of type 'string'"),
        ({"meta_version": 2}, "$.meta_version: 1 was expected"),
    ],
    ids=MALFORMED_IDS,
)
def test_a_malformed_meta_is_one_line_naming_the_file_the_field_and_the_value(
    changes: dict[str, object],
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each of these was a traceback (KeyError, ValueError, ZeroDivisionError, AttributeError), or, for
    10**10 ranks, gigabytes of memory: the meta is held to its schema before anything reads it."""
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    edit(cap / "rank0.meta.json", **changes)
    status, out, err = check_in_process(cap, tmp_path / "b", capsys)
    assert (status, out) == (2, "")
    assert err == f"{cap / 'rank0.meta.json'}: {says}{FIX}"
    assert not (tmp_path / "b").exists()  # nothing written


def test_a_world_larger_than_the_ranks_present_is_told_in_bounded_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A million ranks said, two present: the first missing ones are named and the rest counted (neither
    the message nor the memory grows with the world)."""
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    for r in (0, 1):
        edit(cap / f"rank{r}.meta.json", world_size=1048576)
    status, _, err = check_in_process(cap, tmp_path / "b", capsys)
    names = ", ".join(f"rank{r}.json" for r in range(2, 10))
    assert status == 2 and err == (
        f"{cap}: ranks [2, 3, 4, 5, 6, 7, 8, 9, ...] of a world of 1048576 are missing ({names} and 1048566 "
        "more): a rank's capture is written when the rank ends; was it killed outright (SIGKILL) or ended by "
        "os._exit?"
    )


def test_a_rank_outside_the_world_is_one_line_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rank7 of a world of 2 beside ranks 0 and 1 was judged as 3 ranks, then as 2."""
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    shutil.copy(cap / "rank1.json", cap / "rank7.json")
    shutil.copy(cap / "rank1.meta.json", cap / "rank7.meta.json")
    edit(cap / "rank7.meta.json", rank=7)
    status, out, err = check_in_process(cap, tmp_path / "b", capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"{cap / 'rank7.meta.json'}: $.rank: rank 7 of a world of 2: no such rank; remove rank7.json and "
        "rank7.meta.json, or capture the job again into a directory of its own"
    )


def test_a_rank_file_under_another_name_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rank01.json is no name a rank writes: read as rank 1 it would stand beside (or replace) rank1.json."""
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    shutil.copy(cap / "rank1.json", cap / "rank01.json")
    status, _, err = check_in_process(cap, tmp_path / "b", capsys)
    assert status == 2
    assert err == f"{cap / 'rank01.json'}: $: not a rank's file name (rank 1's is rank1.json); remove or rename it"


def test_a_malformed_job_file_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cap = hand_capture(tmp_path / "cap", monkeypatch)
    (cap / "job.json").write_text("[]")
    status, _, err = check_in_process(cap, tmp_path / "b", capsys)
    assert status == 2 and err == f"{cap / 'job.json'}: $: [] is not of type 'object'{FIX}"
    (cap / "job.json").write_text(json.dumps({"command": "x", "exit_status": "0"}))
    status, _, err = check_in_process(cap, tmp_path / "b", capsys)
    assert status == 2 and err == f"{cap / 'job.json'}: $.exit_status: '0' is not of type 'integer'{FIX}"


@pytest.mark.parametrize(
    ("command", "name"),
    [
        ("torchrun --nproc-per-node 2 train.py --config cfg.py", "train"),
        # a module run with a .py argument was named after the argument: two jobs would share a baseline
        ("python -m torch.distributed.run --nproc-per-node 2 -m mypkg.train --config cfg.py", "train"),
        ("srun python -m mypkg.pretrain", "pretrain"),
        # found by an adversarial pass: a path with a space was "no job name in the command"
        ("torchrun --nproc-per-node 2 'my jobs/my train.py' --lr 1", "my-train"),
        # a command recorded unquoted (an older commgate) with an apostrophe in an argument: a traceback
        ("python train.py --note it's", "train"),
        # every job a launcher module started was named after it: "launch", "runner" (found by an adversarial pass)
        ("python -m torch.distributed.launch --nproc-per-node 2 ddp.py", "ddp"),
        ("python -m deepspeed.launcher.runner --num_gpus 2 pretrain.py", "pretrain"),
        ("python -m accelerate.commands.launch --multi_gpu finetune.py", "finetune"),
    ],
)
def test_a_capture_s_baseline_is_named_after_the_job_s_script_or_module(command: str, name: str) -> None:
    from types import SimpleNamespace

    from commgate.run.captured import job_name

    captured = SimpleNamespace(capture=SimpleNamespace(stack={"command": command}), directory=Path("cap"))
    assert job_name(captured) == name  # type: ignore[arg-type]


def test_a_name_too_long_for_a_baseline_says_the_limit() -> None:
    from commgate.core.errors import UsageError
    from commgate.run.captured import unscripted

    with pytest.raises(UsageError, match=r"--name 'aaaa.*'\.\.\.: at most 100 letters, digits"):
        unscripted(None, "a" * 120)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
        ({"TORCHELASTIC_RUN_ID": "x", "ACCELERATE_MIXED_PRECISION": "no"}, "accelerate launch (torchrun)"),
        ({"CROSS_RANK": "0", "LOCAL_SIZE": "2"}, "deepspeed (its launcher)"),
        ({"SLURM_PROCID": "0"}, "srun"),
        ({}, "unknown (COMMGATE_CAPTURE in the environment)"),
    ],
    ids=["torchrun", "accelerate", "deepspeed", "srun", "unknown"],
)
def test_the_launcher_is_named_from_what_it_leaves_in_the_environment(
    env: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's launcher was "unknown (COMMGATE_CAPTURE in the environment)", though commgate capture had set
    that variable (found by an adversarial pass); accelerate launch was torchrun alone."""
    from commgate.run.external import ARMED_ENV, launcher

    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "CROSS_RANK", "LOCAL_SIZE", ARMED_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launcher() == said
