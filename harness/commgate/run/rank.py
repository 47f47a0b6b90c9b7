"""The body of one rank: join the group through the capturing backend, build the workload, run its steps.

Started by ``commgate.run.launcher`` (one process per rank, forked from the launcher's forkserver, in its own
session) or by torchrun (then every rank runs ``run_rank`` in-process, one scenario after another).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commgate.core import env
from commgate.core.errors import CommgateError
from commgate.core.fsutil import atomic_write_json
from commgate.model.scenario import Scenario
from commgate.run import links
from commgate.run.capture import RUN_DIR, CapturedCall, RankClock, StepWindow, write_rank_calls
from commgate.run.emulate import reuse_memory, started_ranks
from commgate.run.inject import Faults

if TYPE_CHECKING:
    import torch

STATUS_WIDTH = 240


@dataclass(frozen=True, slots=True, kw_only=True)
class Gathered:
    """Every rank's calls, step windows and clock origin, gathered on rank 0 (an in-process run)."""

    calls: list[CapturedCall]
    windows: list[StepWindow]
    clocks: list[RankClock]


def resolve_backend(scenario: Scenario) -> str:
    import torch

    if scenario.emulate:
        return "emulated"
    if scenario.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return scenario.backend


def stack(backend: str, local_ranks: int) -> dict[str, str | None]:
    """``Capture.stack`` as this rank sees it, ``local_ranks`` the job's ranks on this host."""
    import torch

    from commgate.core.provenance import cpu_fingerprint

    gpus = backend not in ("gloo", "emulated") and torch.cuda.is_available()
    slots, unit = (torch.cuda.device_count(), "GPUs") if gpus else (len(os.sched_getaffinity(0)), "cores")
    return {
        "oversubscribed": f"{local_ranks} ranks on {slots} {unit}" if local_ranks > slots else None,
        "hardware": f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if gpus else cpu_fingerprint(),
        "cuda": torch.version.cuda,
        "rocm": getattr(torch.version, "hip", None),
        "backend_version": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,  # type: ignore[no-untyped-call]
        **({"link": str(link)} if (link := links.from_environment()) else {}),
    }


def run_rank(
    scenario: Scenario,
    *,
    rank: int,
    world_size: int,
    init_method: str | None = None,
    store: Any = None,
    out_dir: Path | None = None,
    marks: dict[str, float] | None = None,
    faults: Faults | None = None,
) -> Gathered | None:
    """Run ``scenario`` as ``rank``. With ``out_dir`` the rank writes its own calls there and returns
    None (the local launcher); without, the calls and step windows of every rank are gathered over the
    process group and rank 0 returns them all (torchrun, where ranks share no file system). ``marks``
    receives the monotonic clock at ``joined``, ``built``, ``stepped`` and ``done``
    (``commgate.run.capture.timeline``)."""
    import torch
    import torch.distributed as dist

    from commgate.run import interpose, planted
    from commgate.run.steps import Steps
    from commgate.run.workloads import OwnLoop, resolve

    backend = resolve_backend(scenario)
    device = _device(backend, rank)
    functional = dict(vars(torch.nn.functional))  # restored after the scenario (see _forget_deepspeed_state)
    faults = faults or Faults()
    os.environ.update(dict(faults.env))
    rec = interpose.install(backend, rank, started_ranks(scenario), recorder=planted.recorder(faults))
    dist.init_process_group(
        interpose.BACKEND_NAME,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=scenario.deadline_s),
    )
    marks = {} if marks is None else marks
    marks["joined"] = time.monotonic()
    workload = resolve(scenario)(scenario, rank=rank, device=device)
    marks["built"] = time.monotonic()
    steps = Steps(rec, faults, device, rank=rank, world_size=world_size)
    if isinstance(workload, OwnLoop):  # a trainer that runs its own loop opens and closes the steps itself
        steps.marks = marks
        workload.run(steps)
    else:
        for k in range(scenario.warmup_steps + scenario.steps):
            steps.begin(k)
            workload.step(k)
            steps.end()
    steps.close()
    marks["stepped"] = time.monotonic()
    # Only a successful rank tears down: a failing one must not close its connections (and make its
    # peers fail) before its own error is written; its process exits right after.
    interpose.RECORDER = None  # the teardown below is not part of the scenario
    calls, windows = rec.drain(), rec.windows
    gathered: Gathered | None = None
    if out_dir is not None:
        write_rank_calls(out_dir / f"rank{rank}.json", calls, windows, rec.clock())
    else:
        everyone: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object((calls, windows, rec.clock()), everyone, dst=0)
        if everyone is not None:
            gathered = Gathered(
                calls=[c for cs, _, _ in everyone for c in cs],
                windows=[w for _, ws, _ in everyone for w in ws],
                clocks=[k for _, _, k in everyone],
            )
    dist.barrier()  # no rank leaves while a peer may still be sending to it
    if out_dir is None:  # in-process (torchrun): the next scenario runs in this process; leave nothing
        dist.destroy_process_group()
        _forget_deepspeed_state()
        vars(torch.nn.functional).update(functional)  # ZeRO-3 leaves F.linear patched ("persists unless reset")
        del workload
        interpose.release_backends()
    # else the launcher's rank process exits at once (os._exit), with no teardown at all
    marks["done"] = time.monotonic()
    return gathered


