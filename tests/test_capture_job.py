"""Issue 28: a job commgate does not launch, captured unchanged and judged as a run is.

Real jobs under ``torchrun --nproc-per-node 2`` on CPU gloo: a plain DDP script (``tests/data/jobs``), and
nanoGPT's ``train.py`` (``tests/data/nanogpt``, fetched from github.com/karpathy/nanoGPT; see its README).
``commgate capture`` runs them; ``commgate check --scenario`` reconciles the capture with the model and the
stored baseline; planted changes to the script (an extra all-reduce, a smaller DDP bucket) fail the check
naming what changed; bad capture directories are one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
from commgate.run.external import BOOTSTRAP, CAPTURE_ENV

JOBS = Path(__file__).parent / "data" / "jobs"
NANOGPT = Path(__file__).parent / "data" / "nanogpt"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
BOUND_S = 300
"""Every job and check is bounded: a hang fails the test instead of holding the suite."""


def commgate(
    *args: str | Path, cwd: Path = JOBS, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return bounded([sys.executable, "-m", "commgate", *map(str, args)], cwd=cwd, env=env)


def bounded(cmd: list[str], *, cwd: Path, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a session of its own, killed with everything it started (torchrun, the ranks) after
    ``BOUND_S``; a test that runs out says what the command had printed and any torch build lock."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            from commgate.run.extensions import build_locks

            pytest.fail(f"{cmd} ran past {BOUND_S} s; build locks {build_locks()}\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def capture(out: Path, *script_args: str, dumps: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The DDP script captured; with ``dumps``, the Flight Recorder on and dumped there at the end as well."""
    env = None
    if dumps is not None:
        dumps.mkdir()
        env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000", TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_"))
        script_args = (*script_args, "--dump-fr")
    return commgate("capture", "-o", out, "--", *TORCHRUN, "ddp_train.py", "--steps", "3", *script_args, env=env)


def check(cap: Path, baselines: Path, *extra: str, report: Path | None = None) -> subprocess.CompletedProcess[str]:
    where = ("--report-dir", str(report)) if report else ()
    return commgate("check", cap, "--scenario", "ddp-mlp.yaml", "--baseline-dir", baselines, *where, *extra)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("capture-job")


@pytest.fixture(scope="module")
def ddp(work: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The unchanged DDP job, captured, with its Flight Recorder dumps in work/fr."""
    done = capture(work / "ddp", dumps=work / "fr")
    return work / "ddp", done


@pytest.fixture(scope="module")
def baselines(work: Path, ddp: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    """The unchanged job's baseline, stored through check --update-baselines."""
    store = work / "baselines"
    done = check(ddp[0], store, "--update-baselines")
    assert (store / "gloo" / "captured-ddp-mlp.json").is_file(), done.stdout + done.stderr
    # said, as pytest's "commgate baselines" section says it (check wrote it in silence: an adversarial pass)
    assert "baselines written:\n    captured-ddp-mlp: " in done.stdout, done.stdout
    return store


def test_the_job_runs_unchanged_and_every_rank_is_captured(ddp: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, done = ddp
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 2: 3 steps" in done.stdout and "rank 1 of 2: 3 steps" in done.stdout  # output passes through
    metas = [json.loads((out / f"rank{r}.meta.json").read_text()) for r in (0, 1)]
    assert [m["rank"] for m in metas] == [0, 1]
    assert {m["launcher"] for m in metas} == {"torchrun"}
    assert {m["world_size"] for m in metas} == {2}
    assert {m["backend"] for m in metas} == {"gloo"} and {m["requested_backend"] for m in metas} == {"gloo"}
    assert {m["steps"] for m in metas} == {3} and {m["step_marks"] for m in metas} == {"optimizer step hooks"}
    assert metas[0]["versions"]["torch"].startswith("2.")
    assert json.loads((out / "job.json").read_text())["exit_status"] == 0
    calls = json.loads((out / "rank0.json").read_text())["calls"]
    by_step = {s: [c["op"] for c in calls if c["step"] == s] for s in (-1, 0, 1, 2)}
    # DDP's construction (init), its single first bucket, the bucket rebuild's broadcasts at step 1
    assert by_step == {
        -1: ["all_gather", "broadcast", "broadcast"],
        0: ["all_reduce"],
        1: ["broadcast", "broadcast", "all_reduce"],
        2: ["all_reduce"],
    }


def test_check_reconciles_the_capture_to_zero_unexplained_bytes(
    ddp: tuple[Path, subprocess.CompletedProcess[str]], baselines: Path, work: Path
) -> None:
    done = check(ddp[0], baselines, report=work / "report")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torchrun, 2 ranks on" in done.stdout and "3 step(s) by optimizer step hooks" in done.stdout
    scenario = json.loads((work / "report" / "report.json").read_text())["scenarios"][0]
    assert scenario["status"] == "passed"
    ops = {c["op"]: c for c in scenario["collectives"]}
    assert set(ops) == {"all_reduce", "broadcast"}
    assert all(c["unexplained_bytes"] == 0 for c in ops.values())
    assert ops["all_reduce"]["measured_bytes"] == 2 * 4 * (64 * 256 + 256 + 256 * 8 + 8)  # a step: 2 ranks x fp32
    assert scenario["capture"]["stack"]["launcher"] == "torchrun"
    assert (work / "report" / "index.html").is_file()


@pytest.mark.parametrize(
    ("plant", "named"),
    [
        (["--extra-all-reduce"], "calls [steps] all_reduce fp32 4 B forward group [0, 1]: obtained 4, expected 0"),
        (["--bucket-cap-mb", "0.005"], "all_reduce fp32 74784 B backward group [0, 1]: obtained 0, expected 4"),
    ],
    ids=["extra-all-reduce", "bucket-cap-mb"],
)
def test_a_planted_change_fails_against_the_baseline_naming_it(
    plant: list[str], named: str, baselines: Path, work: Path
) -> None:
    """From the capture, and from the same run's Flight Recorder dumps placed in its steps: the same verdict."""
    out = work / plant[0].strip("-")
    assert capture(out, *plant, dumps=out.with_name(f"{out.name}-fr")).returncode == 0
    for extra in ((), ("--flight-recorder", str(out.with_name(f"{out.name}-fr")))):
        done = check(out, baselines, *extra)
        assert done.returncode == 1, done.stdout
        assert "[baseline] communication differs from the baseline" in done.stdout
        assert named in done.stdout


def test_a_plain_deepspeed_script_reconciles_and_a_smaller_bucket_fails(work: Path) -> None:
    """DeepSpeed ZeRO-1 from a script of its own: 0 unexplained bytes with the phases commgate's own ZeRO
    workload gives its calls (engine.backward's reductions, engine.step's norm and gathers); a smaller
    reduce bucket fails against the stored baseline, naming the buckets."""
    store = work / "zero-baselines"
    for name, args in (("zero", ()), ("zero-bucket", ("--reduce-bucket-size", "2048"))):
        cmd = [*TORCHRUN, "zero_train.py", *args]
        assert commgate("capture", "-o", work / name, "--", *cmd).returncode == 0
        extra = ("--update-baselines",) if name == "zero" else ()
        judge = ("check", work / name, "--scenario", "zero-mlp.yaml", "--baseline-dir", store, "--report-dir")
        done = commgate(*judge, work / f"{name}-report", *extra)
        scenario = json.loads((work / f"{name}-report" / "report.json").read_text())["scenarios"][0]
        if name == "zero":
            assert done.returncode == 0, done.stdout + done.stderr
            assert {c["op"]: c["unexplained_bytes"] for c in scenario["collectives"]} == {
                "all_gather": 0,
                "all_reduce": 0,
            }
            phases = {c["phase"] for c in scenario["capture"]["calls"] if c["step"] >= 0}
            assert phases == {"backward", "optimizer"}
        else:
            assert done.returncode == 1
            assert "all_reduce fp32 9248 B backward group [0, 1]: obtained 0, expected 4" in done.stdout


def test_commgate_capture_in_the_environment_with_explicit_steps(work: Path, baselines: Path) -> None:
    """A launcher commgate does not wrap: COMMGATE_CAPTURE and the bootstrap on PYTHONPATH; the script marks
    its steps with commgate.capture.step(). The capture judges as the wrapped one does."""
    out = work / "env"
    env = dict(os.environ, **{CAPTURE_ENV: str(out), "PYTHONPATH": str(BOOTSTRAP)})
    cmd = [*TORCHRUN, "ddp_train.py", "--steps", "3", "--mark-steps"]
    done = bounded(cmd, cwd=JOBS, env=env)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "rank1.meta.json").read_text())
    assert meta["step_marks"] == "commgate.capture.step()" and meta["steps"] == 3
    assert not (out / "job.json").exists()
    judged = check(out, baselines)
    assert judged.returncode == 0, judged.stdout + judged.stderr


