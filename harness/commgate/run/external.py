"""Capture an unmodified torch.distributed program: what a rank of a job started by ``commgate capture``
(or by any launcher, with ``COMMGATE_CAPTURE=DIR`` in its environment) does before the user's script runs.

``commgate capture`` puts ``bootstrap/`` first on ``PYTHONPATH``; its ``sitecustomize`` calls ``activate``
in every Python process the launcher starts. In a rank (``RANK`` set) with ``COMMGATE_CAPTURE`` set it

* wraps ``torch.distributed.init_process_group``: the backend the program asks for (gloo, nccl; None or
  ``cpu:gloo,cuda:nccl`` as torch resolves them) becomes the real backend under commgate's capturing
  process group (``commgate.run.interpose``), so every collective of every group is recorded as in a
  commgate run; ``new_group(backend=<the same>)`` is left to the default (the capturing) backend too;
* finds the step boundaries without the program's help: a step begins at the first module forward after
  initialisation or after the last optimizer step (torch's global forward pre-hook, registered only
  while a step is awaited; ``torch.optim.optimizer``'s global step hooks arm it and label the
  optimizer's calls) and runs until the next one begins (the last, until the job ends);
  ``commgate.capture.step()`` called by the program takes over: each call begins the next step;
* labels the calls of DeepSpeed's ``engine.backward`` and ``engine.step`` with their phases, where the job
  uses DeepSpeed (``ENGINE_PHASES``);
* writes, when the process ends (normally, by an exception, by ``sys.exit`` or by SIGTERM or SIGHUP, as torchrun
  stops the others when one rank fails), ``DIR/rank{r}.json`` (the calls and step windows, as a
  commgate run's rank writes them) and ``DIR/rank{r}.meta.json`` (the job, the launcher, the host, the
  versions, how the process ended).

Nothing of this runs, and torch is not imported, in a process without ``RANK`` (the launcher itself), unless
it imports torch.distributed and calls ``init_process_group`` with a ``rank`` (a worker of
``torch.multiprocessing.spawn``): then it is a rank from that call on (``arm``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commgate.core.errors import CommgateError
from commgate.core.fsutil import atomic_write_json
from commgate.run.capture import StepWindow, write_rank_calls

CAPTURE_ENV = "COMMGATE_CAPTURE"
"""The directory the ranks write their capture to; set by ``commgate capture``, or by hand."""
JOB_ENV = "COMMGATE_CAPTURE_JOB"
"""The job's identity, the same in every rank (``commgate capture`` sets it; else read off the launcher)."""
COMMAND_ENV = "COMMGATE_CAPTURE_COMMAND"
"""The command ``commgate capture`` ran (provenance)."""
OWNER_ENV = "COMMGATE_CAPTURE_OWNER"
"""Set by a rank's capture to ``<pid>:<rank>``: a process it starts, which inherits ``RANK``, is not that rank."""
ARMED_ENV = "COMMGATE_CAPTURE_RANK_FROM_INIT"
"""Set by ``arm`` in a process whose rank came from its ``init_process_group`` call, not its environment."""
META_VERSION = 1
BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
"""The directory holding the ``sitecustomize`` that calls ``activate``."""