def _device(backend: str, rank: int) -> torch.device:
    """The device ``rank`` computes on, made current: a CPU rank's threads (one core a rank; an emulated run
    is one process, which may use them all), or its local GPU."""
    import torch

    if backend in ("gloo", "emulated"):
        torch.set_num_threads(len(os.sched_getaffinity(0)) if backend == "emulated" else 1)
        if backend == "emulated":
            reuse_memory()
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def torchrun_store(scenario_index: int) -> Any:
    """A fresh key namespace on the job's store for each scenario run in this process (re-initialising
    the default group on the same keys would meet the previous scenario's leftovers)."""
    import torch.distributed as dist

    global _BASE_STORE
    if _BASE_STORE is None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

        def connect() -> Any:
            return dist.TCPStore(  # type: ignore[attr-defined]
                addr, port, world, is_master=rank == 0 and not agent, timeout=timedelta(seconds=STORE_WAIT_S)
            )

        _BASE_STORE = _interruptible(connect, f"the job's {world} ranks at {addr}:{port}")
    return dist.PrefixStore(f"commgate/{scenario_index}", _BASE_STORE)  # type: ignore[attr-defined]


STORE_WAIT_S = 300
"""How long a torchrun rank waits for the job's other ranks to meet at the store."""
STORE_SILENT_S = 15
"""How long it waits before it says what it waits for (a rank of a real job meets its peers well within it)."""