def test_a_failing_job_keeps_its_exit_status_and_leaves_a_readable_capture(work: Path) -> None:
    out = work / "failing"
    done = capture(out, "--fail-at", "1")
    assert done.returncode == 1
    assert "planted failure at step 1" in done.stderr
    ended = {json.loads((out / f"rank{r}.meta.json").read_text())["ended"] for r in (0, 1)}
    assert "raised RuntimeError" in ended
    from commgate.run.captured import load

    captured = load(out)
    assert captured.exit_status == 1 and captured.steps in (1, 2)  # step 1 begun on rank 0 only, or on neither
    assert {c.rank for c in captured.capture.calls} == {0, 1}
    judged = check(out, work / "unused-baselines")  # fewer steps than the scenario: one line
    assert judged.returncode == 2
    assert judged.stderr.strip().count("\n") == 0 and f"holds {captured.steps} step(s)" in judged.stderr


def test_a_job_that_failed_after_its_last_call_is_not_judged(work: Path) -> None:
    """Rank 0 exits with status 3 once its calls are done (a checkpoint save that fails): the job's calls agree
    and its steps are the scenario's, and it passed the gate (found by an adversarial pass). A failed job is an
    error of its run, as a live run's is, and no baseline is written from it."""
    out = work / "crashed"
    job = capture(out, "--exit-after", "3")
    assert job.returncode == 1, job.stdout + job.stderr  # torchrun's status for a failed rank
    report, store = work / "crashed-report", work / "crashed-baselines"
    judged = check(out, store, "--update-baselines", report=report)
    assert judged.returncode == 1, judged.stdout + judged.stderr
    says = f"{out}: the job exited with status 1 (job.json): a failed job is not judged; its output says why"
    assert says in judged.stdout, judged.stdout
    (scenario,) = json.loads((report / "report.json").read_text())["scenarios"]
    assert scenario["status"] == "error" and "a failed job is not judged" in scenario["reason"], scenario
    assert not store.exists() or not any(store.rglob("*.json"))


def assert_one_line(done: subprocess.CompletedProcess[str], file: Path, says: str) -> None:
    """Bad input: one line on stderr, starting with the file it names, saying ``says``; no traceback."""
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(str(file)) and says in line, line


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _drop_rank1(d: Path) -> None:
    (d / "rank1.json").unlink()


def _mix_jobs(d: Path) -> None:
    meta = json.loads((d / "rank1.meta.json").read_text())
    (d / "rank1.meta.json").write_text(json.dumps(meta | {"job": "another"}))