def launcher() -> str:
    """Who started this rank, from what the launchers leave in the environment: torchrun (``accelerate
    launch`` starts it, with its ``ACCELERATE_MIXED_PRECISION``), srun, DeepSpeed's launcher (its
    ``CROSS_RANK`` and ``LOCAL_SIZE``: ``deepspeed/launcher/launch.py``), a process that named its own rank."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        torchrun = "torchrun (under srun)" if "SLURM_JOB_ID" in os.environ else "torchrun"
        return f"accelerate launch ({torchrun})" if "ACCELERATE_MIXED_PRECISION" in os.environ else torchrun
    if "SLURM_PROCID" in os.environ:
        return "srun"
    if "CROSS_RANK" in os.environ and "LOCAL_SIZE" in os.environ:
        return "deepspeed (its launcher)"
    if os.environ.get(ARMED_ENV):
        return "a process that named its own rank (init_process_group(rank=...): torch.multiprocessing.spawn)"
    return "unknown (COMMGATE_CAPTURE in the environment)"


def job_id() -> str:
    """The same string in every rank of one job (and, as far as the launcher tells, not in another)."""
    if os.environ.get(JOB_ENV):
        return os.environ[JOB_ENV]
    keys = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT")
    return "/".join(f"{k}={os.environ.get(k, '')}" for k in keys)


@dataclass
class _State:
    """This rank's capture, between ``activate`` and the process's end."""

    out: Path
    rank: int
    requested: str | None = None
    inner: str | None = None
    shown: str | None = None
    """The backend's name ``dist.get_backend`` gives the job: what torch would give for the one it asked for."""
    not_captured: str | None = None
    """Why nothing is recorded (a backend commgate does not interpose), or None."""
    recorder: Any = None
    explicit: bool = False
    """``commgate.capture.step()`` was called: the hooks no longer mark steps."""
    optimizer_steps: int = 0
    """Optimizer steps seen by the global step hooks (none: only the first module forward began a step)."""
    begun_ns: int | None = None
    begun_busy: int | None = None
    clock: Any = None
    hooks: list[Any] = field(default_factory=list)
    awaiting: Any = None
    """The forward pre-hook's handle while the next step's start is awaited."""
    ended: str = "running"
    written: bool = False
    """``finish`` has begun (it runs once)."""
    done: bool = False
    """``finish`` has written both files."""
    pending: int | None = None
    """A signal that arrived while ``finish`` was writing: re-raised once it has."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """The meta's parts known once the group is up (versions, stack), gathered then: the exit path is short."""
    started: float = field(default_factory=time.time)


STATE: _State | None = None


def activate() -> None:
    """Set up this process's capture when it is a rank of a captured job (``RANK`` and ``COMMGATE_CAPTURE``),
    not a process a rank started (a DataLoader worker, a ``subprocess``): it inherits the rank's variables,
    and its capture, written when it ended, replaced the rank's (found by an adversarial pass)."""
    global STATE
    out, rank = os.environ.get(CAPTURE_ENV), os.environ.get("RANK")
    if not out or rank is None or STATE is not None:
        return
    if os.environ.get(OWNER_ENV, "").partition(":")[2] == rank:  # this rank's process is another, an ancestor
        return
    os.environ[OWNER_ENV] = f"{os.getpid()}:{rank}"
    where = Path(out).absolute()  # where the job started: it may change its working directory later
    try:  # said as the rank starts, not found when it ends (its calls then lost)
        from commgate.core import env
        from commgate.core.fsutil import check_writable_dir
        from commgate.run.stamps import OFF

        check_writable_dir(where, what=f"rank {rank}'s capture", fix=f"set {CAPTURE_ENV} to a writable directory")
        env.switch(OFF, True)  # read as the group is set up: a bad value raised inside the job's init_process_group
    except CommgateError as exc:
        print(f"commgate: {exc}; this rank runs uncaptured", file=sys.stderr, flush=True)
        return
    STATE = _State(out=where, rank=int(rank))
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    init, new_group, get_backend = c10d.init_process_group, c10d.new_group, c10d.get_backend

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        return _init(init, backend, args, kwargs)

    def new_group_(*args: Any, **kwargs: Any) -> Any:
        state = STATE
        if state is not None and state.inner and _resolve(kwargs.get("backend")) == state.inner:
            kwargs["backend"] = None  # the default (capturing) backend over the same real one
        return new_group(*args, **kwargs)

    def get_backend_(*args: Any, **kwargs: Any) -> Any:
        """The backend's name as the job would see it uncaptured (code branches on it; ``monitored_barrier``
        refuses any but gloo), not the capturing backend's."""
        name = get_backend(*args, **kwargs)
        state = STATE
        if name == interpose.BACKEND_NAME and state is not None and state.shown is not None:
            return state.shown
        return name

    from commgate.run import interpose

    for module in (dist, c10d):
        setattr(module, "init_process_group", init_process_group)  # noqa: B010 - mypy sees no such attribute
        setattr(module, "new_group", new_group_)  # noqa: B010
        setattr(module, "get_backend", get_backend_)  # noqa: B010
    atexit.register(finish, "exited")
    hook = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if STATE is not None:
            STATE.ended = f"raised {kind.__name__}"
        hook(kind, exc, tb)

    sys.excepthook = excepthook
    handled = False
    for number in (signal.SIGTERM, signal.SIGHUP):  # a hang-up (torchrun passes it on) keeps the capture too
        if signal.getsignal(number) is signal.SIG_DFL:
            signal.signal(number, _terminated)
            handled = True
    if handled:
        _watch_signals()


