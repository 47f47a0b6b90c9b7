"""Start the ranks of a scenario on this machine and collect their capture.

Each rank is a fresh ``python -m harness.rank`` process (no fork after torch is imported; this process
does not import torch at all) in its own session, so that it and anything it started are killed at
once. Ranks meet through a ``FileStore`` in a private temporary directory: no port to collide with.
The launcher fails a run

* when a rank raises: naming the rank and showing its traceback (the other ranks are killed at once),
* when a rank dies by a signal: naming the rank and the signal,
* at the deadline: naming what each rank last issued (the collective it is stuck in),

and in every case leaves no rank process behind.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.capture import Capture, merge
from harness.errors import CommgateError
from harness.rank import LAUNCHER_PID
from harness.scenario import Scenario

POLL_S = 0.02


class RunError(CommgateError):
    """A scenario's run failed: a rank raised, died, or the deadline passed."""


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _failure(scenario: Scenario, procs: list[subprocess.Popen[bytes]], tmp: Path) -> str | None:
    """Why the run failed, or None while no rank has failed.

    When one rank fails its peers soon fail too ("connection reset by peer"): the rank whose error was
    written first is the cause. A rank killed by a signal writes no error and is named with the signal.
    """
    failed = [(rank, code) for rank, code in enumerate(p.poll() for p in procs) if code is not None and code != 0]
    if not failed:
        return None
    for rank, code in failed:
        if code < 0:
            return f"{scenario.id}: rank {rank} died by signal {signal.Signals(-code).name}"
    errors = sorted((e.stat().st_mtime_ns, r) for r in range(len(procs)) if (e := tmp / f"rank{r}.err").exists())
    if errors:
        rank = errors[0][1]
        tb = (tmp / f"rank{rank}.err").read_text().rstrip()
        return f"{scenario.id}: rank {rank} raised {tb.splitlines()[-1]}\n{tb}"
    rank, code = failed[0]
    log = (tmp / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-20:]
    return f"{scenario.id}: rank {rank} exited with status {code}\n" + "\n".join(log)


def _hang_report(scenario: Scenario, tmp: Path, waited: float) -> str:
    lines = [f"{scenario.id}: deadline of {waited:g} s passed; the last call each rank issued:"]
    for r in range(scenario.world_size):
        status = tmp / f"rank{r}.status"
        text = status.read_text(errors="replace").strip() if status.exists() else ""
        lines.append(f"  rank {r}: {'in ' + text if text else 'no call issued yet'}")
    return "\n".join(lines)


def launch_local(
    scenario: Scenario,
    *,
    deadline_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    workdir: Path | None = None,
) -> Capture:
    """Run ``scenario`` on ``world_size`` local processes and return the merged capture.

    The ranks' private directory (store, status, logs) is made under ``workdir`` (default: the system's
    temporary directory) and removed afterwards.
    """
    world = scenario.world_size
    deadline = deadline_s if deadline_s is not None else scenario.deadline_s
    tmp = Path(tempfile.mkdtemp(prefix="commgate-", dir=workdir))
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        spec = tmp / "scenario.pickle"
        with open(spec, "wb") as f:
            pickle.dump(scenario, f)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid())}
        for rank in range(world):
            with open(tmp / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "harness.rank",
                            str(spec),
                            str(rank),
                            str(world),
                            str(tmp / "store"),
                            str(tmp),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # what torchrun sets (DeepSpeed insists on LOCAL_RANK)
                        env=env
                        | {
                            "RANK": str(rank),
                            "LOCAL_RANK": str(rank),
                            "WORLD_SIZE": str(world),
                            "LOCAL_WORLD_SIZE": str(world),
                        },
                        start_new_session=True,
                    )
                )
        while any(p.poll() is None for p in procs):
            reason = _failure(scenario, procs, tmp)
            if reason:
                raise RunError(reason)
            if time.monotonic() - started > deadline:
                raise RunError(_hang_report(scenario, tmp, deadline))
            time.sleep(POLL_S)
        reason = _failure(scenario, procs, tmp)
        if reason:
            raise RunError(reason)
        if progress:
            progress(f"{scenario.id}: {world} ranks done in {time.monotonic() - started:.1f} s")
        return merge(
            [tmp / f"rank{r}.json" for r in range(world)],
            scenario=scenario.id,
            warmup_steps=scenario.warmup_steps,
            steps=scenario.steps,
            backend=(tmp / "rank0.backend").read_text(),  # as the ranks resolved it (auto: nccl on GPUs)
        )
    finally:
        _kill(procs)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
