"""Real runs on local gloo ranks: capture, reconciliation, and the launcher's failure handling.

Each test starts real rank processes (a few seconds each: torch is imported per rank).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.scenario import Scenario
from commgate.model.schemes.zero3_fetch import INERT
from commgate.run.capture import INIT_STEP, Capture
from commgate.run.capture import validate as validate_capture
from commgate.run.launcher import RunError, gpu_visible, launch_local

BASE = (
    "schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu}}\n"
    "parallelism: {{scheme: {scheme}, dp: {dp}{par}}}\nsteps: 2\n"
)


def text(name: str, par: str = "", *, scheme: str = "ddp", dp: int = 2) -> str:
    return BASE.format(name=name, par=par, scheme=scheme, dp=dp)


def scenario(name: str = "t", par: str = "", extra: str = "") -> Scenario:
    (s,) = load_text(text(name, par) + extra)
    return s


def rank_processes(workdir: Path) -> list[int]:
    """Live processes with a file open under ``workdir`` (the ranks of a run started there: their
    stdout and stderr go to their log in its private directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            except OSError:
                continue
            if any(link.startswith(str(workdir)) for link in links):
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize(
    "bucket",
    ["", ", ddp_bucket_mb: 0.5", ", micro_batches: 3"],
    ids=["default-buckets", "half-MiB-buckets", "no-sync-accumulation"],
)
def test_ddp_every_byte_explained(bucket: str, tmp_path: Path) -> None:
    s = scenario(par=bucket)
    capture = launch_local(s, workdir=tmp_path)
    validate_capture(capture.to_json())  # the published capture schema
    assert capture.backend == "gloo"  # auto resolves to gloo without GPUs
    assert set(capture.timeline) == {"start", "join", "build", "steps", "finish"}
    rec = reconcile(predict(s), capture)
    assert not rec.mismatches, rec.mismatches
    assert {o.op for o in rec.ops} == {"all_reduce", "broadcast"}
    assert all(o.unexplained_bytes == 0 for o in rec.ops)
    assert rec.traffic_measured == rec.traffic_predicted
    assert rec.ok
    buckets = [k for k in rec.keys if k.window == "steps" and k.op == "all_reduce"]
    assert len(buckets) == (3 if "bucket_mb" in bucket else 2)
    # with accumulation only the last micro-batch of a step all-reduces (no_sync on the others)
    assert {k.measured_calls for k in buckets} == {2 * s.steps}


def test_capture_sees_every_path(tmp_path: Path) -> None:
    s = scenario(extra="workload: commgate.run.workloads.probes:paths\n")
    cap = launch_local(s, workdir=tmp_path)
    validate_capture(cap.to_json())
    calls = [c for c in cap.calls if c.step == 1]
    ops = {c.op for c in calls}
    assert ops >= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "scatter"}
    unended = [c for c in cap.calls if c.duration_ns is None or c.duration_ns < 0]
    assert unended == [], f"calls without an end (1 fresh clone of 1bbbe1c under load): {unended[:4]}"
    sends = {(c.rank, c.peer, c.elements) for c in calls if c.op == "send"}
    assert sends >= {(0, 1, 5), (1, 0, 5), (0, 1, 7)}  # batched isend ring and the plain send
    assert {(c.rank, c.peer, c.elements) for c in calls if c.op == "recv"} >= {(1, 0, 7), (0, 1, 5)}
    by_op = {c.op: c for c in calls if c.rank == 0}
    assert by_op["all_gather"].group == (0, 1) and by_op["reduce_scatter"].elements == 8
    assert [c.seq for c in cap.calls if c.rank == 0] == sorted(c.seq for c in cap.calls if c.rank == 0)
    assert min(c.step for c in cap.calls) >= INIT_STEP


def test_what_a_rank_started_does_not_outlive_a_passing_run(tmp_path: Path) -> None:
    """Rank 1 starts a process that would sleep an hour (its stdout is the rank's log, under ``tmp_path``)
    and the run passes: by the time ``launch_local`` returns, no process holds a file there."""
    capture = launch_local(scenario(extra="workload: commgate.run.workloads.faults:spawn\n"), workdir=tmp_path)
    assert {c.rank for c in capture.calls if c.op == "all_reduce"} == {0, 1}
    left = time.monotonic() + 60  # a process killed by SIGKILL closes its files a moment later
    while rank_processes(tmp_path) and time.monotonic() < left:
        time.sleep(0.1)
    assert rank_processes(tmp_path) == []