BLOCKED_GRACE_S = 1.0
"""How long a SIGTERM or SIGHUP waits for the rank's own thread to take it before the watcher does."""


def _watch_signals() -> None:
    """A Python signal handler runs in the main thread only between bytecodes: a rank blocked in a call (both
    ranks of a job waiting in gloo on each other) never ran it, and torchrun's SIGKILL 30 s later lost the
    capture (found by an adversarial pass). Python's C handler also writes the signal's number to the wakeup
    fd (``signal.set_wakeup_fd``): a thread reading it writes the capture where the main thread has not begun
    to within ``BLOCKED_GRACE_S``, then ends the rank (exit status 128 + the signal, as a shell reports a
    death by it; a thread cannot restore the default action). Not where the program has its own wakeup fd
    (asyncio's); a process forked from the rank (a DataLoader worker) drops it, so its signals stay its own."""
    import threading

    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    os.register_at_fork(after_in_child=_forget_wakeup)

    def watch() -> None:
        while data := os.read(read, 64):
            for signum in data:
                if signum not in (signal.SIGTERM, signal.SIGHUP) or signal.getsignal(signum) is not _terminated:
                    continue  # another signal, or one the program now handles itself (its own shutdown)
                deadline = time.monotonic() + BLOCKED_GRACE_S
                while time.monotonic() < deadline and STATE is not None and not STATE.written:
                    time.sleep(0.02)
                if STATE is not None and not STATE.written:  # the main thread is blocked: write it here
                    finish(f"terminated by signal {signum}")
                    os._exit(128 + signum)

    threading.Thread(target=watch, name="commgate-signals", daemon=True).start()


def _forget_wakeup() -> None:
    import contextlib

    with contextlib.suppress(ValueError):  # forked from another thread than the main one: not Python's to drop
        signal.set_wakeup_fd(-1)


def arm(c10d: Any) -> None:
    """In a process of a captured job without ``RANK`` (``torch.multiprocessing.spawn`` passes a worker its
    rank as an argument, which the tutorial's DDP script hands to ``init_process_group``: such a job was not
    captured at all, found by an adversarial pass): ``init_process_group`` wrapped so that a call naming its
    ``rank`` sets ``RANK`` to it and sets up the capture (``activate``) before the group is made. The rank is
    the call's ``rank``, else its ``init_method`` URL's (``tcp://host:port?rank=0&world_size=2``, torch's
    documented form), else the ``RANK`` the worker set itself before the call (each was not captured, found by
    an adversarial pass). A call with none (``env://`` with no ``RANK``) is torch's own error."""
    import inspect

    init = c10d.init_process_group
    signature = inspect.signature(init)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:  # torch says what is wrong with the call
            given = {}
        url = given.get("init_method")
        rank = _named(given.get("rank"), url, "rank", "RANK")
        world = _named(given.get("world_size"), url, "world_size", "WORLD_SIZE")
        if rank is not None and STATE is None:
            os.environ["RANK"] = str(rank)
            os.environ[ARMED_ENV] = "1"
            if world is not None:
                os.environ["WORLD_SIZE"] = str(world)  # what the capture's meta records (one host: local too)
            c10d.init_process_group = init  # what activate wraps: torch's own
            activate()
            return c10d.init_process_group(*args, **kwargs)
        return init(*args, **kwargs)

    c10d.init_process_group = init_process_group


def _named(given: Any, url: Any, key: str, variable: str) -> int | None:
    """A rank or world size as torch takes it for ``init_process_group``: the argument (not its -1 default),
    else the ``init_method`` URL's query, else the environment variable (set by the process itself)."""
    from urllib.parse import parse_qs, urlparse

    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    if isinstance(url, str):
        with contextlib.suppress(ValueError):
            value = parse_qs(urlparse(url).query).get(key, [""])[-1]
            if value.isdigit():
                return int(value)
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else None


def _resolve(backend: Any) -> str | None:
    """The real backend torch would pick for ``backend``: gloo or nccl, else None (not interposed)."""
    import torch

    name = str(backend).lower() if backend is not None else ""
    cuda = torch.cuda.is_available()
    if not name or name == "undefined":
        return "nccl" if cuda else "gloo"
    if "," in name or ":" in name:  # cpu:gloo,cuda:nccl
        devices = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return devices.get("cuda") if cuda and "cuda" in devices else devices.get("cpu")
    return name if name in ("gloo", "nccl") else None


