"""Issue 28 on NCCL: jobs that ask for NCCL, captured unchanged under torchrun, and NCCL's own Flight Recorder
dumps of the same run judged. Needs a CUDA GPU; skipped elsewhere, saying so.

One rank a GPU: NCCL refuses two ranks on one GPU ("Duplicate GPU detected", NCCL 2.5 and later), so on a
one-GPU machine the jobs run one rank. Their DDP still all-reduces every bucket through NCCL, which is what
is captured and dumped; the model layer needs two ranks (a DDP scenario needs dp >= 2) and is checked where
the machine has two GPUs or more.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from test_capture_job import JOBS, capture_nanogpt, commgate, every_op_is_recorded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU; this machine has none")

WORLD = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_ENABLE_TIMING": "1"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("capture-nccl")


def scenario(work: Path) -> tuple[str, ...]:
    """``--scenario`` of the DDP job at this machine's world size, where a DDP scenario can describe it."""
    if WORLD < 2:
        return ()
    text = (JOBS / "ddp-mlp.yaml").read_text().replace("dp: 2", f"dp: {WORLD}")
    (work / "ddp-nccl.yaml").write_text(text)
    return ("--scenario", str(work / "ddp-nccl.yaml"))


def capture(out: Path, *args: str, dumps: Path | None = None) -> tuple[Path, str]:
    env = None
    if dumps is not None:
        dumps.mkdir()
        env = dict(os.environ, **FR_ENV, TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_"))
        args = (*args, "--dump-fr")
    cmd = ("capture", "-o", out, "--", *TORCHRUN, "ddp_train.py", "--backend", "nccl", "--steps", "3", *args)
    done = commgate(*cmd, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


@pytest.fixture(scope="module")
def nccl(work: Path) -> tuple[Path, str]:
    """The unchanged DDP job on NCCL, captured, with NCCL's Flight Recorder (timed) dumped to work/fr."""
    return capture(work / "ddp", dumps=work / "fr")


@pytest.fixture(scope="module")
def baselines(work: Path, nccl: tuple[Path, str]) -> Path:
    store = work / "baselines"
    done = commgate("check", nccl[0], *scenario(work), "--baseline-dir", store, "--update-baselines")
    assert done.returncode == 0, done.stdout + done.stderr
    assert list((store / "nccl").glob("*.json")), done.stdout
    return store


def test_an_nccl_job_is_captured_with_every_call_ended(nccl: tuple[Path, str]) -> None:
    out, stdout = nccl
    assert f"rank 0 of {WORLD}: 3 steps" in stdout  # the job's own output, passed through
    meta = json.loads((out / "rank0.meta.json").read_text())
    assert (meta["backend"], meta["requested_backend"], meta["world_size"]) == ("nccl", "nccl", WORLD)
    assert meta["stack"]["cuda"], meta["stack"]
    calls = json.loads((out / "rank0.json").read_text())["calls"]
    assert {c["op"] for c in calls if c["step"] >= 0} >= {"all_reduce"}
    assert [c for c in calls if c["duration_ns"] is None] == []  # each NCCL call's end seen (wait or poller)


def test_check_judges_the_nccl_capture_against_its_baseline(
    work: Path, nccl: tuple[Path, str], baselines: Path
) -> None:
    report = work / "report"
    done = commgate("check", nccl[0], *scenario(work), "--baseline-dir", baselines, "--report-dir", report)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "backend nccl" in done.stdout
    judged = json.loads((report / "report.json").read_text())["scenarios"][0]
    assert judged["status"] == "passed", judged
    if WORLD >= 2:
        assert all(c["unexplained_bytes"] == 0 for c in judged["collectives"]), judged["collectives"]


def test_a_planted_extra_all_reduce_fails_against_the_baseline(work: Path, baselines: Path) -> None:
    """The extra all-reduce is ``dist.all_reduce(t)``: on NCCL a synchronous call that hands back no work; it
    is recorded, ended (by an event on the caller's stream), and fails the check against the baseline."""
    out, _ = capture(work / "extra", "--extra-all-reduce")
    calls = json.loads((out / "rank0.json").read_text())["calls"]
    extra = [c for c in calls if c["op"] == "all_reduce" and c["bytes"] == 4]
    assert len(extra) == 3 and all(c["duration_ns"] is not None for c in extra), extra
    done = commgate("check", out, *scenario(work), "--baseline-dir", baselines)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "all_reduce" in done.stdout and "FAILED" in done.stdout


def test_nccl_flight_recorder_dumps_give_the_capture_s_verdict(
    work: Path, nccl: tuple[Path, str], baselines: Path
) -> None:
    """NCCL's recorder holds every op the job issued, timed on the GPU (TORCH_NCCL_ENABLE_TIMING); read alone,
    the ranks agree; beside the capture, every dumped call is a captured one and the verdict is the capture's."""
    dumps = work / "fr"
    alone = commgate("check", "--flight-recorder", dumps)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "the ranks agree on every call the dumps hold" in alone.stdout
    assert "untimed" not in alone.stdout  # the job dumped once NCCL's watchdog had retired every call
    assert "groups:" not in alone.stdout  # NCCL's pg_config lists each group's ranks
    both = commgate("check", nccl[0], *scenario(work), "--baseline-dir", baselines, "--flight-recorder", dumps)
    assert both.returncode == 0, both.stdout + both.stderr
    assert "is a captured call" in both.stdout


def test_every_op_a_job_calls_on_nccl_is_recorded_once_ended(work: Path) -> None:
    """Each collective, async and sync (NCCL's synchronous calls hand back no work), through the names torch
    2.11 calls the group by (``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``)."""
    every_op_is_recorded(work / "every-op", TORCHRUN, WORLD, "--backend", "nccl")


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "default"])
def test_a_group_of_nccl_and_gloo_runs_each_tensor_on_its_device_s_backend(work: Path, backend: str) -> None:
    """A job that asks for ``cpu:gloo,cuda:nccl``, or for no backend (torch then gives the group both), calls
    each op on CUDA and on CPU tensors: under the capture as bare, the CPU's run on gloo (they failed on NCCL,
    which the capture had made the group's only backend), and every call is recorded."""
    args = ("--backend", backend, "--cpu-tensors") if backend != "default" else ("--backend", "", "--cpu-tensors")
    every_op_is_recorded(work / f"both-{backend.replace(':', '-').replace(',', '-')}", TORCHRUN, WORLD, *args, rounds=2)


def test_nanogpt_on_nccl_is_captured_as_itself(work: Path) -> None:
    """nanoGPT's train.py on its own CUDA path (device cuda:<local rank>, DDP with device_ids, backend nccl)."""
    job = work / "nanogpt"
    capture_nanogpt(job, nproc=WORLD, backend="nccl")
    meta = json.loads((job / "capture" / "rank0.meta.json").read_text())
    assert meta["backend"] == "nccl", meta
    args = ("check", job / "capture", "--baseline-dir", job / "baselines")
    if WORLD >= 2:
        (job / "nanogpt-ddp.yaml").write_text((job / "nanogpt-ddp.yaml").read_text().replace("dp: 2", f"dp: {WORLD}"))
        args = (*args, "--scenario", "nanogpt-ddp.yaml")
    first = commgate(*args, "--update-baselines", cwd=job)
    assert first.returncode == 0, first.stdout + first.stderr
    again = commgate(*args, cwd=job)
    assert again.returncode == 0, again.stdout + again.stderr