def test_the_deadline_starts_when_the_ranks_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the forkserver's start costs (torch's and DeepSpeed's imports, DeepSpeed's op build on a first
    run: minutes on a loaded machine), the deadline is the ranks': the launcher's clock is made to jump a day
    while the ranks start, and a 600 s deadline still holds."""
    from commgate.run import launcher

    real_start, real_time, jump = launcher._start, launcher.time, [0.0]

    def start(*args: Any, **kwargs: Any) -> None:
        real_start(*args, **kwargs)
        jump[0] = 86_400.0

    clock = SimpleNamespace(monotonic=lambda: real_time.monotonic() + jump[0], sleep=real_time.sleep)
    monkeypatch.setattr(launcher, "_start", start)
    monkeypatch.setattr(launcher, "time", clock)
    capture = launch_local(scenario(extra="deadline_s: 600\n"), workdir=tmp_path)
    assert jump[0] and {c.rank for c in capture.calls} == {0, 1}


def test_a_rank_that_raises_is_named_with_its_traceback(tmp_path: Path) -> None:
    s = scenario(extra="workload: commgate.run.workloads.faults:crash\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    text = str(info.value)
    assert text.startswith("t: rank 1 raised RuntimeError: planted crash on rank 1 at step 1")
    assert "Traceback" in text and "faults.py" in text
    assert rank_processes(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_refuses_is_named_with_its_one_line(tmp_path: Path) -> None:
    """commgate's own one-line error raised in a rank is the reason, without a traceback; a peer raising the
    same is a consequence, not a repetition."""
    s = scenario(extra="workload: commgate.run.workloads.faults:refuse\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    first, *rest = str(info.value).splitlines()
    line = "CommgateError: planted refusal on rank 1 at step 1: what a user can mend, in one line"
    assert first == f"t: rank 1 raised {line}"
    assert "Traceback" not in str(info.value) and all(line.startswith("(consequences: rank 0") for line in rest)


def test_at_the_deadline_a_rank_outside_any_call_is_not_said_to_be_in_its_last(tmp_path: Path) -> None:
    """Rank 1 blocks outside any call at step 1 (as a rank spinning in compute would), its step-0 all-reduce
    completed; rank 0 waits in step 1's. The stall watchdog held off, the deadline names each as it is."""
    s = scenario(extra="workload: commgate.run.workloads.faults:wedge\ndeadline_s: 20\nstall_s: 600\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    lines = str(info.value).splitlines()
    assert lines[0] == "t: deadline of 20 s passed; the last call each rank issued:"
    assert lines[1].startswith("  rank 0: in all_reduce (group [0, 1], 16 B, step 1, ")
    assert lines[2].startswith(
        "  rank 1: in no call (steps); the last it issued, all_reduce (group [0, 1], 16 B, step 0, "
    )
    assert lines[2].split(" (as of ")[0].endswith("), had completed")  # (its status's age, on a busy machine)


def test_a_rank_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    s = scenario(extra="workload: commgate.run.workloads.faults:die\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    first, *rest = str(info.value).splitlines()
    assert first == "t: rank 1 died by signal SIGKILL"
    assert all(line.startswith("(consequences: rank 0 then raised") for line in rest)
    assert rank_processes(tmp_path) == []


def test_a_hang_fails_at_the_deadline_naming_each_ranks_call(tmp_path: Path) -> None:
    # the stall watchdog held off: the deadline is the backstop
    s = scenario(extra="workload: commgate.run.workloads.faults:hang\ndeadline_s: 20\nstall_s: 600\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    lines = str(info.value).splitlines()
    assert lines[0] == "t: deadline of 20 s passed; the last call each rank issued:"
    assert lines[1] == "  rank 0: in all_reduce (group [0, 1], 16 B, step 1, forward)"
    assert lines[2] == "  rank 1: in recv (peer 0, 4 B, step 1, forward)"
    assert lines[-1] == (  # the fix, where nothing hung (it was not named: an adversarial pass)
        "  a run that is only slow needs longer: deadline_s in the scenario, or --deadline S (--commgate-deadline S)"
    )
    assert rank_processes(tmp_path) == []


def test_a_stall_fails_early_naming_the_first_divergence(tmp_path: Path) -> None:
    """Rank 1 skips its all-reduce in step 1 and goes on: its later all-reduces meet rank 0's earlier ones,
    so rank 0 waits in its last while rank 1 has finished. The watchdog fails the run once no rank has
    made progress for stall_s (long before the deadline) and says where the call sequences part."""
    s = scenario(extra="workload: commgate.run.workloads.faults:skip\ndeadline_s: 600\nstall_s: 10\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("t: stalled: no rank issued or completed a call for ")
    assert lines[1] == (
        "  first divergence: rank 1 issued 0 call(s) in step 1 on group [0, 1], rank 0 issued 1: "
        "rank 1 never issued all_reduce #1 (16 B, group [0, 1])"
    )
    assert lines[3].startswith("    rank 0: in all_reduce (group [0, 1], 16 B, step")
    assert lines[4].startswith("    rank 1: finished its steps, in teardown (waiting for its peers)")
    assert rank_processes(tmp_path) == []


def test_a_rank_stuck_outside_any_call_is_a_stall_too(tmp_path: Path) -> None:
    """Rank 1 blocks outside any collective (as in a rendezvous, or building a process group its peers never
    build) while rank 0 waits in the all-reduce: not every rank is in a call, but nothing moves for 3 x
    stall_s, so the run fails long before the deadline and names the rank outside."""
    s = scenario(extra="workload: commgate.run.workloads.faults:wedge\ndeadline_s: 600\nstall_s: 10\n")
    with pytest.raises(RunError) as info:
        launch_local(s, workdir=tmp_path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("t: stalled: no rank issued or completed a call for ")  # not the deadline's
    assert "rank(s) 1 outside any call (a rendezvous" in lines[0]
    assert any(line.startswith("    rank 0: in all_reduce (group [0, 1], 16 B, step 1") for line in lines)
    assert any(line.startswith("    rank 1: outside any call; its last, completed: all_reduce") for line in lines)
    assert rank_processes(tmp_path) == []


def test_a_planted_faults_wait_is_not_a_stall(tmp_path: Path) -> None:
    """Both ranks in a call and nothing moved for 5 s against a 1 s limit: a stall; unless a rank sleeps a
    planted fault's wait (``--commgate-fault slow=all_reduce:20`` under load held one call 19 x its 0.5 s
    and the watchdog failed the run as stalled in tests/plugin/test_fault.py)."""
    import json

    from commgate.run.diagnose import Watchdog

    def beat(rank: int, **kw: object) -> None:
        doc = {"issued": 3, "done": 2, "open": 1, "holding": False, "teardown": False, "steps_ns": [10**9]}
        (tmp_path / f"rank{rank}.beat").write_text(json.dumps(doc | kw))

    for r in (0, 1):
        beat(r)
    dog = Watchdog(tmp_path, (0, 1), stall_s=1.0)
    assert dog.stalled([True, True]) is None  # the first look is progress
    dog.since -= 5
    dog.next_look = 0.0
    assert dog.stalled([True, True]) == pytest.approx(5, abs=1)
    beat(1, holding=True)
    dog.since -= 5
    dog.next_look = 0.0
    assert dog.stalled([True, True]) is None


def test_the_divergence_of_call_sequences() -> None:
    from commgate.run.diagnose import divergence

    def call(step: int, op: str, nbytes: int, group: tuple[int, ...] = (0, 1), peer: int | None = None) -> dict:  # type: ignore[type-arg]
        return {"step": step, "op": op, "bytes": nbytes, "group": list(group), "peer": peer}

    same = [call(0, "all_reduce", 16), call(1, "broadcast", 8)]
    assert divergence({0: same, 1: same}) is None
    assert divergence({0: same, 1: [call(0, "all_reduce", 16), call(1, "all_reduce", 8)]}) == (
        "in step 1, call #1 on group [0, 1]: rank 0 issued broadcast (8 B), rank 1 issued all_reduce (8 B)"
    )
    sends = {0: [call(2, "send", 4, peer=1)], 1: []}
    assert divergence(sends) == (
        "rank 1 issued 0 call(s) in step 2 on send/recv 0 -> 1, rank 0 issued 1: rank 1 never issued "
        "send/recv #1 (4 B, send/recv 0 -> 1)"
    )
    assert divergence({0: [call(2, "send", 4, peer=1)], 1: [call(2, "recv", 4, peer=0)]}) is None
    # a step is each rank's own window: rank 0's own forward after its last optimizer step opened a step its
    # peer never did, and the barrier after it falls in step 2 on one rank and step 3 on the other
    trained = [call(0, "all_reduce", 16), call(1, "all_reduce", 16)]
    assert divergence({0: [*trained, call(3, "barrier", 0)], 1: [*trained, call(2, "barrier", 0)]}) is None
    # an all-to-all's ranks each send their own split sizes (an MoE's dispatch); its op must still agree
    uneven = {
        0: [call(0, "all_to_all", 12), call(0, "all_reduce", 8)],
        1: [call(0, "all_to_all", 24), call(0, "all_reduce", 8)],
    }
    assert divergence(uneven) is None
    uneven[1][1] = call(0, "all_reduce", 4)
    assert divergence(uneven) == (
        "in step 0, call #2 on group [0, 1]: rank 0 issued all_reduce (8 B), rank 1 issued all_reduce (4 B)"
    )
    assert divergence({0: [call(0, "all_to_all", 12)], 1: [call(0, "all_gather", 12)]}) == (
        "in step 0, call #1 on group [0, 1]: rank 0 issued all_to_all (12 B), rank 1 issued all_gather (12 B)"
    )


def test_ranks_die_with_a_launcher_killed_outright(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from commgate.model.loader import load_text; "
        "from commgate.run.launcher import launch_local; "
        f"(s,) = load_text({(text('t') + 'workload: commgate.run.workloads.faults:hang').__repr__()}); "
        f"launch_local(s, workdir=Path({str(tmp_path)!r}))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    try:
        # wait for the event (both ranks up), bounded generously: a loaded machine takes minutes to start
        # ranks that import torch and DeepSpeed, and a launcher that exits early ends the wait at once
        deadline = time.monotonic() + 600
        while len(rank_processes(tmp_path)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before its ranks were up"
        assert len(rank_processes(tmp_path)) == 2
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 120  # the ranks see their launcher gone (bounded: none may be left)
    while rank_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank_processes(tmp_path) == []
    (orphan,) = tmp_path.iterdir()  # the killed launcher's private directory; the next launch removes it
    launch_local(scenario(), workdir=tmp_path)
    assert not orphan.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(gpu_visible(), reason="the forkserver loads DeepSpeed's CPU comm op only where no GPU is visible")
def test_a_stale_build_lock_fails_the_forkservers_start_naming_the_lock(tmp_path: Path) -> None:
    """A build lock left by a killed DeepSpeed op build: every later build waits for it forever. The
    forkserver's start is bounded (here 12 s): the run says it waits on the lock, then fails naming it, and
    the scenario after it fails at once with the same words; nothing is left running."""
    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"  # torch's layout under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(text(name))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(lock.parents[1]), "COMMGATE_FORKSERVER_START_S": "12"}
    cmd = [sys.executable, "-m", "commgate", "run", "a.yaml", "b.yaml", "--report-dir", "out"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = f"{lock} is a build lock of torch's C++ extensions"
    assert "the ranks' forkserver has waited" in proc.stderr and said in proc.stderr
    for name in ("a", "b"):
        assert f"ERROR   {name}" in proc.stdout
    assert proc.stdout.count("the ranks' forkserver did not start within 12 s") == 2
    assert proc.stdout.count(said) == 2
    assert rank_processes(tmp_path) == []


def test_cli_run_writes_the_report_and_fails_on_a_planted_crash(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(text("good"))
    bad.write_text(text("bad") + "workload: commgate.run.workloads.faults:crash\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "commgate", "run", str(good), "--report-dir", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED  good" in proc.stdout and "unexplained 0 B" in proc.stdout
    # the frameworks' chatter stays in the forkserver's log and the ranks' (issue 29, item 7)
    for chatter in ("Setting accelerator to CPU", "built successfully"):
        assert chatter not in proc.stdout + proc.stderr
    import json

    doc = json.loads((out / "report.json").read_text())
    (sc,) = doc["scenarios"]
    assert sc["status"] == "passed" and sc["scheme"] == "ddp" and sc["world_size"] == 2
    assert all(c["unexplained_bytes"] == 0 for c in sc["collectives"])
    assert sc["capture"]["calls"] and doc["environment"]["torch"]
    import jsonschema
    from commgate.report.report import validate as validate_report

    validate_report(doc)  # the published report schema, the capture schema inside
    with pytest.raises(jsonschema.ValidationError):
        validate_report(doc | {"scenarios": [sc | {"capture": sc["capture"] | {"backend": 1}}]})
    proc = subprocess.run(
        [sys.executable, "-m", "commgate", "run", str(bad), "--report-dir", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "ERROR   bad" in proc.stdout and "planted crash on rank 1" in proc.stdout
    assert json.loads((out / "report.json").read_text())["summary"]["error"] == 1


@pytest.mark.parametrize(
    ("scheme", "dp", "par", "extra"),
    [
        ("zero1", 2, "", ""),
        ("zero2", 3, ", zero: {bucket_elements: 100000}", ""),  # five gradient buckets
        ("zero3", 2, "", "warmup_steps: 0\n"),  # the trace broadcasts of steps 0-1 are measured too
        # backward gathers within pairs (the paper's regime: nothing persistent, prefetched or kept)
        ("zero++", 4, ", zero: {hpz: 2}", "deepspeed: {zero_optimization: " + str(INERT).replace("'", "") + "}\n"),
        ("zero1", 5, "", ""),  # the flat buffer padded to 2 x 5 elements
        ("zero3", 5, "", ""),  # every parameter padded to a multiple of 5
    ],
    ids=["zero1", "zero2-buckets-dp3", "zero3-with-trace-steps", "zeropp-hpz2", "zero1-padded", "zero3-padded"],
)
def test_deepspeed_zero_every_byte_explained(scheme: str, dp: int, par: str, extra: str, tmp_path: Path) -> None:
    (s,) = load_text(text(scheme.replace("+", "p"), par, scheme=scheme, dp=dp) + extra)
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
    ops = {o.op for o in rec.ops}
    assert ops == (
        {"all_gather", "all_reduce", "reduce_scatter", "broadcast"}
        if scheme in ("zero3", "zero++")
        else {"all_gather", "all_reduce"}
    )
    if scheme == "zero++":
        backward = {k.group for k in rec.keys if k.op == "all_gather" and k.phase == "backward"}
        assert backward == {(0, 1), (2, 3)}
    padding = [r for r in predict(s).residuals if r.name == "partition padding"]
    assert bool(padding) == (dp == 5)


@pytest.mark.parametrize(
    ("dp", "par"),
    [(1, ", activation_checkpointing: true"), (1, ", micro_batches: 2"), (2, ", micro_batches: 2")],
    ids=["checkpointing", "two-micro-batches", "with-ddp-dp2"],
)
def test_dtensor_tensor_parallel_every_byte_explained(dp: int, par: str, tmp_path: Path) -> None:
    (s,) = load_text(text("tp", ", tp: 2" + par, scheme="tp", dp=dp))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
    assert {k.op for k in rec.keys if k.window == "init"} >= {"scatter", "broadcast"}
    steps = {(k.op, k.group) for k in rec.keys if k.window == "steps"}
    if dp == 1:
        assert [o.op for o in rec.ops] == ["all_reduce"] and steps == {("all_reduce", (0, 1))}
    else:  # DDP over the replicas: each tensor-parallel rank's shards with its peer in the other replica
        assert {("all_reduce", (0, 2)), ("all_reduce", (1, 3)), ("all_reduce", (0, 1))} <= steps


@pytest.mark.parametrize(
    ("pp", "dp", "m", "zero"),
    [(2, 1, 4, 0), (3, 2, 2, 0), (2, 2, 2, 1)],
    ids=["p2-m4", "p3-dp2-m2", "p2-dp2-zero1"],
)
def test_deepspeed_pipeline_every_byte_explained(pp: int, dp: int, m: int, zero: int, tmp_path: Path) -> None:
    (s,) = load_text(text("pp", f", pp: {pp}, micro_batches: {m}, zero: {{stage: {zero}}}", scheme="pp", dp=dp))
    capture = launch_local(s, workdir=tmp_path)
    rec = reconcile(predict(s), capture)
    # the loss is broadcast from the last stage: the recorded root, listed first in the reconciled group
    last = set(range((pp - 1) * dp, pp * dp))
    assert {c.root for c in capture.calls if c.op == "broadcast" and c.step >= 0} == last
    assert {k.group[0] for k in rec.keys if k.op == "broadcast" and k.window == "steps"} == last
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
    assert ("all_gather" in {o.op for o in rec.ops}) == (zero == 1)  # ZeRO-1 gathers the updated partitions
    sends = next(o for o in rec.ops if o.op == "send")
    # Eq. 4 per micro-batch, m micro-batches, for each of the dp pipelines
    assert sends.measured_bytes == 2 * 128 * 64 * (pp - 1) * m * dp * 4


@pytest.mark.parametrize(
    "moe", ["{experts: 4, ep: 2, every: 2}", "{experts: 2, ep: 2, top_k: 2}"], ids=["top1", "top2"]
)
def test_deepspeed_moe_every_byte_explained(moe: str, tmp_path: Path) -> None:
    (s,) = load_text(text("moe", f", moe: {moe}", scheme="moe", dp=4 if "every" in moe else 2))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert {o.op for o in rec.ops} == {"all_reduce", "all_to_all"}
    assert all(o.unexplained_bytes == 0 for o in rec.ops)
    assert rec.traffic_measured == rec.traffic_predicted


def test_capture_documents_round_trip_and_the_schema_rejects_garbage() -> None:
    import jsonschema

    doc = {
        "capture_version": 1,
        "scenario": "s",
        "world_size": 2,
        "warmup_steps": 1,
        "steps": 2,
        "backend": "gloo",
        "calls": [
            {
                "rank": 0,
                "seq": 0,
                "step": -1,
                "phase": "init",
                "op": "broadcast",
                "group": [0, 1],
                "peer": None,
                "dtype": "fp32",
                "elements": 4,
                "bytes": 16,
                "tensors": 1,
                "start_ns": 0,
                "duration_ns": 5,
                "root": 0,
            }
        ],
        "timeline": {"start": 0.01, "join": 0.02, "build": 0.5, "steps": 1.25, "finish": 0.03},
        "stack": {"hardware": "AMD EPYC x2", "cuda": None, "rocm": None, "backend_version": None},
        "step_windows": [{"rank": 0, "step": 0, "start_ns": 3, "end_ns": 90, "blocked_ns": 40}],
    }
    validate_capture(doc)
    assert Capture.from_json(doc).to_json() == doc
    older = doc | {"step_windows": [{"rank": 0, "step": 0, "start_ns": 3, "end_ns": 90}]}  # before blocked_ns
    validate_capture(older)
    assert Capture.from_json(older).step_windows[0].blocked_ns is None
    with pytest.raises(jsonschema.ValidationError):
        validate_capture(doc | {"calls": [doc["calls"][0] | {"op": "allreduce"}]})
    with pytest.raises(jsonschema.ValidationError):
        validate_capture(doc | {"timeline": {"steps": -1.0}})
    with pytest.raises(jsonschema.ValidationError):
        validate_capture(doc | {"step_windows": [{"rank": 0, "step": 0, "start_ns": 3}]})


@pytest.mark.parametrize(
    ("dp", "par"),
    [(1, ", activation_checkpointing: true"), (2, "")],
    ids=["t2p2-checkpointing", "d2t2p2"],
)
def test_3d_deepspeed_pipeline_with_dtensor_stages_every_byte_explained(dp: int, par: str, tmp_path: Path) -> None:
    (s,) = load_text(text("3d", f", tp: 2, pp: 2, micro_batches: 2{par}", scheme="3d", dp=dp))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
    # tensor-parallel all-reduces inside the stages, activations between them, gradients over dp
    groups = {(k.op, len(k.group)) for k in rec.keys if k.window == "steps"}
    assert {("all_reduce", 2), ("send", 2), ("recv", 2)} <= groups
    assert {k.op for k in rec.keys if k.window == "init"} >= {"scatter", "broadcast"}


def test_what_cannot_run_here_is_skipped_with_the_reason() -> None:
    from commgate.run.workloads import skip_reason

    (quantized,) = load_text(text("q", ", zero: {qwz: true}", scheme="zero++", dp=2))
    (gpu,) = load_text(text("g") + "markers: [gpu]\n")
    assert "no CPU kernel" in (skip_reason(quantized, gpus=False) or "")
    assert skip_reason(quantized, gpus=True) is None
    assert skip_reason(gpu, gpus=False) == "needs GPUs (marker gpu or backend nccl); this machine has none"
    assert skip_reason(gpu, gpus=True) is None
    assert skip_reason(scenario(), gpus=False) is None


def test_cli_run_gate_judges_against_baselines_like_pytest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`commgate run --gate` (what the nightly torchrun job runs): a missing baseline is written and fails,
    the next run passes against it, and a planted change of the stored volume fails naming the flag."""
    from commgate.cli import main

    f = tmp_path / "g.yaml"
    f.write_text(text("g"))
    base = tmp_path / "baselines"
    argv = ["run", str(f), "--gate", "--baseline-dir", str(base)]
    assert main(argv) == 1
    assert "no baseline yet: wrote" in capsys.readouterr().out
    stored = base / "gloo" / "g.json"
    assert stored.exists()
    assert main(argv) == 0
    capsys.readouterr()
    import json

    doc = json.loads(stored.read_text())
    doc["calls"][0]["calls"] += 1
    stored.write_text(json.dumps(doc))
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED  g" in out and "[baseline] communication differs from the baseline" in out
    assert "accept it with --update-baselines" in out
    assert main([*argv, "--update-baselines"]) == 0
    assert main(argv) == 0
    assert main(["run", str(f), "--update-baselines"]) == 2


def test_a_stale_extension_build_lock_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from commgate.run.extensions import build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_locks() == []
    lock = tmp_path / "deepspeed_shm_comm" / "lock"  # torch's layout under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert build_locks() == [lock]


def test_a_build_lock_whose_build_is_running_says_wait_not_delete(tmp_path: Path) -> None:
    """The first run's forkserver said "delete it if no build is running" of the lock of the build at work
    (found by a newcomer's walkthrough, 30 s into the first command): a lock with a process working in its
    directory (as ninja and the compiler do) is a build to wait for; one without is a lock to delete."""
    from commgate.run.launcher import _lock_words

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert _lock_words([lock]).endswith("no process is building there: delete it")
    building = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # a compiler at work in the build directory
    try:
        words = _lock_words([lock])
    finally:
        building.kill()
        building.wait()
    assert f"(pid {building.pid})" in words and words.endswith("waiting") and "delete" not in words


def test_at_exit_another_processs_build_does_not_keep_this_runs_forkserver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any build on the machine (another run's, another job's) made a run's exit say "the ranks' forkserver is
    finishing a build" and leave its forkserver to unwind as an orphan (found by an adversarial pass): only a
    build under this run's own forkserver keeps it."""
    from commgate.run import launcher

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    stopped: list[list[int]] = []
    monkeypatch.setattr(launcher, "build_locks", lambda: [lock])
    monkeypatch.setattr(launcher, "_stop_forkserver", lambda tree=None: stopped.append(tree or []))
    building = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # another process's compiler at work
    try:
        monkeypatch.setattr(launcher, "_forkserver_tree", lambda: [os.getpid()])  # this run's: not building
        launcher._forkserver_at_exit()
        assert stopped == [[os.getpid()]] and "finishing a build" not in capsys.readouterr().err
        monkeypatch.setattr(launcher, "_forkserver_tree", lambda: [os.getpid(), building.pid])  # its own build
        launcher._forkserver_at_exit()
        assert len(stopped) == 1 and "the ranks' forkserver is finishing a build" in capsys.readouterr().err
    finally:
        building.kill()
        building.wait()


@contextlib.contextmanager
def baton_held(lock: Path, for_s: float) -> Any:
    """A process holding ``lock`` as torch holds its build lock (its own ``FileBaton``) for ``for_s`` seconds,
    working elsewhere; yields it once the lock exists."""
    code = (
        "import sys, time; from torch.utils.file_baton import FileBaton; baton = FileBaton(sys.argv[1]); "
        "assert baton.try_acquire(); time.sleep(float(sys.argv[2])); baton.release()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock), str(for_s)], cwd="/")
    try:
        deadline = time.monotonic() + 120
        while not lock.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.exists(), "the holder did not take the lock"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_the_process_holding_a_build_lock_is_its_builder_and_a_lock_none_holds_is_stale(tmp_path: Path) -> None:
    """torch keeps its build lock open from taking it to removing it; between the two it checks the build with
    ninja (milliseconds, no process in the build directory) or builds. The holder is found by its open file,
    so the lock is not taken for one a killed build left."""
    from commgate.run.extensions import builder, stale

    lock = tmp_path / "real" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")  # a TORCH_EXTENSIONS_DIR reached through a link
    linked = tmp_path / "link" / "deepspeed_shm_comm" / "lock"
    with baton_held(lock, 600) as holder:
        assert builder(lock) == holder.pid == builder(linked) and builder(lock, among=[os.getpid()]) is None
        assert not stale(lock, settle_s=0) and not stale(linked, settle_s=0)
    lock.touch()  # as a holder killed outright leaves it
    assert builder(lock) is None and stale(lock, settle_s=0)
    lock.unlink()
    assert not stale(lock, settle_s=0)


def test_at_exit_a_forkserver_checking_its_build_is_waited_for_then_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped while its forkserver held DeepSpeed's build lock to check the build killed it there: the
    lock stayed, and every later run in CI waited 10 minutes on it (7 tests failed, CI ran past its time).
    The exit waits for the lock to go, then stops the forkserver, in silence."""
    from commgate.run import launcher

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    monkeypatch.setattr(launcher, "build_locks", lambda: [lock] if lock.exists() else [])
    monkeypatch.setattr(launcher, "EXIT_SETTLE_S", 120.0, raising=False)  # a bound, not the test's speed
    locked_at_stop: list[bool] = []
    monkeypatch.setattr(launcher, "_stop_forkserver", lambda tree=None: locked_at_stop.append(lock.exists()))
    with baton_held(lock, 0.5) as holder:
        monkeypatch.setattr(launcher, "_forkserver_tree", lambda: [holder.pid])
        launcher._forkserver_at_exit()
    assert locked_at_stop == [False] and capsys.readouterr().err == ""


def test_a_stale_lock_beside_a_running_build_is_the_one_named(tmp_path: Path) -> None:
    """The forkserver builds commgate's completion stamps, then DeepSpeed's op: with the stamps' build at work
    and a lock a killed DeepSpeed build left, the words name the stale lock to delete (waiting would not end),
    and a running build is named for what it builds."""
    from commgate.run.launcher import _lock_words

    running = tmp_path / "commgate_stamps_0123456789" / "lock"
    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    for lock in (running, stale):
        lock.parent.mkdir(parents=True)
        lock.touch()
    building = subprocess.Popen(["sleep", "60"], cwd=running.parent)
    try:
        both, alone = _lock_words([running, stale]), _lock_words([running])
    finally:
        building.kill()
        building.wait()
    assert both.startswith(f"{stale} is a build lock") and both.endswith("delete it")
    assert alone.startswith("torch is building commgate's completion stamps in") and alone.endswith("waiting")


def test_the_forkserver_builds_in_a_directory_of_its_environments_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkouts' environments do not share (and so do not rebuild alternately) DeepSpeed's op; a
    TORCH_EXTENSIONS_DIR the user set is theirs."""
    from commgate.run import extensions

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    mine = extensions.use_environment_dir()
    assert mine == extensions.environment_dir() and os.environ["TORCH_EXTENSIONS_DIR"] == str(mine)
    assert mine.is_relative_to(Path.home() / ".cache" / "commgate")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert extensions.environment_dir() != mine and extensions.environment_dir().parent == mine.parent
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/users/own")
    assert extensions.use_environment_dir() == Path("/users/own")


LLAMA = (
    "schema_version: 1\nname: llama-{name}\n"
    "model: {{architecture: llama, L: 2, h: 32, a: 4, kv_heads: 2, ffn_hidden: 88, V: 128, s: 32}}\n"
    "parallelism: {{scheme: {scheme}, {par}, activation_checkpointing: true, micro_batches: 2}}\nsteps: 2\n"
)


@pytest.mark.parametrize(
    ("scheme", "par"),
    [
        ("ddp", "dp: 2"),
        ("zero1", "dp: 2"),
        ("zero2", "dp: 3"),
        ("zero3", "dp: 2"),
        ("zero++", "dp: 4, zero: {hpz: 2}"),
        ("tp", "dp: 2, tp: 2"),
        ("pp", "dp: 1, pp: 2"),
        ("3d", "dp: 1, tp: 2, pp: 2"),
        ("moe", "dp: 2, moe: {experts: 2, ep: 2}"),
    ],
)
def test_a_llama_style_model_under_every_scheme_every_byte_explained(scheme: str, par: str, tmp_path: Path) -> None:
    """Grouped-query attention (2 key/value heads for 4 query heads), SwiGLU, RMSNorm, no biases; with
    activation checkpointing and 2 micro-batches."""
    (s,) = load_text(LLAMA.format(name=scheme.replace("+", "p"), scheme=scheme, par=par))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted


def test_more_ranks_than_the_machine_holds_is_refused_in_one_line(tmp_path: Path) -> None:
    """A million-rank scenario is refused before any process starts, naming how to run it instead."""
    from commgate.run.launcher import RunError, launch_local, local_rank_limit

    (s,) = load_text(
        "schema_version: 1\nname: big\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 1000000}\n"
    )
    with pytest.raises(
        RunError,
        match=rf"world size 1000000 is more local ranks than this machine holds \(at most {local_rank_limit()}",
    ) as info:
        launch_local(s, workdir=tmp_path)
    assert "\n" not in str(info.value) and "torchrun" in str(info.value)
    assert not any(tmp_path.iterdir())  # nothing started, nothing left


def test_a_rank_that_exits_without_raising_is_blamed_not_its_peer(tmp_path: Path) -> None:
    """Rank 1 leaves with os._exit(3) in step 1; rank 0's all-reduce then fails with a connection error.
    The exit status comes first: rank 1 is named, rank 0's error is listed as a consequence. Ten runs."""
    s = scenario(extra="workload: commgate.run.workloads.faults:exit_without_raising\n")
    for _ in range(10):
        with pytest.raises(RunError) as info:
            launch_local(s, workdir=tmp_path)
        text = str(info.value)
        assert text.startswith("t: rank 1 exited with status 3 without raising"), text
        assert rank_processes(tmp_path) == []


def _listening(pids: list[int]) -> set[str]:
    """The local addresses of the listening TCP sockets ``pids`` hold (Linux: /proc)."""
    import socket

    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                if (link := os.readlink(fd)).startswith("socket:["):
                    inodes.add(link[8:-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                out.add(socket.inet_ntop(family, words))
    return out


def test_local_ranks_listen_on_loopback_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even told to use another interface (GLOO_SOCKET_IFNAME), a local run's ranks listen on loopback only:
    the sockets listening while a run is under way are all 127.0.0.1 or ::1."""
    import socket
    import threading

    other = [name for _, name in socket.if_nameindex() if not name.startswith("lo")]
    if other:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other[-1])
    launch_local(scenario(), workdir=tmp_path)  # the forkserver warm: the hang below starts its ranks at once
    s = scenario(extra="workload: commgate.run.workloads.faults:hang\ndeadline_s: 12\nstall_s: 600\n")
    errors: list[BaseException] = []

    def hang() -> None:
        try:
            launch_local(s, workdir=tmp_path)
        except RunError as exc:  # the deadline, as planted
            errors.append(exc)

    run = threading.Thread(target=hang, daemon=True)
    run.start()
    seen: set[str] = set()
    while run.is_alive() and not seen:  # until the ranks listen, or the run ends (its deadline bounds it)
        time.sleep(0.2)
        seen = _listening(rank_processes(tmp_path))
    run.join(timeout=60)
    assert seen, "no listening socket seen while the ranks ran"
    assert all(addr.startswith("127.") or addr == "::1" for addr in seen), seen
    assert errors and "deadline of 12 s passed" in str(errors[0])


def test_a_scenario_beyond_the_machines_memory_is_refused_naming_the_estimate(tmp_path: Path) -> None:
    """The full-size 13B preset under DDP needs ~100 GiB a rank (parameters, gradients, AdamW's moments,
    activations): refused before any process starts, with the estimate by part and what to do instead."""
    from commgate.run import budget

    (s,) = load_text("schema_version: 1\nname: big\nmodel: {preset: 13B}\nparallelism: {scheme: ddp, dp: 2}\n")
    one = budget.per_rank(s, 0)
    n = 13_000_000_000
    # DDP's buckets hold a copy of the gradients: twice the parameters (an HF Trainer job of Llama 3.2 1B on
    # two ranks was killed by the OOM killer when the copy was left out)
    assert n * 2 < one.params < n * 2.2 and one.grads == 2 * one.params and one.optimizer == 2 * one.params
    with pytest.raises(RunError, match=r"big: needs about \d+\.\d GiB for 2 local rank\(s\), .* \(params .* GiB\); "
                       r"this machine has .* GiB available: use a reduced-scale model") as info:  # fmt: skip
        launch_local(s, workdir=tmp_path)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.iterdir())
    (small,) = load_text("schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: zero3, dp: 2}\n")
    assert budget.refusal(small, 512 << 20) is None


def test_steps_that_cannot_finish_before_the_deadline_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64k-token sequence on CPUs: at least an hour of compute (Megatron-LM's FLOP count, at a generous
    50 GFLOP/s a core) against a 300 s deadline is refused before any rank starts, naming the estimate."""
    from commgate.run import budget

    (s,) = load_text(
        "schema_version: 1\nname: long\nmodel: {L: 2, h: 512, a: 8, V: 1024, s: 65536}\n"
        "parallelism: {scheme: ddp, dp: 2}\nbackend: gloo\n"
    )
    need = budget.compute_s(s)
    assert need is not None and need > 300
    monkeypatch.setattr(budget, "refusal", lambda *a: None)  # whatever this machine's memory
    with pytest.raises(RunError, match=r"long: its 4 steps need at least [\d,]+ s of compute on \d+ cores") as info:
        launch_local(s, workdir=tmp_path)
    assert "more than the deadline of 300 s" in str(info.value) and not any(tmp_path.iterdir())
    (small,) = load_text("schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    assert budget.slow(small, 300) is None


def test_an_emulated_run_computes_on_cpus_and_is_estimated_so_where_a_gpu_is_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An emulated rank computes on the CPU whatever the machine holds; its compute estimate was left out
    where a GPU was visible (the launcher's own rule for "on CPUs" differed from the rank's)."""
    from commgate.run import budget, launcher

    monkeypatch.setattr(launcher, "gpu_visible", lambda: True)
    monkeypatch.setattr(budget, "refusal", lambda *a: None)  # whatever this machine's memory
    (s,) = load_text(
        "schema_version: 1\nname: long\nmodel: {L: 2, h: 512, a: 8, V: 1024, s: 65536}\n"
        "parallelism: {scheme: ddp, dp: 64}\nemulate: true\ndeadline_s: 5\n"
    )
    assert launcher.computes_on_cpu(s) and not launcher.computes_on_cpu(replace(s, emulate=False))
    with pytest.raises(RunError, match=r"long: its 4 steps need at least [\d,]+ s of compute"):
        launch_local(s, workdir=tmp_path)
    assert not any(tmp_path.iterdir())


AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def test_sixteen_bit_compute_without_onednn_kernels_is_estimated_at_its_own_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU with AVX2 alone (GitHub's AMD EPYC runners) torch computes bf16 and fp16 matrix products in its
    own loops, tens of times slower than fp32: the 1.3B preset's bf16 ZeRO-3 emulated run took 516 s there, 27 s
    on a CPU with AVX-512. The compute estimate takes the dtype the layers compute in (autocast's, FSDP2's
    param_dtype, the model's) at its own rate on such a CPU, and the refusal says why."""
    from commgate.run import budget

    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the estimate is this machine's: fix it

    def scenario(model: str, par: str = "") -> Scenario:
        (s,) = load_text(
            f"schema_version: 1\nname: b\nmodel: {{preset: 350M, {model}}}\n"
            f"parallelism: {{scheme: {'fsdp' if par else 'ddp'}, dp: 2{par}}}\nbackend: gloo\n"
        )
        return s

    fp32, bf16 = scenario("dtype: fp32"), scenario("dtype: bf16")
    autocast, gathers = scenario("dtype: fp32, autocast: bf16"), scenario("dtype: fp32", ", fsdp: {param_dtype: bf16}")
    monkeypatch.setattr(budget, "_cpu_flags", lambda: AVX512)
    assert budget.compute_s(bf16) == budget.compute_s(fp32) == budget.compute_s(autocast)
    monkeypatch.setattr(budget, "_cpu_flags", lambda: AVX2_ONLY)
    need, slower = budget.compute_s(fp32), budget.CORE_FLOPS / budget.CORE_FLOPS_16BIT_FALLBACK
    assert need is not None and slower > 1
    assert budget.compute_s(fp32) == budget.compute_s(scenario("dtype: fp32", ", fsdp: {param_dtype: fp32}"))
    for s in (bf16, autocast):
        assert budget.compute_s(s) == pytest.approx(need * slower)
    assert budget.compute_s(gathers) == pytest.approx(budget.compute_s(scenario("dtype: bf16", ", fsdp: {}")))
    assert budget.slow_compute(fp32) is None
    deadline = need * slower / 2  # between the two estimates: fp32 passes, bf16 is refused
    assert budget.slow(fp32, deadline) is None
    why = budget.slow(bf16, deadline)
    assert why is not None and "\n" not in why
    assert "at 10 GFLOP/s each for bf16: this CPU lacks what oneDNN's bf16 kernels need (AVX-512" in why
    assert why.endswith("run it on GPUs")
    monkeypatch.setattr(budget, "refusal", lambda *a: None)  # whatever this machine's memory
    (long,) = load_text(  # refused before any rank starts, as the fp32 estimate alone would not
        "schema_version: 1\nname: long\nmodel: {L: 2, h: 512, a: 8, V: 1024, s: 4096, dtype: bf16}\n"
        "parallelism: {scheme: ddp, dp: 2}\nbackend: gloo\ndeadline_s: 60\n"
    )
    bf16_need = budget.compute_s(long)
    assert bf16_need is not None and bf16_need / slower < long.deadline_s < bf16_need
    with pytest.raises(RunError, match="oneDNN's bf16 kernels"):
        launch_local(long, workdir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="x86 Linux")
def test_the_cpu_flags_say_what_torchs_own_check_says() -> None:
    """``budget.fast_on_cpu`` reads the CPU's flags (the launcher does not import torch); torch's own check
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: oneDNN's effective ISA) must agree on this machine, or
    the rule was changed upstream."""
    import torch
    from commgate.run import budget

    assert budget.fast_on_cpu("bf16") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert budget.fast_on_cpu("fp16") == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert budget.fast_on_cpu("fp32")


def test_the_orphan_sweep_removes_only_what_commgate_made(tmp_path: Path) -> None:
    """A killed launcher's private directory (marked, its process gone) is swept; a user's directory of a
    like name (``commgate-2024-backup``, no marker) and a live launcher's are left with their files."""
    from commgate.run.launcher import MARKER, _sweep_orphans

    backup = tmp_path / "commgate-2024-backup"
    backup.mkdir()
    (backup / "precious.txt").write_text("keep me")
    gone = tmp_path / "commgate-999999999-abc"  # no such process: a PID beyond pid_max
    gone.mkdir()
    (gone / MARKER).write_text("999999999\n")
    alive = tmp_path / f"commgate-{os.getppid()}-xyz"
    alive.mkdir()
    (alive / MARKER).write_text(f"{os.getppid()}\n")
    _sweep_orphans(tmp_path)
    assert (backup / "precious.txt").read_text() == "keep me"
    assert not gone.exists() and alive.exists()


@pytest.mark.parametrize(
    ("value", "skipped"), [("0", False), ("false", False), ("No", False), ("1", True), ("yes", True)]
)
def test_the_memory_check_switch_means_what_it_says(value: str, skipped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMGATE_SKIP_MEMORY_CHECK=0 (false, no) keeps the check on (it used to turn it off); an unknown
    value is a one-line refusal naming the variable."""
    from commgate.run import budget

    (big,) = load_text("schema_version: 1\nname: big\nmodel: {preset: 13B}\nparallelism: {scheme: ddp, dp: 2}\n")
    monkeypatch.setenv("COMMGATE_SKIP_MEMORY_CHECK", value)
    assert (budget.refusal(big, 0) is None) == skipped
    monkeypatch.setenv("COMMGATE_SKIP_MEMORY_CHECK", "perhaps")
    assert budget.refusal(big, 0) == (
        "COMMGATE_SKIP_MEMORY_CHECK='perhaps': expected 1, true or yes to skip the memory check, or 0, false or no"
    )


def test_the_memory_refusal_of_an_emulated_run_counts_the_ranks_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated run starts rank 0 alone: the refusal counts it, not the declared world (issue: "369.9 GiB
    for 64 local ranks, 369.93 GiB each")."""
    from commgate.model.loader import load_text
    from commgate.run import budget

    (s,) = load_text(
        "schema_version: 1\nname: e\nemulate: true\nmodel: {preset: 13B}\nparallelism: {scheme: zero3, dp: 64}\n"
    )
    monkeypatch.setattr(budget, "available", lambda: 1 << 30)  # 1 GiB
    monkeypatch.delenv(budget.SKIP, raising=False)
    why = budget.refusal(s, runtime=0)
    assert why is not None and "for 1 local rank(s) (of 64, the others emulated)" in why, why


def test_the_resource_trackers_warnings_go_to_the_forkserver_log_not_the_terminal(tmp_path: Path) -> None:
    """A rank that leaks a semaphore (torchtitan's dataset and progress-bar locks do) makes multiprocessing's
    resource tracker warn when the command exits; the tracker commgate starts writes that to the forkserver's
    log. Here a semaphore is leaked on purpose in the commgate process itself."""
    code = (
        "import multiprocessing as mp, os\n"
        "from commgate.run.launcher import _context\n"
        "_context()\n"
        "lock = mp.get_context('forkserver').Lock()\n"  # registered with the tracker, never released
        "os._exit(0)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    for _ in range(100):  # the tracker warns once its pipe closes, just after the command has exited
        logs = list(tmp_path.glob("commgate-forkserver-*.log"))
        if logs and "leaked semaphore" in logs[0].read_text():
            break
        time.sleep(0.1)
    assert "leaked semaphore" not in done.stderr
    assert logs and "leaked semaphore" in logs[0].read_text()


def test_a_tmpdir_too_long_for_a_socket_says_so(tmp_path: Path) -> None:
    """A TMPDIR of 86 characters was "the ranks' forkserver exited while starting (OSError) ...; set
    COMMGATE_FORKSERVER_START_S to wait longer", its log empty: the forkserver's Unix socket lies under
    TMPDIR, and its path was over the 107 characters a socket's may have (found by an adversarial pass)."""
    long = tmp_path / ("x" * max(1, 90 - len(str(tmp_path))))
    long.mkdir()
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "commgate", "run", str(root / "scenarios" / "ddp.yaml")]
    env = {**os.environ, "TMPDIR": str(long)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"TMPDIR ({long}: {len(str(long))} characters)" in done.stdout
    assert "set TMPDIR to a shorter directory" in done.stdout and "COMMGATE_FORKSERVER_START_S" not in done.stdout


def test_no_forkserver_outlives_the_run(tmp_path: Path) -> None:
    """The ranks' forkserver (torch and DeepSpeed imported) unwound for seconds after ``commgate run`` had
    returned, an orphan meanwhile, 10 s and more on a busy machine (found by an adversarial pass): when the
    command returns, no process of its is left."""
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "commgate", "run", str(root / "scenarios" / "ddp.yaml")]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    left = []
    for entry in Path("/proc").glob("[0-9]*"):  # every process started with this run's TMPDIR
        with contextlib.suppress(OSError):
            if f"TMPDIR={tmp_path}\0".encode() in (entry / "environ").read_bytes():
                left.append((entry / "cmdline").read_bytes()[:120])
    assert left == []


def test_at_the_deadline_a_rank_outside_calls_is_named_by_its_phase_and_a_stale_status_by_its_age(
    tmp_path: Path,
) -> None:
    """At a short deadline every rank was "no call issued yet", though the run knew each one's phase; a status
    its heartbeat had not refreshed for seconds (a busy machine) was given as the present, so that one rank
    seemed past a call its peer had not issued (found by an adversarial pass)."""
    import json

    from commgate.run.diagnose import hang_report

    (tmp_path / "rank0.phase.json").write_text(json.dumps({"phase": "entry"}))
    (tmp_path / "rank1.phase.json").write_text(json.dumps({"phase": "built"}))
    (tmp_path / "rank1.status").write_text("all_reduce (group [0, 1], 16 B, step 0, backward)")
    (tmp_path / "rank1.beat").write_text(json.dumps({"issued": 3, "completed": 3, "open": 0}))
    old = time.time() - 5
    for f in ("rank1.status", "rank1.beat"):
        os.utime(tmp_path / f, (old, old))
    lines = hang_report("t", tmp_path, [0, 1], 1.0).splitlines()
    assert lines[1] == "  rank 0: no call issued yet (joining the process group)"
    assert lines[2].startswith("  rank 1: in no call (steps); the last it issued, all_reduce (group [0, 1], 16 B")
    assert " (as of 5." in lines[2] and lines[2].endswith("s before: its heartbeat lagged, the machine busy)")
    assert not any("compute slowly" in line for line in lines)
    why = "this CPU lacks what oneDNN's bf16 kernels need"
    slowly = hang_report("t", tmp_path, [0, 1], 1.0, why).splitlines()
    assert slowly[:-1] == lines and slowly[-1] == f"  its steps compute slowly here: {why}"