def _interruptible(connect: Callable[[], Any], what: str) -> Any:
    """``connect()`` (which blocks in C++, where no signal handler runs) on a thread, this one waiting on it:
    Ctrl-C and SIGTERM stop the wait at once, and a wait past ``STORE_SILENT_S`` says what it waits for, and how the
    variables that made this a torchrun rank may have been left over from another job."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["store"] = connect()
        except Exception as exc:  # the store's timeout
            box["error"] = exc

    worker = threading.Thread(target=run, name="commgate-store", daemon=True)
    worker.start()
    worker.join(STORE_SILENT_S)
    if worker.is_alive():
        print(
            f"commgate: waiting for {what} (at most {STORE_WAIT_S} s): {_VARIABLES} are set, which makes this a "
            "torchrun rank; if no launcher started it, unset them",
            file=sys.stderr,
            flush=True,
        )
    while worker.is_alive():
        worker.join(0.5)
    if "error" in box:
        raise CommgateError(
            f"{what} did not all meet within {STORE_WAIT_S} s ({str(box['error']).splitlines()[0]}); if no launcher "
            f"started this process, unset {_VARIABLES}"
        )
    return box["store"]


_VARIABLES = ", ".join(env.TORCHRUN_VARIABLES[:-1]) + " and " + env.TORCHRUN_VARIABLES[-1]

_BASE_STORE: Any = None


def _forget_deepspeed_state() -> None:
    """DeepSpeed keeps its comm backend and the process groups it made (data, expert, world clone, the
    pipeline grid as ``mpu``) in module globals; the next scenario run in this process (torchrun) must
    find none of the destroyed ones there. Reloading ``deepspeed.utils.groups`` re-binds its globals in
    place, so every importer sees the fresh values."""
    import importlib

    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None  # type: ignore[attr-defined]
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        importlib.reload(groups)
    checkpointing = sys.modules.get("deepspeed.runtime.activation_checkpointing.checkpointing")
    if checkpointing is not None:
        checkpointing.mpu = checkpointing.mp_group = None  # type: ignore[attr-defined]


def _die_with_parent() -> None:
    """Have the kernel kill this rank when its parent (the launcher's forkserver, which exits with the
    launcher) dies, even by SIGKILL (Linux; elsewhere a no-op).

    Ranks run in their own session so that the launcher can kill each as a group; without this, a
    launcher killed outright would leave them running.
    """
    from multiprocessing import forkserver

    # Every forked child inherits the write end of the pipe by which the forkserver learns that the
    # launcher is gone; while a rank holds it, the forkserver (this rank's parent) would outlive the
    # launcher, and so would the rank.
    server: Any = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


HEARTBEAT_S = 0.2
BEAT_WIDTH = 512


def _write_status(fd: int, text: str) -> None:
    os.pwrite(fd, text.encode()[:STATUS_WIDTH].ljust(STATUS_WIDTH), 0)


def _heartbeat(out: Path, rank: int, marks: dict[str, float], status: int) -> None:
    """The rank's side of the launcher's stall watchdog, off the calls' path: every HEARTBEAT_S its phase
    (the latest of ``marks``) to ``OUT/rank{r}.phase.json`` for the launcher's progress line, the
    recorder's progress (calls issued, completed, open), the steps' durations so far and whether the
    steps are over (teardown) go to ``OUT/rank{r}.beat``, the call issued last to the ``status`` file
    (``OUT/rank{r}.status``); when the launcher asks (``OUT/dump.request``),
    every call issued so far goes to ``OUT/rank{r}.calls.json``. The main thread may be blocked in a
    collective meanwhile (torch releases the GIL while it waits)."""
    from commgate.run import interpose

    fd = os.open(out / f"rank{rank}.beat", os.O_WRONLY | os.O_CREAT, 0o644)
    dumped, last, told = False, None, ""
    while True:
        time.sleep(HEARTBEAT_S)
        if (phase := list(marks)[-1]) != told:  # the latest mark: entry, joined, built, stepped (list(): atomic)
            atomic_write_json(out / f"rank{rank}.phase.json", {"phase": phase})
            told = phase
        rec = interpose.INSTALLED  # still there after the steps, when the teardown unsets RECORDER
        if rec is None:
            continue
        if rec.last is not last:
            last = rec.last
            _write_status(status, rec.describe_last())
        issued, done, open_ = rec.progress()
        steps = [w.end_ns - w.start_ns for w in list(rec.windows)]
        beat = {
            "issued": issued,
            "done": done,
            "open": open_,
            "holding": rec.holding,
            "teardown": "stepped" in marks,
            "steps_ns": steps,
        }
        os.pwrite(fd, json.dumps(beat).encode()[:BEAT_WIDTH].ljust(BEAT_WIDTH), 0)
        if not dumped and (out / "dump.request").exists():
            atomic_write_json(out / f"rank{rank}.calls.json", {"calls": rec.snapshot(), "teardown": "stepped" in marks})
            dumped = True


def child(
    spec: str, rank: int, world: int, store: str, out_s: str, env: dict[str, str], launched: float, faults: Faults
) -> None:
    """One rank started by the local launcher, forked from its forkserver (torch, DeepSpeed imported).

    SPEC is the scenario pickled by the launcher into its private directory OUT (inter-process hand-over,
    never stored). The rank runs in its own session with stdout and stderr in ``OUT/rank{r}.log``, its
    last issued call in ``OUT/rank{r}.status`` (hang reports), its calls in ``OUT/rank{r}.json`` and, on
    an exception, the traceback in ``OUT/rank{r}.err``. It exits without interpreter teardown.
    """
    marks = {"launch": launched, "entry": time.monotonic()}
    os.setsid()
    _die_with_parent()
    out = Path(out_s)
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    os.environ[RUN_DIR] = out_s
    status = os.open(out / f"rank{rank}.status", os.O_WRONLY | os.O_CREAT, 0o644)
    beat = threading.Thread(target=_heartbeat, args=(out, rank, marks, status), daemon=True, name="commgate-heartbeat")
    beat.start()

    code, scenario = 0, None
    try:
        links.enter()  # a shaped-link run: this rank's node, before any socket is opened
        links.from_environment()  # a bad link description is refused before the run, not when it is reported
        with open(spec, "rb") as f:
            scenario = pickle.load(f)
        run_rank(
            scenario,
            rank=rank,
            world_size=world,
            out_dir=out,
            init_method=f"file://{store}",
            marks=marks,
            faults=faults,
        )
        backend = resolve_backend(scenario)
        local = len(started_ranks(scenario))  # rank processes on this host
        meta = {"backend": backend, "marks": marks, "stack": stack(backend, local) if rank == 0 else {}}
        atomic_write_json(out / f"rank{rank}.meta.json", meta)
    except BaseException as exc:
        from commgate.run import interpose

        if interpose.INSTALLED is not None:  # the call issued last, now (the heartbeat writes it late)
            _write_status(status, interpose.INSTALLED.describe_last())
        if isinstance(exc, ImportError) and scenario is not None and scenario.trainer != "commgate":
            from commgate.model.trainers import TRAINERS  # a trainer installed broken (its import raises)

            exc = TRAINERS[scenario.trainer].broken(exc)
        # commgate's own one-line errors (what the user can mend: a trainer's job that is not its scenario's)
        # are their line alone; anything else, its traceback
        one_line = isinstance(exc, CommgateError) and "\n" not in str(exc)
        text = f"{type(exc).__name__}: {exc}" if one_line else traceback.format_exc()
        (out / f"rank{rank}.err").write_text(text)
        code = 1  # at once: no process-group shutdown (which would fail the peers) before the launcher sees it
    sys.stdout.flush()
    sys.stderr.flush()
    _end_session()
    os._exit(code)


def _end_session() -> None:
    """Kill what the rank started and left running (a workload's ``subprocess.Popen``, their children, a
    pool of compile workers): every other process of the rank's session, found in /proc (Linux), while the
    rank still lives, so that the session's id can be no other's yet."""
    me, session = os.getpid(), os.getsid(0)
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != me and _session_of(entry) == session:
                with contextlib.suppress(OSError):  # gone meanwhile, or not ours to kill
                    os.kill(int(entry.name), signal.SIGKILL)


def _session_of(proc: Path) -> int | None:
    """The session id of the process /proc/PID (``stat``'s sixth field, after the command's ``(name)``)."""
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None