def _cpu_too(backend: Any) -> bool:
    """Whether torch would give the group gloo for its CPU tensors beside NCCL: no backend named (torch then
    takes every device's default), or one naming ``cpu:gloo``."""
    name = str(backend).lower() if backend is not None else ""
    return not name or name == "undefined" or "cpu:gloo" in name


def _init(init: Any, backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``init_process_group`` over the capturing backend, which holds the one the program asked for."""
    from commgate.run import interpose

    state = STATE
    if state is None:  # not reached: activate set it before installing this wrapper
        return init(backend, *args, **kwargs)
    inner = _resolve(backend)
    again = state.recorder is not None  # the job destroyed its group and sets up another (found by an adversarial pass)
    if inner is None or (again and inner != state.inner):
        state.not_captured = (
            f"the job set up a group over {backend!r} after one over {state.inner}; commgate captures one backend a job"
            if again and inner is not None
            else f"the job asked for backend {backend!r}; commgate interposes gloo and nccl"
        )
        return init(backend, *args, **kwargs)
    state.requested = None if backend is None else str(backend)
    state.inner = inner
    from torch.distributed import Backend

    from commgate.run.recorder import Recorder

    state.shown = str(Backend(backend)) if backend is not None else "undefined"  # as torch names it
    kept = state.recorder  # the calls of the groups destroyed so far stay in the capture
    recorder = (lambda _: kept) if again else Recorder
    state.recorder = interpose.install(inner, state.rank, cpu_too=_cpu_too(backend), recorder=recorder)
    done = init(interpose.BACKEND_NAME, *args, **kwargs)
    import torch.distributed as dist

    state.recorder.rank = state.rank = dist.get_rank()
    if again:  # the hooks and the meta's parts are the first group's
        return done
    state.fixed = _fixed(state)
    _engine_phases()
    if not state.explicit:
        _auto_steps(state)
    return done


def _auto_steps(state: _State) -> None:
    """Steps from the optimizer: a step begins at the first module forward after initialisation or after
    the last optimizer step, and ends where the next one begins (the last, when the job ends), so that what
    an engine sends after its optimizer's step (ZeRO's parameter all-gather) stays in that step."""
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def forward_pre(*_: Any) -> None:
        if state.awaiting is not None:
            state.awaiting.remove()
            state.awaiting = None
        _end(state)
        _begin(state)

    before: list[str] = []

    def optimizer_pre(*_: Any) -> None:
        if state.recorder is not None:
            before.append(state.recorder.phase)
            state.recorder.phase = "optimizer"

    def optimizer_post(*_: Any) -> None:
        state.optimizer_steps += 1
        if state.recorder is not None and before:
            state.recorder.phase = before.pop()
        if state.explicit:
            return
        if state.awaiting is None:
            state.awaiting = register_module_forward_pre_hook(forward_pre)

    state.hooks += [register_optimizer_step_pre_hook(optimizer_pre), register_optimizer_step_post_hook(optimizer_post)]
    state.awaiting = register_module_forward_pre_hook(forward_pre)


ENGINE_PHASES = {"backward": "backward", "step": "optimizer"}
"""DeepSpeed's engine methods and the phase of the calls they issue (its ZeRO reductions run in
``engine.backward`` after autograd returns; its gradient norm and parameter gathers around the inner
optimizer's step in ``engine.step``), as commgate's own ZeRO workload labels them."""


def _engine_phases() -> None:
    """Label the calls DeepSpeed's engine issues in ``backward`` and ``step`` with their phase, where the job
    imported DeepSpeed (its engine is imported with it); nothing otherwise."""
    import functools

    engine = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine, "DeepSpeedEngine", None)
    if cls is None or getattr(cls, "_commgate_phases", False):
        return
    from commgate.run.interpose import phase

    def labelled(method: Any, name: str) -> Any:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return method(self, *args, **kwargs)

        return call

    for method, name in ENGINE_PHASES.items():
        setattr(cls, method, labelled(getattr(cls, method), name))
    cls._commgate_phases = True


def _begin(state: _State) -> None:
    """Begin the next step (numbered after the windows so far)."""
    from commgate.run.threadclock import ThreadClock

    rec = state.recorder
    if rec is None:
        return
    rec.poll()
    rec.step, rec.phase = len(rec.windows), "forward"
    if state.clock is None:
        state.clock = ThreadClock()
    state.begun_busy = state.clock.busy_ns()
    state.begun_ns = rec.now()


def _end(state: _State) -> None:
    """End the step begun last, and label what follows as the next one (until its window begins)."""
    rec = state.recorder
    if rec is None or state.begun_ns is None:
        return
    rec.poll()
    ended = rec.now()
    busy = state.clock.busy_ns() if state.clock is not None else None
    blocked = None
    if busy is not None and state.begun_busy is not None:
        blocked = max(0, ended - state.begun_ns - (busy - state.begun_busy))
    rec.windows.append(
        StepWindow(rank=rec.rank, step=rec.step, start_ns=state.begun_ns, end_ns=ended, blocked_ns=blocked)
    )
    state.begun_ns = None
    rec.step, rec.phase = len(rec.windows), "forward"


def step() -> None:
    """``commgate.capture.step()``: begin the next step here (the first call ends initialisation); from
    the first call on, the optimizer no longer marks steps."""
    state = STATE
    if state is None:
        return
    if not state.explicit:
        state.explicit = True
        if state.awaiting is not None:
            state.awaiting.remove()
            state.awaiting = None
        if state.begun_ns is not None and state.recorder is not None:  # a step the hooks began: not one
            state.begun_ns = None
            state.recorder.step = len(state.recorder.windows)
    _end(state)
    _begin(state)


def _terminated(signum: int, _frame: Any) -> None:
    state = STATE
    if state is not None and state.written and not state.done:  # finish is writing (atexit): let it end
        state.pending = signum
        return
    finish(f"terminated by signal {signum}")
    _die(signum)


def _die(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def finish(how: str) -> None:
    """Write this rank's calls and its meta (once): what it did, however it ended."""
    state = STATE
    if state is None or state.written:
        return
    state.written = True
    if how == "exited" and state.ended != "running":
        how = state.ended
    _end(state)  # the last step ends with the program
    rec = state.recorder
    calls = rec.drain() if rec is not None else []
    windows = list(rec.windows) if rec is not None else []
    meta = _meta(state, how, len(windows))
    try:
        state.out.mkdir(parents=True, exist_ok=True)
        clock = rec.clock() if rec is not None else None
        write_rank_calls(state.out / f"rank{state.rank}.json", calls, windows, clock)
        atomic_write_json(state.out / f"rank{state.rank}.meta.json", meta)
    except (OSError, CommgateError) as exc:  # the directory went away or became read-only as the job ran
        print(f"commgate: rank {state.rank}'s capture was not written: {exc}", file=sys.stderr, flush=True)
    state.done = True
    if state.pending is not None:
        _die(state.pending)