def _truncate(d: Path) -> None:
    text = (d / "rank0.json").read_text()
    (d / "rank0.json").write_text(text[: len(text) // 2])


def _bad_op(d: Path) -> None:
    doc = json.loads((d / "rank1.json").read_text())
    doc["calls"][0]["op"] = "all_reduce_v2"
    (d / "rank1.json").write_text(json.dumps(doc))


def _edit_call(**changes: object) -> Callable[[Path], None]:
    """A hand edit of rank 1's first call (``seq`` copied from its second call where given as "next")."""

    def spoil(d: Path) -> None:
        doc = json.loads((d / "rank1.json").read_text())
        call = doc["calls"][0]
        call.update({k: doc["calls"][1][k] if v == "next" else v for k, v in changes.items()})
        (d / "rank1.json").write_text(json.dumps(doc))

    return spoil


@pytest.mark.parametrize(
    ("spoil", "file", "says"),
    [
        (lambda d: shutil.rmtree(d), "", "not a directory"),
        (lambda d: [p.unlink() for p in d.iterdir()], "", "not a capture: no rank<N>.json"),
        (_drop_rank1, "", "ranks [1] of a world of 2 are missing (rank1.json)"),
        (_mix_jobs, "rank1.meta.json", "two jobs' captures in one directory"),
        (_truncate, "rank0.json", "not valid JSON"),
        (_bad_op, "rank1.json", "$.calls[0].op"),
        (_edit_call(bytes=1e308), "rank1.json", "$.calls[0].bytes"),
        (_edit_call(bytes=10**30), "rank1.json", "$.calls[0].bytes"),
        (_edit_call(seq="next"), "rank1.json", "$.calls[1].seq: sequence number 1 a second time"),
        (_edit_call(rank=0), "rank1.json", "$.calls[0].rank: a call of rank 0 in rank 1's file"),
        (_edit_call(group=[1, 5]), "rank1.json", "$.calls[0].group: group [1, 5]: not distinct ranks of a world of 2"),
        (_edit_call(peer=7), "rank1.json", "$.calls[0].peer: peer 7: not another rank"),
        (_edit_call(step=99), "rank1.json", "$.calls[0].step: step 99, past the rank's last step window (2)"),
    ],
    ids=[
        *("missing", "empty", "rank-missing", "two-jobs", "truncated", "bad-op"),
        *("bytes-float", "bytes-huge", "seq-twice", "other-rank", "group-outside", "peer-outside", "step-past"),
    ],
)
def test_bad_capture_directories_are_one_line_naming_the_file(
    spoil: Callable[[Path], object],
    file: str,
    says: str,
    ddp: tuple[Path, subprocess.CompletedProcess[str]],
    tmp_path: Path,
) -> None:
    """The last seven were found by an adversarial pass: a byte count of 1e308 was a traceback, one of 10**30
    was judged, and a call another rank issued, numbered twice, of a group outside the world or of step 99
    (left out in silence) was taken as the rank's own."""
    d = _copy(ddp[0], tmp_path / "cap")
    spoil(d)
    done = check(d, tmp_path / "baselines")
    assert done.returncode == 2 and done.stdout.strip() == ""
    assert_one_line(done, d / file, says)
    assert not (tmp_path / "baselines").exists()  # nothing written


def test_capture_refuses_a_directory_that_holds_a_capture(ddp: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    before = sorted(p.name for p in ddp[0].iterdir())
    done = commgate("capture", "-o", ddp[0], "--", sys.executable, "-c", "print('ran')")
    assert done.returncode == 2 and "ran" not in done.stdout
    assert "holds a capture" in done.stderr and "\n" not in done.stderr.strip()
    assert sorted(p.name for p in ddp[0].iterdir()) == before
    a_file = ddp[0] / "rank0.json"  # a file is said as one (it said "holds a capture (or is not a directory)")
    done = commgate("capture", "-o", a_file, "--", sys.executable, "-c", "print('ran')")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"commgate: error: capture: {a_file} is a file, not a directory; give a new directory"
    ), done.stderr


def capture_nanogpt(job: Path, **how: Any) -> None:
    """nanoGPT's train.py made ready in ``job`` (``tests/data/nanogpt/job.py``; ``how``: its ``nproc``,
    ``backend``) and captured to ``job/capture``; it ran to the end, its own log passed through."""
    sys.path.insert(0, str(NANOGPT))
    try:
        from job import nanogpt_job
    finally:
        sys.path.remove(str(NANOGPT))
    done = commgate("capture", "-o", job / "capture", "--", *nanogpt_job(job, **how), cwd=job)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iter 2: loss" in done.stdout  # nanoGPT's own log, passed through


def every_op_is_recorded(out: Path, torchrun: list[str], world: int, *script_args: str, rounds: int = 1) -> None:
    """``tests/data/jobs/every_op.py`` captured: each collective a job can call, async and sync, recorded once
    in the order called (``rounds`` times: once a device), ended, with its bytes (64 float32 elements a tensor;
    an all-gather's output is the world's, and so are a gather's and a scatter's on every rank: a gather was
    recorded at the rank's own 256 B, its input, where a scatter was recorded whole)."""
    done = commgate("capture", "-o", out, "--", *torchrun, "every_op.py", *script_args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ops = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather", "reduce_scatter", "all_to_all"]
    ops += ["gather", "scatter", "barrier"]
    size = {"all_gather": 256 * world, "gather": 256 * world, "scatter": 256 * world, "barrier": 0}
    for rank in range(world):
        calls = json.loads((out / f"rank{rank}.json").read_text())["calls"]
        assert [(c["op"], c["bytes"]) for c in calls] == [(op, size.get(op, 256)) for op in ops for _ in "as"] * rounds
        assert [c for c in calls if c["duration_ns"] is None] == []


def test_every_op_a_job_calls_is_recorded_once_ended(work: Path) -> None:
    every_op_is_recorded(work / "every-op", TORCHRUN, 2)
    meta = json.loads((work / "every-op" / "rank0.meta.json").read_text())
    assert meta["steps"] == 0 and meta["step_marks"].startswith("nothing (no module forward, no optimizer step")


def test_a_job_without_an_optimizer_is_one_step_said_so(work: Path) -> None:
    """No optimizer step: the first module forward began the only step, which the capture says, with the call
    that marks steps (it said "1 step(s) by optimizer step hooks" of such a job: an adversarial pass)."""
    done = capture(work / "no-optimizer", "--no-optimizer")
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((work / "no-optimizer" / "rank1.meta.json").read_text())
    assert meta["steps"] == 1, meta
    assert meta["step_marks"].startswith("its first module forward alone (no optimizer step"), meta
    assert "commgate.capture.step() in the job marks them" in meta["step_marks"]


def test_nanogpt_ddp_is_captured_and_reconciled_to_zero_unexplained_bytes(work: Path) -> None:
    job = work / "nanogpt"
    capture_nanogpt(job)
    args = ("check", job / "capture", "--scenario", "nanogpt-ddp.yaml", "--baseline-dir", job / "baselines")
    judged = commgate(*args, "--update-baselines", "--report-dir", job / "report", cwd=job)
    assert (job / "baselines" / "gloo" / "nanogpt-ddp.json").is_file(), judged.stdout + judged.stderr
    scenario = json.loads((job / "report" / "report.json").read_text())["scenarios"][0]
    ops = {c["op"]: c for c in scenario["collectives"]}
    assert ops["all_reduce"]["measured_bytes"] > 0
    assert all(c["unexplained_bytes"] == 0 for c in ops.values()), ops
    again = commgate(*args, cwd=job)
    assert again.returncode == 0, again.stdout + again.stderr


def test_flight_recorder_dumps_of_the_same_run_give_the_capture_s_verdict(
    ddp: tuple[Path, subprocess.CompletedProcess[str]], baselines: Path, work: Path
) -> None:
    """Both forms torch writes (pickle, JSON) read into the capture's records; every dumped call is a captured
    one; judged in the capture's steps, the verdict is the capture's; what a dump cannot tell is said."""
    json_form = work / "fr-json"
    json_form.mkdir()
    for f in (work / "fr").glob("fr_*.json"):
        shutil.copy(f, json_form / f.name)
    for dumps in (work / "fr", json_form):
        done = check(ddp[0], baselines, "--flight-recorder", str(dumps), report=work / f"report-{dumps.name}")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "every one of the dumps' 16 calls is a captured call" in done.stdout
        assert "version 2.10: 2 all_gather, 6 all_reduce, 8 broadcast" in done.stdout
        assert "durations: 16 of 16 calls untimed" in done.stdout
        assert "point-to-point: gloo records no send/recv" in done.stdout
        scenario = json.loads((work / f"report-{dumps.name}" / "report.json").read_text())["scenarios"][0]
        assert all(c["unexplained_bytes"] == 0 for c in scenario["collectives"])
    alone = commgate("check", "--flight-recorder", work / "fr")
    assert alone.returncode == 0 and "the ranks agree on every call the dumps hold (16 calls)" in alone.stdout


def _fr_version(d: Path) -> None:
    import pickle

    doc = pickle.loads((d / "fr_1").read_bytes())
    (d / "fr_1").write_bytes(pickle.dumps(doc | {"version": "9.9"}))


def _fr_truncate(d: Path) -> None:
    data = (d / "fr_0").read_bytes()
    (d / "fr_0").write_bytes(data[: len(data) // 2])


def _fr_diverge(d: Path) -> None:
    import pickle

    doc = pickle.loads((d / "fr_1").read_bytes())
    doc["entries"][-1]["input_sizes"] = [[3]]
    doc["entries"][-1]["output_sizes"] = [[3]]
    (d / "fr_1").write_bytes(pickle.dumps(doc))


def _fr_infinite(d: Path) -> None:
    import pickle

    doc = pickle.loads((d / "fr_1").read_bytes())
    doc["entries"][0]["duration_ms"] = float("inf")
    (d / "fr_1").write_bytes(pickle.dumps(doc))


def _fr_nested(d: Path) -> None:
    import pickle

    doc = pickle.loads((d / "fr_0").read_bytes())
    deep: list[Any] = [1]
    for _ in range(5000):
        deep = [deep]
    doc["entries"][0]["input_sizes"] = deep
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        (d / "fr_0").write_bytes(pickle.dumps(doc))
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize(
    ("spoil", "file", "says", "status"),
    [
        (lambda d: (d / "fr_0").unlink(), "", "ranks [0] have no dump", 2),
        # tracebacks (found by an adversarial pass): OverflowError, RecursionError
        (_fr_infinite, "fr_1", "duration_ms inf: not a duration (not as torch writes a dump)", 2),
        (_fr_nested, "fr_0", "not as torch writes a dump (RecursionError: values beyond any dump's)", 2),
        (_fr_version, "fr_1", "dump version '9.9' is not one commgate reads", 2),
        (_fr_truncate, "fr_0", "not a complete Flight Recorder dump (pickle", 2),
        (lambda d: [p.unlink() for p in d.iterdir()], "", "no Flight Recorder dump here", 2),
        (_fr_diverge, None, "the ranks' calls part: in step 0, call #8 on group [0, 1]", 1),
    ],
    ids=["rank-missing", "infinite", "nested", "version", "truncated", "empty", "diverged"],
)
def test_bad_flight_recorder_dumps_are_one_line_naming_the_file(
    spoil: Callable[[Path], object],
    file: str | None,
    says: str,
    status: int,
    work: Path,
    tmp_path: Path,
    ddp: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    d = _copy(work / "fr", tmp_path / "fr")
    for p in d.glob("*.json"):
        p.unlink()
    spoil(d)
    done = commgate("check", "--flight-recorder", d)
    assert done.returncode == status, done.stdout + done.stderr
    if file is None:  # a verdict, not bad input: the first divergence, named as the stall watchdog names it
        assert says in done.stdout
        return
    assert_one_line(done, d / file, says)


def test_dumps_of_some_ranks_in_one_form_and_some_in_the_other_are_refused(
    work: Path, tmp_path: Path, ddp: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    """Rank 0's dump as a pickle alone and rank 1's as JSON alone: rank 1 was left out and the verdict was
    "the ranks agree" on rank 0's calls (found by an adversarial pass)."""
    d = _copy(work / "fr", tmp_path / "fr")
    (d / "fr_0.json").unlink()
    (d / "fr_1").unlink()
    done = commgate("check", "--flight-recorder", d)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dumps of some ranks in one form and some in the other (ranks [0] as pickle; ranks [1] as JSON)" in (
        done.stderr
    )


def test_gloos_reduce_scatter_in_a_dump_is_the_captured_one(work: Path) -> None:
    """gloo runs, and its Flight Recorder records, reduce_scatter as an all_reduce of the input: each such
    dumped call is still matched to the captured reduce_scatter, and the dumps say what they record."""
    out = work / "reduce-scatter"
    assert capture(out, "--reduce-scatter", dumps=work / "fr-rs").returncode == 0
    done = commgate("check", out, "--flight-recorder", work / "fr-rs", "--baseline-dir", work / "rs-baselines")
    assert "every one of the dumps' 22 calls is a captured call" in done.stdout, done.stdout + done.stderr
    assert "reduce_scatter: gloo runs, and records, its reduce_scatter as an all_reduce of the input" in done.stdout
    captured = json.loads((out / "rank0.json").read_text())["calls"]
    assert sum(c["op"] == "reduce_scatter" for c in captured) == 3


def test_a_gather_and_a_scatter_are_the_whole_message_on_every_rank_captured_and_dumped(work: Path) -> None:
    """A gather was recorded at the rank's own shard (its input: 1/n of the message) where a scatter was
    recorded whole, and a dump off the root holds one side alone: found by an adversarial pass. Captured and
    dumped, both are the world's 16 floats a rank on every rank, the dumped calls the captured ones."""
    out = work / "gather-scatter"
    assert capture(out, "--gather-scatter", dumps=work / "fr-gs").returncode == 0
    for rank in range(2):
        calls = json.loads((out / f"rank{rank}.json").read_text())["calls"]
        rooted = [(c["op"], c["bytes"], c["root"]) for c in calls if c["op"] in ("gather", "scatter")]
        assert rooted == [("gather", 128, 0), ("scatter", 128, 0)] * 3, rank
    done = commgate("check", out, "--flight-recorder", work / "fr-gs", "--baseline-dir", work / "gs-baselines")
    assert "every one of the dumps' 28 calls is a captured call" in done.stdout, done.stdout + done.stderr
    alone = commgate("check", "--flight-recorder", work / "fr-gs")
    assert alone.returncode == 0 and "the ranks agree on every call the dumps hold (28 calls)" in alone.stdout


def test_a_hung_jobs_dumps_name_the_call_one_rank_never_issued(work: Path) -> None:
    """A real hang: rank 0 blocks in an all_reduce rank 1 never issues, and dumps its Flight Recorder while
    stuck (a thread, once the call is recorded); the job fails through the capture, and the dumps alone name
    the first call the ranks part on, as the stall watchdog names it."""
    out, dumps = work / "hung", work / "fr-hung"
    job = capture(out, "--hang-at-end", dumps=dumps)
    assert job.returncode != 0 and "Flight Recorder dumped" in job.stdout, job.stdout + job.stderr
    assert sorted(p.name for p in dumps.iterdir()) == ["fr_0", "fr_0.json", "fr_1", "fr_1.json"]
    done = commgate("check", "--flight-recorder", dumps)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 never issued all_reduce #" in done.stdout and "(8192 B, group [0, 1])" in done.stdout
    assert "rank 0: " in done.stdout and "scheduled" in done.stdout  # its entries' states, the stuck one too


def test_a_capture_whose_ranks_part_fails_check(work: Path) -> None:
    """Rank 0 issues an all_reduce rank 1 never does (rank 1 ends, and rank 0's call fails): judged against
    its own baseline, the capture passed (found by an adversarial pass). check names where the ranks part.
    The failed call is in rank 0's capture as never completed; it was recorded as completed, with the time
    it took to fail (found by the same pass)."""
    out = work / "part"
    job = capture(out, "--part")
    assert job.returncode != 0 and (out / "rank0.json").is_file() and (out / "rank1.json").is_file(), job.stderr
    last = json.loads((out / "rank0.json").read_text())["calls"][-1]
    assert (last["op"], last["bytes"], last["duration_ns"]) == ("all_reduce", 12, None)
    report = work / "part-report"
    judged = commgate(
        "check", out, "--name", "part", "--baseline-dir", work / "part-baselines", "--update-baselines",
        "--report-dir", report,
    )  # fmt: skip
    assert judged.returncode == 1, judged.stdout + judged.stderr
    assert "the ranks' calls part: " in judged.stdout and "rank 1 never issued all_reduce" in judged.stdout
    # the report says what the exit status does (it said passed while check exited 1: found by a review)
    (scenario,) = json.loads((report / "report.json").read_text())["scenarios"]
    assert scenario["status"] == "error" and "rank 1 never issued all_reduce" in scenario["reason"], scenario
    assert not (work / "part-baselines").exists() or not any((work / "part-baselines").rglob("*.json"))


FR_VERSIONS = Path(__file__).parent / "data" / "flight_recorder"


@pytest.mark.parametrize(
    ("torch_version", "dump_version", "says", "status"),
    [
        ("2.4.1", "2.1", "before dump version 2.9 (torch 2.8) the Flight Recorder records NCCL's calls only", 1),
        ("2.6.0", "2.4", "before dump version 2.9 (torch 2.8) the Flight Recorder records NCCL's calls only", 1),
        ("2.8.0", "2.9", "the ranks agree on every call the dumps hold (30 calls)", 0),
        ("2.12.1", "2.10", "the ranks agree on every call the dumps hold (30 calls)", 0),
    ],
)
def test_dumps_of_older_torch_versions_are_read_or_say_why_they_hold_nothing(
    torch_version: str, dump_version: str, says: str, status: int
) -> None:
    """Regression fixtures: real dumps of a 2-rank gloo job under torch 2.4 to 2.12 (provenance in the
    folder's README); torch 2.13's are made fresh by the tests above. Both forms torch writes, where it has
    them; before torch 2.8 a gloo job's dump is empty, and that is said, not passed as agreement."""
    folder = FR_VERSIONS / f"torch-{torch_version}"
    forms = [d for d in (folder / "pickle", folder / "json") if d.is_dir()]
    assert forms
    for form in forms:
        done = commgate("check", "--flight-recorder", form)
        assert done.returncode == status, done.stdout + done.stderr
        assert f"version {dump_version}:" in done.stdout and says in done.stdout


NCCL_DUMP = FR_VERSIONS / "torch-2.11.0-nccl"


def test_a_real_nccl_dump_is_read_with_its_groups_and_gpu_durations(work: Path) -> None:
    """Regression fixture: NCCL's recorder of a one-rank DDP job on an H200 (torch 2.11, NCCL 2.28.9), timed
    (``TORCH_NCCL_ENABLE_TIMING=1``), with the job's capture (README beside it; ``tests/test_capture_nccl.py``
    makes them fresh on a GPU). The group's ranks come from ``pg_config`` (keyed by the group's name, not its
    description); a duration is the recorder's ``duration_ms`` (CUDA events), not the watchdog's discovery
    times; the calls not retired when dumped are said untimed, for that reason."""
    import pickle

    from commgate.run.flightrec import read

    raw = pickle.loads((NCCL_DUMP / "pickle" / "fr_0").read_bytes())["entries"]
    for form in ("pickle", "json"):
        dumps = read(NCCL_DUMP / form)
        assert [c.group for c in dumps.calls] == [(0,)] * 8
        assert [c.duration_ns for c in dumps.calls] == [
            round(e["duration_ms"] * 1e6) if "duration_ms" in e else None for e in raw
        ]
        assert sum(c.duration_ns is not None for c in dumps.calls) == 3
        assert "durations: 5 of 8 calls untimed (not retired when dumped)" in dumps.notes
        assert not [n for n in dumps.notes if n.startswith("groups:")], dumps.notes
    done = commgate(
        "check", NCCL_DUMP / "capture", "--flight-recorder", NCCL_DUMP / "pickle", "--baseline-dir", work / "nccl-b"
    )
    assert "every one of the dumps' 8 calls is a captured call" in done.stdout, done.stdout + done.stderr
    assert "backend nccl" in done.stdout


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("duration_ms", "abc", "$.entries[0].duration_ms: 'abc' is not of type 'number', 'null'"),
        ("duration_ms", -3.0, "$.entries[0].duration_ms: -3.0 is less than the minimum of 0"),
        ("time_created_ns", "x", "$.entries[0].time_created_ns: 'x' is not of type 'integer', 'null'"),
        ("input_sizes", 5, "$.entries[0].input_sizes: 5 is not of type 'array'"),
        ("process_group", None, "$.entries[0].process_group: None is not valid under any of the given schemas"),
        ("ranks", "garbage", "$.pg_config.0.ranks: ranks 'garbage': not a list of ranks"),
        # read in silence before (found by an adversarial pass): the shapes past the shorter list were dropped
        ("input_dtypes", [], "$.entries[0]: 1 shape(s) but 0 dtype(s): one a tensor"),
        ("input_sizes", [[4], [4]], "$.entries[0]: 2 shape(s) but 1 dtype(s): one a tensor"),
    ],
)
def test_a_dump_with_a_field_torch_never_writes_is_one_line(
    tmp_path: Path, field: str, value: object, says: str
) -> None:
    """A mistyped field of a real NCCL dump (an entry's, or a group's ranks) is one line naming the file and the
    place, never a traceback from deep in the reader."""
    import pickle

    from commgate.core.errors import DocumentError
    from commgate.run.flightrec import read

    doc = pickle.loads((NCCL_DUMP / "pickle" / "fr_0").read_bytes())
    if field == "ranks":
        doc["pg_config"]["0"]["ranks"] = value
    else:
        doc["entries"][0][field] = value
    (tmp_path / "fr_0").write_bytes(pickle.dumps(doc))
    with pytest.raises(DocumentError) as exc:
        read(tmp_path)
    assert str(exc.value) == f"{tmp_path / 'fr_0'}: {says} (not as torch writes a dump)"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("input_dtypes", ["Float", "Bogus"], "$.entries[0]: dtype 'Bogus' is not one commgate reads"),
        ("ranks", "[0, 5, 6]", "$.pg_config.0.ranks: group '0' holds ranks [5, 6], which have no dump (found 1: ranks"),
    ],
    ids=["second-dtype-unknown", "group-past-the-dumps"],
)
def test_a_dump_that_names_what_commgate_cannot_see_is_one_line(
    tmp_path: Path, field: str, value: object, says: str
) -> None:
    """An unknown dtype on a call's second tensor was counted at the first's size, and a group holding ranks
    no dump came from was judged as if they had issued nothing (found by an adversarial pass)."""
    import pickle

    from commgate.core.errors import DocumentError
    from commgate.run.flightrec import read

    doc = pickle.loads((NCCL_DUMP / "pickle" / "fr_0").read_bytes())
    if field == "ranks":
        doc["pg_config"]["0"]["ranks"] = value
    else:
        doc["entries"][0] |= {"input_sizes": [[4], [4]], field: value}
    (tmp_path / "fr_0").write_bytes(pickle.dumps(doc))
    with pytest.raises(DocumentError) as exc:
        read(tmp_path)
    assert str(exc.value).startswith(f"{tmp_path / 'fr_0'}: {says}"), str(exc.value)


def test_two_dumps_that_disagree_on_a_groups_ranks_are_one_line(tmp_path: Path) -> None:
    """Each dump lists the job's groups (``pg_config``); the last one read decided a group's ranks, and the
    others were not looked at (found by a review). Two jobs' dumps in one folder disagree: one line."""
    import pickle

    from commgate.core.errors import DocumentError
    from commgate.run.flightrec import read

    for rank, ranks in ((0, "[0, 1]"), (1, "[1]")):
        doc = pickle.loads((FR_VERSIONS / "torch-2.12.1" / "pickle" / f"fr_{rank}").read_bytes())
        doc["pg_config"]["7"] = {"name": "7", "desc": "tp", "ranks": ranks}
        (tmp_path / f"fr_{rank}").write_bytes(pickle.dumps(doc))
    with pytest.raises(DocumentError) as exc:
        read(tmp_path)
    assert str(exc.value) == (
        f"{tmp_path / 'fr_1'}: $.pg_config.7.ranks: group '7' holds ranks [1], but {tmp_path / 'fr_0'} lists [0, 1]; "
        "the dumps are of two jobs: dump one job's ranks into one folder"
    )


def test_the_fixtures_script_records_the_same_calls_under_this_torch(tmp_path: Path) -> None:
    """The script that made the fixtures (``make_dump.py``), run fresh under the installed torch: its dumps
    hold the very calls torch 2.8's and 2.12's hold, op for op."""
    from commgate.run.flightrec import read

    done = bounded([sys.executable, str(FR_VERSIONS / "make_dump.py"), str(tmp_path / "now")], cwd=tmp_path, env=None)
    assert done.returncode == 0, done.stdout + done.stderr

    def calls(d: Path) -> list[tuple[object, ...]]:
        return [(c.rank, str(c.op), c.group, c.dtype, c.bytes) for c in read(d).calls]

    fresh = calls(tmp_path / "now" / "pickle")
    assert len(fresh) == 30
    for old in ("2.8.0", "2.12.1"):
        assert calls(FR_VERSIONS / f"torch-{old}" / "pickle") == fresh, old


def test_a_dump_that_names_a_python_object_is_refused_unread(tmp_path: Path) -> None:
    """A pickle that would call ``os.system`` as it loads ran it (found by an adversarial pass): a dump is
    torch's pickle of plain containers, so one naming any other object is refused before it is built; torch's
    own container builders (``torch.jit._pickle``) still load."""
    import pickle

    from commgate.core.errors import DocumentError
    from commgate.run.flightrec import read

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "fr_0").write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": [], "x": Payload()}))
    with pytest.raises(DocumentError) as info:
        read(bad)
    assert not marker.exists()
    assert str(info.value) == (
        f"{bad / 'fr_0'}: $: not a Flight Recorder dump: the pickle names posix.system, which a dump never holds "
        "(refused, not run)"
    )
    good = tmp_path / "good"
    good.mkdir()
    sizes = b"ctorch.jit._pickle\nbuild_intlist\n]K\x03a\x85R"  # build_intlist([3]), as torch's C++ pickler names it
    body = b"\x80\x02}(X\x07\x00\x00\x00versionX\x04\x00\x00\x002.10X\x07\x00\x00\x00entries]X\x01\x00\x00\x00s" + sizes
    (good / "fr_0").write_bytes(body + b"u.")
    assert read(good).calls == ()  # loaded: a dump of no calls


def signalled_when_ready(out: Path, flag: str, ready: Path, signum: int, settle_s: float = 0) -> tuple[int, str]:
    """``ddp_train.py --steps 2 FLAG READY`` captured to ``out``; once both ranks have touched their file in
    ``ready`` (and ``settle_s`` later), ``signum`` to ``commgate capture``: its exit status and stderr."""
    import time

    cmd = [sys.executable, "-m", "commgate", "capture", "-o", str(out), "--", *TORCHRUN, "ddp_train.py", "--steps", "2",
           flag, str(ready)]  # fmt: skip
    with subprocess.Popen(cmd, cwd=JOBS, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True) as p:
        try:
            deadline = time.monotonic() + BOUND_S
            while len(list(ready.iterdir())) < 2 and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)  # both ranks past their steps, waiting for the signal
            assert len(list(ready.iterdir())) == 2, p.communicate(timeout=BOUND_S)
            time.sleep(settle_s)
            p.send_signal(signum)
            _, err = p.communicate(timeout=BOUND_S)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM], ids=["int", "hup", "term"])