def _step_marks(state: _State, steps: int) -> str:
    """What marked the steps, read after "N step(s) by" (a job without an optimizer was said to be stepped "by
    optimizer step hooks": found by an adversarial pass)."""
    if state.explicit:
        return "commgate.capture.step()"
    if state.optimizer_steps:
        return "optimizer step hooks"
    fix = "commgate.capture.step() in the job marks them"
    if steps:
        return f"its first module forward alone (no optimizer step: one step to the job's end; {fix})"
    return f"nothing (no module forward, no optimizer step: every call is the job's initialisation; {fix})"


def _fixed(state: _State) -> dict[str, Any]:
    """What the meta says that is known once the group is up (looked up then, not on the exit path)."""
    from commgate.core.provenance import environment
    from commgate.run.rank import stack

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return {"stack": stack(state.inner, local) if state.inner else {}, "versions": environment()}


def _meta(state: _State, how: str, steps: int) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {
        "meta_version": META_VERSION,
        "job": job_id(),
        "rank": state.rank,
        "world_size": world,
        "local_world_size": local,
        "host": socket.gethostname(),
        "launcher": launcher(),
        "command": os.environ.get(COMMAND_ENV) or shlex.join(sys.argv),
        "requested_backend": state.requested,
        "backend": state.inner,
        "not_captured": state.not_captured
        or (None if state.inner else "the rank never set up a process group (torch.distributed.init_process_group)"),
        "steps": steps,
        "step_marks": _step_marks(state, steps),
        "ended": how,
        "started": state.started,
        **(state.fixed or _fixed(state)),
    }