def test_an_interrupted_capture_waits_for_the_job_and_keeps_every_ranks_capture(work: Path, signum: int) -> None:
    """``kill -INT`` to ``commgate capture`` left torchrun and its ranks running (orphans, no job.json); a
    SIGHUP (a closed terminal) was passed on to ranks that died of it unwritten: 0 rank files (found by an
    adversarial pass). Each is passed on, and the capture ends with the job, every rank's file written."""

    name = signal.Signals(signum).name.lower()
    out, ready = work / f"interrupted-{name}", work / f"ready-{name}"
    ready.mkdir()
    status, err = signalled_when_ready(out, "--linger", ready, signum)
    assert status != 0 and f"commgate capture: 2 rank file(s) in {out}" in err, err  # the job's own tracebacks
    from commgate.run.captured import load

    captured = load(out)  # job.json and both ranks' files
    assert captured.exit_status == status and captured.steps == 2, err
    left = subprocess.run(["pgrep", "-f", f"--linger {ready}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the job left running: {left}"


def test_ranks_blocked_inside_gloo_keep_their_capture_when_the_job_is_terminated(work: Path) -> None:
    """Both ranks waiting in gloo on each other: a Python signal handler never ran in a rank blocked in a call,
    so SIGTERM was ignored until torchrun's SIGKILL 30 s later and both captures were lost (found by an
    adversarial pass). Each rank writes its capture as it is terminated, how it ended said."""
    out, ready = work / "deadlock", work / "ready-deadlock"
    ready.mkdir()
    _, err = signalled_when_ready(out, "--deadlock", ready, signal.SIGTERM, settle_s=3)  # into the blocking call
    assert f"commgate capture: 2 rank file(s) in {out}" in err, err
    for rank in range(2):
        meta = json.loads((out / f"rank{rank}.meta.json").read_text())
        assert meta["ended"] == f"terminated by signal {int(signal.SIGTERM)}", meta["ended"]
    assert [f.name for f in out.iterdir() if f.name.endswith(".tmp")] == []


def test_a_jobs_own_sigterm_handler_is_left_to_finish(work: Path) -> None:
    """The watcher that writes a blocked rank's capture acts only while commgate's handler is the rank's: a
    job's own graceful shutdown on SIGTERM (a checkpoint on preemption) that takes longer than its grace is
    not cut short, and the capture is written as the job exits."""
    out, ready = work / "own-sigterm", work / "ready-own-sigterm"
    ready.mkdir()
    signalled_when_ready(out, "--own-sigterm", ready, signal.SIGTERM)
    assert sorted(f.name for f in ready.iterdir()) == ["graceful0", "graceful1", "ready0", "ready1"]
    for rank in range(2):
        assert json.loads((out / f"rank{rank}.meta.json").read_text())["ended"] == "exited"


@pytest.mark.parametrize(
    ("flag", "says"),
    [("--os-exit", "os._exit and SIGKILL skip"), ("--no-init", "never set up a process group")],
    ids=["os-exit", "no-init"],
)
def test_a_job_that_leaves_no_capture_says_why(work: Path, flag: str, says: str) -> None:
    """A job ending by ``os._exit`` was "0 rank file(s)", and check said "not a capture"; one that never
    called init_process_group was "$.backend: None is not of type 'string'; capture the job again" (found by
    an adversarial pass): each says what happened."""
    out = work / f"nothing{flag}"
    done = commgate("capture", "-o", out, "--", *TORCHRUN, "ddp_train.py", "--steps", "1", flag)
    assert done.returncode == 0, done.stderr
    judged = commgate("check", out, "--scenario", "ddp-mlp.yaml", "--baseline-dir", work / "unused")
    assert judged.returncode == 2 and "Traceback" not in judged.stderr
    assert says in judged.stderr and "\n" not in judged.stderr.strip(), judged.stderr
    if flag == "--os-exit":
        assert says in done.stderr


def test_a_process_a_rank_starts_leaves_the_rank_s_capture_alone(work: Path) -> None:
    """Rank 1 starts a Python process that outlives it (a DataLoader worker, a ``subprocess``). It inherits
    ``RANK`` and ``COMMGATE_CAPTURE``, and its capture, written as it ended, replaced rank 1's: "the rank never
    set up a process group" (found by an adversarial pass). Once it has ended, rank 1's capture is the rank's."""
    out, ended = work / "child", work / "child-ended"
    done = capture(out, "--spawn-child", str(ended))
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + BOUND_S
    while not (ended.exists() and ended.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = Path(f"/proc/{ended.read_text()}/stat")
    while child.exists() and ") Z " not in child.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)  # until it has exited, its exit handlers run
    assert not child.exists() or ") Z " in child.read_text(), f"the rank's child did not end within {BOUND_S} s"
    calls = json.loads((out / "rank1.json").read_text())["calls"]
    assert any(c["op"] == "all_reduce" for c in calls)
    assert json.loads((out / "rank1.meta.json").read_text()).get("not_captured") is None


def test_a_relative_capture_directory_stays_where_the_job_started(work: Path) -> None:
    """``COMMGATE_CAPTURE=relcap`` and a job that changes directory after it starts: the capture went to
    ``/relcap`` (found by an adversarial pass). It goes where the job was started, as the user meant."""
    started = work / "relative"
    started.mkdir()
    env = dict(os.environ, **{CAPTURE_ENV: "relcap", "PYTHONPATH": str(BOOTSTRAP)})
    cmd = [*TORCHRUN, str(JOBS / "ddp_train.py"), "--steps", "2", "--chdir", str(work)]
    done = bounded(cmd, cwd=started, env=env)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (started / "relcap").iterdir()} >= {"rank0.json", "rank1.json"}
    assert not (work / "relcap").exists()


def test_a_capture_directory_a_rank_cannot_write_is_said_as_it_starts(work: Path) -> None:
    """``COMMGATE_CAPTURE`` where nothing can be written: the job ran to its end, then each rank printed an
    ``OSError`` traceback at exit and the capture was lost (found by an adversarial pass). Each rank says so
    in one line as it starts, and the job runs as it would uncaptured."""
    blocked = work / "a-file"
    blocked.write_text("")
    env = dict(os.environ, **{CAPTURE_ENV: str(blocked / "cap"), "PYTHONPATH": str(BOOTSTRAP)})
    done = bounded([*TORCHRUN, "ddp_train.py", "--steps", "2"], cwd=JOBS, env=env)
    for rank in (0, 1):
        says = f"commgate: {blocked / 'cap'}: cannot write rank {rank}'s capture there: {blocked} is not a directory"
        assert says in done.stderr, done.stderr
        assert f"rank {rank} of 2: 2 steps" in done.stdout, done.stdout + done.stderr
    assert "OSError" not in done.stderr and "commgate/run/" not in done.stderr, done.stderr
    if not torch_s_own_abort_at_exit(done):
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr


def test_a_launch_script_that_sets_its_own_pythonpath_is_told_to_keep_the_bootstrap(work: Path) -> None:
    """A launch script that exports its own PYTHONPATH drops commgate's bootstrap from its ranks' path: no rank
    wrote a capture, and the message blamed os._exit and SIGKILL alone (found by an adversarial pass)."""
    script = work / "launch.sh"
    script.write_text(f"export PYTHONPATH={JOBS}\nexec {' '.join(TORCHRUN)} ddp_train.py --steps 2\n")
    done = commgate("capture", "-o", work / "own-path", "--", "sh", script)
    assert "rank 0 of 2: 2 steps" in done.stdout, done.stdout + done.stderr
    assert f"commgate's bootstrap ({BOOTSTRAP}) on their PYTHONPATH" in done.stderr, done.stderr
    assert "add it to the PYTHONPATH the script sets" in done.stderr


def test_a_bad_stamps_switch_on_the_by_hand_route_is_said_as_a_rank_starts(work: Path) -> None:
    """``COMMGATE_STAMPS=maybe`` with ``COMMGATE_CAPTURE`` set by hand (``commgate capture`` refuses it up front):
    each rank died in its ``init_process_group`` with commgate's traceback (found by an adversarial pass). Each
    says so in one line as it starts, and the job runs as it would uncaptured."""
    out = work / "stamps-maybe"
    env = dict(os.environ, **{CAPTURE_ENV: str(out), "PYTHONPATH": str(BOOTSTRAP), "COMMGATE_STAMPS": "maybe"})
    done = bounded([*TORCHRUN, "ddp_train.py", "--steps", "2"], cwd=JOBS, env=env)
    for rank in (0, 1):
        assert f"rank {rank} of 2: 2 steps" in done.stdout, done.stdout + done.stderr
    says = "commgate: environment variable COMMGATE_STAMPS='maybe': expected one of "
    assert done.stderr.count(says) == 2 and "; this rank runs uncaptured" in done.stderr, done.stderr
    assert "commgate/run/" not in done.stderr, done.stderr
    assert not (out / "rank0.json").exists()
    if not torch_s_own_abort_at_exit(done):
        assert done.returncode == 0, done.stderr


def test_a_job_that_sets_up_its_group_again_keeps_the_first_group_s_calls(work: Path) -> None:
    """``init`` -> ``destroy`` -> ``init``: each ``init_process_group`` installed a fresh recorder, so the
    capture held the second group's calls alone and the first's were lost (found by an adversarial pass).
    The capture now holds both groups' calls, numbered in one sequence, and the steps once."""
    out = work / "reinit"
    done = capture(out, "--reinit")
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        calls = json.loads((out / f"rank{rank}.json").read_text())["calls"]
        ops = [(c["op"], c["bytes"]) for c in calls]
        assert ops.count(("all_reduce", 12)) == 1, ops  # the second group's
        assert sum(op == "all_reduce" for op, _ in ops) == 4, ops  # and the first group's 3 steps' buckets
        assert [c["seq"] for c in calls] == sorted({c["seq"] for c in calls}), "one sequence, no number twice"
        assert json.loads((out / f"rank{rank}.meta.json").read_text())["steps"] == 3


def test_a_second_group_over_another_backend_fails_the_capture_rather_than_drop_its_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The capturing backend is registered over one real backend per process; a job whose second group asks
    for another one runs it uncaptured, and its capture says so (``check`` fails it) instead of holding only
    part of the job's calls."""
    from commgate.run import external

    state = external._State(out=tmp_path, rank=0, inner="nccl", recorder=object())
    monkeypatch.setattr(external, "STATE", state)
    asked: list[object] = []
    assert external._init(lambda backend, *a, **k: asked.append(backend) or "group", "gloo", (), {}) == "group"
    assert asked == ["gloo"]
    said = "the job set up a group over 'gloo' after one over nccl; commgate captures one backend a job"
    assert state.not_captured == said


def torch_s_own_abort_at_exit(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether an *uncaptured* rank of ``ddp_train.py`` ended in torch 2.13's own abort at exit, which is not
    commgate's to judge: the job ran as it does without commgate. torch's backward stashes a Python
    ``contextvars`` context in the thread's state (``torch/autograd/graph.py``, ``_engine_run_backward``), each
    gloo work DDP issues from the backward copies that state, and gloo's worker thread drops the work after
    its future completes; when the rank has already begun to exit, the decref of that context aborts the
    process ("terminate called without an active exception", found with gdb: ``pt_gloo_runloop`` in
    ``take_gil`` from ``~AsyncWork``). A plain two-rank DDP script on this machine ended so in 5 to 8 runs of
    30; under capture in 0 of 30 (the capture holds each work until it reads the work's end, on the rank's
    own thread, which then frees it)."""
    return done.returncode != 0 and "terminate called without an active exception" in done.stderr


def test_the_job_sees_its_own_backend_s_name(work: Path) -> None:
    """Under capture ``dist.get_backend()`` said ``commgate``, and ``monitored_barrier`` (gloo's alone: torch
    checks the name) failed every rank (found by an adversarial pass). The job sees the backend it asked for."""
    done = capture(work / "monitored", "--monitored-barrier")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0: backend gloo" in done.stdout and "rank 1: backend gloo" in done.stdout


def test_the_bootstrap_says_a_failing_sitecustomize_of_the_user_s_as_python_does(tmp_path: Path) -> None:
    """The capture's bootstrap (a ``sitecustomize`` first on the path) runs the next one down; a user's that
    failed to import was silenced (``except ImportError: pass``; found by an adversarial pass). Python's own
    line is said; a missing one still says nothing."""
    (tmp_path / "sitecustomize.py").write_text("import nonexistent_mod_xyz\n")
    env = dict(os.environ, PYTHONPATH=f"{BOOTSTRAP}{os.pathsep}{tmp_path}")
    done = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert done.stdout == "ran\n"
    assert done.stderr == (
        "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
        "ModuleNotFoundError: No module named 'nonexistent_mod_xyz'\n"
    )
    env["PYTHONPATH"] = str(BOOTSTRAP)
    done = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert (done.stdout, done.stderr) == ("ran\n", "")


def test_a_job_started_by_torch_multiprocessing_spawn_is_captured(work: Path) -> None:
    """PyTorch's tutorial DDP script: ``mp.spawn`` gives each worker its rank as an argument and the worker
    names it to ``init_process_group``; no ``RANK`` in its environment, so nothing was captured and the
    one line said to end the ranks normally (found by an adversarial pass). Each worker is a rank from that
    call on: its calls, its world and how it was started are in its capture."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = work / "spawn"
    done = commgate("capture", "-o", out, "--", sys.executable, "spawn_train.py", port)
    assert done.returncode == 0 and "2 rank file(s)" in done.stdout + done.stderr, done.stdout + done.stderr
    for rank in range(2):
        calls = json.loads((out / f"rank{rank}.json").read_text())["calls"]
        assert [(c["op"], c["bytes"]) for c in calls if c["op"] == "all_reduce" and c["bytes"] == 32] == [
            ("all_reduce", 32)
        ] * 2
        meta = json.loads((out / f"rank{rank}.meta.json").read_text())
        assert (meta["rank"], meta["world_size"], meta["ended"]) == (rank, 2, "exited")
        assert meta["launcher"].startswith("a process that named its own rank")
    checked = commgate("check", out, "--baseline-dir", work / "spawn-baselines", "--update-baselines")
    assert checked.returncode == 0 and "2 ranks" in checked.stdout, checked.stdout + checked.stderr


def test_a_dumps_all_to_all_is_its_ranks_own_input(tmp_path: Path) -> None:
    """An all-to-all's ranks each send their own splits (an MoE's dispatch): the capture records a rank's own
    input, and a dump's entry is read the same way, not as the larger of its input and output (a rank that
    received more than it sent was a call the capture never made, found by an adversarial pass)."""
    import pickle

    from commgate.run.flightrec import read

    doc = pickle.loads((NCCL_DUMP / "pickle" / "fr_0").read_bytes())
    entry = doc["entries"][0]
    entry |= {"profiling_name": "nccl:all_to_all", "input_sizes": [[6]], "output_sizes": [[12]]}
    entry |= {"input_dtypes": ["Float"], "output_dtypes": ["Float"]}
    (tmp_path / "fr_0").write_bytes(pickle.dumps(doc))
    first = read(tmp_path).calls[0]
    assert (str(first.op), first.elements, first.bytes) == ("all_to_all", 6, 24)


def test_a_terminated_spawn_job_s_capture_is_whole_when_capture_returns(work: Path) -> None:
    """SIGTERM to ``commgate capture`` of an ``mp.spawn`` job: the spawning parent dies at once, and capture
    counted 0 or 1 of 2 rank files and returned while its workers were still writing theirs (found by an
    adversarial pass). It now waits for the job's processes that outlive its command: every rank's file is
    there, and counted, when it returns, and none of the job's processes is left."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out, ready = work / "spawn-terminated", work / "ready-spawn"
    ready.mkdir()
    cmd = [sys.executable, "-m", "commgate", "capture", "-o", str(out), "--", sys.executable, "spawn_train.py", port,
           str(ready)]  # fmt: skip
    with subprocess.Popen(cmd, cwd=JOBS, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True) as p:
        try:
            deadline = time.monotonic() + BOUND_S
            while len(list(ready.iterdir())) < 2 and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(list(ready.iterdir())) == 2, p.communicate(timeout=BOUND_S)
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=BOUND_S)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert f"commgate capture: 2 rank file(s) in {out}" in err, err
    assert sorted(f.name for f in out.iterdir() if f.name.startswith("rank") and f.name.endswith(".json")) == [
        "rank0.json", "rank0.meta.json", "rank1.json", "rank1.meta.json"
    ]  # fmt: skip
    left = subprocess.run(["pgrep", "-f", f"spawn_train.py {port}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the job left running: {left}"


SPAWN_MODES = """
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, world, mode, port):
    if mode == "url":  # torch's documented URL form: the rank in the init_method's query
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}?rank={rank}&world_size={world}")
    elif mode == "both":  # the worker sets RANK itself, and names its rank too
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:  # env:// from variables the worker sets
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(8))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
"""


@pytest.mark.parametrize("mode", ["url", "both", "envvars"])
def test_a_spawn_worker_that_names_its_rank_otherwise_is_captured(work: Path, mode: str) -> None:
    """``mp.spawn`` workers naming their rank in the ``init_method`` URL, setting ``RANK`` themselves and naming
    it too, or setting the ``env://`` variables themselves: none was captured, and the one line told the user to
    name the rank to ``init_process_group``, which they had (found by an adversarial pass)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = work / f"spawn_{mode}.py"
    script.write_text(SPAWN_MODES)
    out = work / f"spawn-{mode}"
    done = commgate("capture", "-o", out, "--", sys.executable, script, mode, port)
    assert done.returncode == 0 and "2 rank file(s)" in done.stderr, done.stdout + done.stderr
    for rank in range(2):
        calls = json.loads((out / f"rank{rank}.json").read_text())["calls"]
        assert ("all_reduce", 32) in [(c["op"], c["bytes"]) for c in calls]
        meta = json.loads((out / f"rank{rank}.meta.json").read_text())
        assert (meta["rank"], meta["world_size"]) == (rank, 2)
