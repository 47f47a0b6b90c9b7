"""Start the ranks of a scenario on this machine and collect their capture.

Each rank is a fresh process forked from a forkserver that has imported torch (and, on a machine without
GPUs, DeepSpeed) once: a rank starts in milliseconds instead of the seconds those imports take, and no
state passes from one scenario to the next. (No fork after torch is imported in this process, which
imports neither; the forkserver itself never initialises CUDA.) Every rank runs in its own session, so
that it and anything it started are killed at once. Ranks meet through a ``FileStore`` in a private
temporary directory: no port to collide with; their gloo sockets listen on the loopback interface only.
The launcher fails a run when a rank raises or dies (the other ranks are killed at once), when the
ranks stall, or at the deadline, with the reason ``commgate.run.diagnose`` reads from the ranks (the rank
to blame, where their call sequences part, what each last issued), and in every case leaves no rank
process behind. A launcher killed outright takes its forkserver with it, and the kernel then kills the
ranks (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing import connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from commgate.core import env
from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario
from commgate.run import budget
from commgate.run.capture import Capture, merge, timeline
from commgate.run.diagnose import POLL_S, Exits, Watchdog, failure, hang_report, phase, stall_report
from commgate.run.emulate import started_ranks
from commgate.run.extensions import build_locks, builder, use_environment_dir
from commgate.run.inject import Faults
from commgate.run.links import Network
from commgate.run.rank import child
from commgate.run.workloads import PRELOADS


class RunError(CommgateError):
    """A scenario's run failed: a rank raised, died, or the deadline passed."""


# What a rank would otherwise import for seconds: torch, what DDP imports on construction (dynamo), DTensor.
PRELOAD = (
    "commgate.run.quiet",  # first: the forkserver's own output to its log
    "commgate.run.rank",
    "commgate.run.interpose",
    "torch._dynamo",
    "torch.distributed.tensor.parallel",
    "commgate.run.workloads.ddp",
    "commgate.run.workloads.tp",
)
# DeepSpeed's import probes the accelerator, which on a GPU machine initialises CUDA: a process forked
# after that could not use it. It is preloaded only where no GPU is visible.
PRELOAD_CPU = (
    "deepspeed",
    "commgate.run.deepspeed_ops",
    "deepspeed.pipe",
    "deepspeed.moe.layer",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by deepspeed.initialize; it compiles (inductor)
    "commgate.run.workloads.zero",
    "commgate.run.workloads.pp",
)

PRELOAD_LAST = ("commgate.run.build_stamps",)
"""Built after DeepSpeed's op: a start that waits on a lock DeepSpeed's killed build left waits there before
starting a build of its own, which the bounded start's kill would leave locked in turn."""

_CONTEXT: ForkServerContext | None = None


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU device (without importing torch)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def planned_backend(scenario: Scenario) -> str:
    """The backend local ranks will run ``scenario`` on (``commgate.run.rank.resolve_backend``'s answer), told
    without importing torch: "auto" is NCCL where a GPU is visible."""
    if scenario.emulate:
        return "emulated"
    if scenario.backend == "auto":
        return "nccl" if gpu_visible() else "gloo"
    return scenario.backend


def computes_on_cpu(scenario: Scenario) -> bool:
    """Whether local ranks compute ``scenario`` on CPUs: gloo's, and an emulated run's, whatever the machine
    holds (``commgate.run.rank``'s device)."""
    return planned_backend(scenario) in ("gloo", "emulated")


LOG_ENV = "COMMGATE_FORKSERVER_LOG"
"""Read by ``commgate.run.quiet`` in the forkserver (imported by nothing else, so that no other process
that inherits the variable sends its output there)."""


def forkserver_log() -> Path:
    """Where this process's forkserver writes what it prints (``commgate.run.quiet``); removed when this
    process exits, unless the forkserver failed to start."""
    return Path(tempfile.gettempdir()) / f"commgate-forkserver-{os.getpid()}.log"


def _remove_log() -> None:
    if not _START_FAILED:
        with contextlib.suppress(OSError):
            forkserver_log().unlink()


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the forkserver's ranks register their semaphores with it)
    with its stderr in the forkserver's log: at exit it warns of those a framework leaked in a rank
    (torchtitan's dataset and progress-bar locks: "There appear to be 2 leaked semaphore objects") and
    removes them; the warning is the framework's chatter, not the user's. A tracker already running is
    left as it is."""
    from multiprocessing import resource_tracker

    log = os.open(forkserver_log(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(log, 2)  # the tracker inherits this process's fd 2 (resource_tracker.ensure_running)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


PRELOAD_ENV = "COMMGATE_PRELOAD"
"""The trainers ``commgate.run.preload`` imports in the forkserver, comma-separated."""


def _context(trainers: Iterable[str] = ()) -> ForkServerContext:
    """The forkserver every rank is forked from, started on first use with torch preloaded, and, where no
    GPU is visible, DeepSpeed and the ``trainers`` of the scenarios to run (``commgate.run.preload``)."""
    global _CONTEXT
    if _CONTEXT is None:
        use_environment_dir()  # DeepSpeed's op built once per environment (commgate.run.extensions)
        os.environ[LOG_ENV] = str(forkserver_log())
        atexit.register(_remove_log)
        atexit.register(_forkserver_at_exit)
        _quiet_resource_tracker()
        ctx = multiprocessing.get_context("forkserver")
        if gpu_visible():  # what imports probe the accelerator: a process forked after CUDA's start cannot use it
            ctx.set_forkserver_preload([*PRELOAD, *PRELOAD_LAST])
        else:
            os.environ[PRELOAD_ENV] = ",".join(sorted(set(trainers) & PRELOADS.keys()))
            ctx.set_forkserver_preload([*PRELOAD, *PRELOAD_CPU, *PRELOAD_LAST, "commgate.run.preload"])
        _CONTEXT = ctx
    return _CONTEXT


def start_forkserver(trainers: Iterable[str]) -> None:
    """Start the ranks' forkserver now, with the ``trainers`` preloaded, and return: its imports (seconds)
    overlap what the caller does before its first run (``commgate run`` loading the scenarios). The first run
    waits for it, bounded, as it waits for one it starts (``_forkserver_ready``), and says why it failed."""
    ctx = _context(trainers)
    if _START_FAILED:
        return

    # what failed is said by the first run's own start (_forkserver_ready)
    threading.Thread(target=_probe, args=(ctx, []), name="commgate-forkserver-start", daemon=True).start()


def _probe(ctx: ForkServerContext, errors: list[BaseException]) -> None:
    """Fork one process that does nothing from the forkserver (starting it if it is not running), and wait
    for it; what stopped it (the forkserver died, or was stopped) goes to ``errors``."""
    try:
        probe = ctx.Process(target=os.getpid, name="commgate-forkserver-probe", daemon=True)
        probe.start()
        probe.join()
    except (OSError, EOFError) as e:
        errors.append(e)


FORKSERVER_START_S = 600.0
"""How long the forkserver may take to start: torch's and DeepSpeed's imports, and on a first run DeepSpeed's
CPU comm op build (minutes on two busy cores). ``COMMGATE_FORKSERVER_START_S`` sets another bound."""
LOCK_NOTE_S = 30.0
"""After this long (or half the bound, if less), a start still waiting where a torch-extension build lock
exists says so on stderr."""
_START_FAILED: list[str] = []
"""Why the forkserver failed to start in this process: the later scenarios fail at once with it."""


def _forkserver_ready(ctx: ForkServerContext, progress: Callable[[str], None] | None = None) -> None:
    """Wait, bounded, until the forkserver forks (its first start imports and builds for minutes; a build
    lock that a killed build left behind would hold it forever). Past the bound, stop it and raise
    ``RunError`` naming any build lock and the bound's variable."""
    if _START_FAILED:
        raise RunError(_START_FAILED[0])
    bound = env.seconds("COMMGATE_FORKSERVER_START_S", FORKSERVER_START_S)
    errors: list[BaseException] = []
    waiter = threading.Thread(target=_probe, args=(ctx, errors), daemon=True)
    waiter.start()
    begun, told = time.monotonic(), False
    while waiter.is_alive():
        waited = time.monotonic() - begun
        if progress and waited > 1:
            progress(
                f"starting the ranks' forkserver (imports; a first run builds DeepSpeed's op and commgate's "
                f"completion stamps), {waited:.0f} s"
            )
        if waited > bound:
            _stop_forkserver()
            waiter.join(10)
            _START_FAILED.append(_start_report(f"did not start within {bound:g} s"))
            raise RunError(_START_FAILED[0])
        if not told and waited > min(LOCK_NOTE_S, bound / 2) and (locks := build_locks()):
            told = True  # a build still running is the first run's, not a lock to delete (said once, either way)
            words = _lock_words(locks)
            print(f"commgate: the ranks' forkserver has waited {waited:.0f} s; {words}", file=sys.stderr)
        waiter.join(POLL_S)
    if errors and "AF_UNIX path too long" in str(errors[0]):  # its socket lies under TMPDIR
        where = tempfile.gettempdir()
        _START_FAILED.append(
            f"the ranks' forkserver cannot listen: its Unix socket's path, TMPDIR ({where}: {len(where)} characters) "
            "and the 34 that multiprocessing adds, is over the 107 a socket's path may have; set TMPDIR to a "
            "shorter directory (e.g. /tmp)"
        )
        raise RunError(_START_FAILED[0])
    if errors:
        what = f"exited while starting ({type(errors[0]).__name__})"
        raised = _raised(forkserver_log())
        _START_FAILED.append(_start_report(what, raised))
        raise RunError(_START_FAILED[0])


def _raised(log: Path) -> str:
    """The exception a forkserver that died at its start wrote last in its output (``log``), or ''."""
    from commgate.run.diagnose import exception_line

    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return exception_line(text).strip() if "Traceback" in text else ""


def _start_report(what: str, raised: str = "") -> str:
    """Why the forkserver did not start, and the fix: what it raised (a cache directory it cannot create, a
    warning made an error), a build lock's meaning, or else more time."""
    start = "it imports torch and DeepSpeed and, on a first run, builds DeepSpeed's CPU comm op and commgate's "
    start += f"completion stamps; its output: {forkserver_log()}"
    if raised:
        return f"the ranks' forkserver {what}: it raised {raised} ({start}); fix that and run again"
    locks = build_locks()
    fix = _lock_words(locks) if locks else "set COMMGATE_FORKSERVER_START_S (seconds) to wait longer"
    return f"the ranks' forkserver {what} ({start}); {fix}"


EXTENSIONS = {"deepspeed_shm_comm": "DeepSpeed's CPU comm op", "commgate_stamps": "commgate's completion stamps"}
"""The extensions the forkserver builds, by the start of their build directory's name."""


def _lock_words(locks: list[Path]) -> str:
    """What the build locks mean: one a killed build left, first (delete it: every later build waits for it),
    else a build at work (wait)."""
    builders = {lock: builder(lock) for lock in locks}
    stale = [lock for lock, pid in builders.items() if pid is None]
    if stale:
        return (
            f"{stale[0]} is a build lock of torch's C++ extensions, which a killed build leaves behind and every "
            "later build waits for, and no process is building there: delete it"
        )
    lock = locks[0]
    name = next((words for key, words in EXTENSIONS.items() if lock.parent.name.startswith(key)), lock.parent.name)
    return (
        f"torch is building {name} in {lock.parent} (pid {builders[lock]}), once per environment: "
        "a few minutes on 2 busy cores; waiting"
    )


def _forkserver_tree() -> list[int]:
    """The forkserver this process started and every process under it (its ranks, a build's compilers)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree = [pid for pid, ppid in parents.items() if ppid == os.getpid() and _is_forkserver(pid)]
    for pid in tree:  # the list grows as it is walked: each process's children join it
        tree += [child for child, ppid in parents.items() if ppid == pid]
    return tree


def _stop_forkserver(tree: list[int] | None = None) -> None:
    """Kill the forkserver this process started and everything it started (a build's compilers: the next
    start begins afresh)."""
    for pid in _forkserver_tree() if tree is None else tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


EXIT_SETTLE_S = 2.0
"""How long a run's exit waits for its forkserver to let go of a build lock before leaving it to finish."""


def _forkserver_at_exit() -> None:
    """At this process's exit its forkserver (torch and DeepSpeed imported) would take seconds to unwind after
    it, an orphan meanwhile: it has nothing to keep, so it is killed, unless a build of its own is under way (a
    build killed halfway leaves a lock every later one waits for): then it finishes that, and says so. Another
    process's build (another run's, another job's on the machine) is not its own: that was said of it, and the
    forkserver left to unwind as an orphan (found by an adversarial pass). A lock it holds only to check its
    build (milliseconds) is waited for, in silence: killed then, it left the lock, and every later run waited
    10 minutes on it (CI)."""
    tree = _forkserver_tree()
    settled = time.monotonic() + EXIT_SETTLE_S
    while (locks := build_locks()) and any(builder(lock, among=tree) for lock in locks):
        if time.monotonic() > settled:
            break
        time.sleep(POLL_S)
    else:
        _stop_forkserver(tree)
        return
    print("commgate: the ranks' forkserver is finishing a build of DeepSpeed's op or commgate's stamps; it exits "
          "when that is done", file=sys.stderr)  # fmt: skip


def _is_forkserver(pid: int) -> bool:
    try:
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


MARKER = ".commgate-launcher"
"""The file a launcher leaves in its private directory: only a directory holding it is commgate's to sweep."""


def _private_dir(workdir: Path | None) -> Path:
    """This launcher's private directory for its ranks' files, marked as commgate's (``MARKER``)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"commgate-{os.getpid()}-", dir=workdir))
    (tmp / MARKER).write_text(f"{os.getpid()}\n")
    return tmp


def _sweep_orphans(parent: Path) -> None:
    """Remove the private directories of launchers that were killed outright (SIGKILL leaves no chance
    to clean up): ``commgate-{pid}-*`` holding commgate's marker, whose launcher process no longer
    exists. Anything else of that name is left alone (a user's ``commgate-2024-backup``)."""
    for d in parent.glob("commgate-*-*"):
        pid = d.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid() or not (d / MARKER).is_file():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            continue


def _kill(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            for kill in (os.killpg, os.kill):  # the rank's session, or the rank before it made one
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(timeout=10)


WAKE_S = 0.1
"""How often the launcher looks at its running ranks (the stall and hang watchdogs) when none exits: a rank's
exit wakes it at once."""
PROGRESS_S = 0.25
"""How often the live line's phase is read from the ranks' phase files and heartbeats."""
GRACE_S = 1.0
"""After the first failure, how long the launcher lets the others settle before it names the cause (the
rank that died can be reaped a moment after its peers have raised)."""


def _exits(procs: Sequence[BaseProcess]) -> Exits:
    """Each started rank's exit status, None while it runs (a rank's process is named ``commgate-rank{r}``;
    an emulated run starts some ranks of the job only)."""
    return {int((p.name or "").removeprefix("commgate-rank")): p.exitcode for p in procs}


def loopback_env() -> dict[str, str]:
    """What makes gloo's (and NCCL's bootstrap) sockets of local ranks listen on the loopback interface
    only, whatever the host name resolves to or the caller's ``GLOO_SOCKET_IFNAME`` says."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    lo = names[0] if names else "lo"
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def loopback_store(world: int, timeout_s: float) -> Any:
    """A master ``TCPStore`` that listens on 127.0.0.1 only (given its own bound socket: torch's would
    listen on every interface)."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        sock.getsockname()[1],
        world,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store


RANK_MEMORY = 512 << 20
"""What one local rank holds with torch and DeepSpeed imported and a reduced-scale model (bytes)."""
RANKS_PER_CORE = 8


def local_rank_limit() -> int:
    """The most ranks ``launch_local`` starts here: RANKS_PER_CORE per core, and no more than the
    machine's memory holds at RANK_MEMORY each (a million-rank scenario is refused, not forked)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    return max(2, min(RANKS_PER_CORE * (os.cpu_count() or 1), memory // RANK_MEMORY))


def launch_local(
    scenario: Scenario,
    *,
    deadline_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    workdir: Path | None = None,
    faults: Faults | None = None,
    network: Network | None = None,
    trainers: Iterable[str] = (),
) -> Capture:
    """Run ``scenario`` on ``world_size`` local processes and return the merged capture.

    The ranks' private directory (store, status, logs) is made under ``workdir`` (default: the system's
    temporary directory) and removed afterwards. With ``network`` (``commgate.run.links.shaped``) the
    ranks run in its two namespaces, half on each side of its shaped link. ``trainers``: those of the
    scenarios the process will run, preloaded with this one's by the forkserver the first run starts.
    """
    # an emulated run starts rank 0 alone, or one rank per pipeline stage and tensor shard, at the declared
    # world size (commgate.run.emulate)
    ran = started_ranks(scenario)
    deadline = deadline_s if deadline_s is not None else scenario.deadline_s
    _admit(scenario, ran, deadline)
    _sweep_orphans(Path(workdir or tempfile.gettempdir()))
    tmp = _private_dir(workdir)
    procs: list[BaseProcess] = []
    try:
        _forkserver_ready(_context((*trainers, scenario.trainer)), progress)
        launched = time.monotonic()
        _start(scenario, ran, tmp, procs, launched=launched, faults=faults or Faults(), network=network)
        # the deadline runs from here: the forkserver's start has its own bound (_forkserver_ready)
        started = time.monotonic()
        _wait(scenario, ran, tmp, procs, started=started, deadline=deadline, progress=progress)
        if progress:
            progress("merging the ranks' captures")
        return _merged(scenario, ran, tmp)
    finally:
        _kill(procs)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)


def _admit(scenario: Scenario, ran: tuple[int, ...], deadline: float) -> None:
    """Refuse with ``RunError``, before anything starts, a run this machine cannot hold or finish: more
    ranks than it holds, more memory than it has, CPU steps that cannot end before the deadline."""
    if len(ran) > (limit := local_rank_limit()):
        raise RunError(
            f"{scenario.id}: world size {scenario.world_size} is more local ranks than this machine holds (at most "
            f"{limit}: {os.cpu_count()} cores, about {RANK_MEMORY >> 20} MiB a rank); run it under torchrun on a "
            "cluster (commgate run under torchrun), or see its prediction with commgate predict"
        )
    if (accelerator := os.environ.get("DS_ACCELERATOR", "cpu")) != "cpu" and not gpu_visible():
        raise RunError(
            f"{scenario.id}: DS_ACCELERATOR {accelerator!r}: local ranks on this machine (no GPU) run DeepSpeed on its "
            "CPU accelerator; unset it or set it to cpu"
        )
    if too_big := budget.refusal(scenario, RANK_MEMORY):
        raise RunError(too_big)
    if computes_on_cpu(scenario) and (too_slow := budget.slow(scenario, deadline)):
        raise RunError(too_slow)


def _start(
    scenario: Scenario,
    ran: tuple[int, ...],
    tmp: Path,
    procs: list[BaseProcess],
    *,
    launched: float,
    faults: Faults,
    network: Network | None,
) -> None:
    """Start a process for each rank of ``ran``, forked from the forkserver, each appended to ``procs`` as it
    starts (so that the caller kills the ones started when a later one fails to start)."""
    spec = tmp / "scenario.pickle"
    with open(spec, "wb") as f:
        pickle.dump(faults.apply(scenario), f)  # what runs; the caller predicts from what was declared
    ctx = _context()
    world = scenario.world_size
    for rank in ran:
        env = _rank_env(rank, world, network)
        args = (str(spec), rank, world, str(tmp / "store"), str(tmp), env, launched, faults)
        p = ctx.Process(target=child, args=args, name=f"commgate-rank{rank}", daemon=False)
        p.start()
        procs.append(p)


def _rank_env(rank: int, world: int, network: Network | None) -> dict[str, str]:
    """What a local rank adds to its environment: what torchrun sets (DeepSpeed insists on LOCAL_RANK), the
    sockets' interface, one thread."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    # nothing a local run opens is reachable from another machine (nor, shaped, from the host)
    env |= network.env(rank, world) if network is not None else loopback_env()
    return env | {"OMP_NUM_THREADS": "1"}


def _wait(
    scenario: Scenario,
    ran: tuple[int, ...],
    tmp: Path,
    procs: list[BaseProcess],
    *,
    started: float,
    deadline: float,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Wait until every rank has exited; raise ``RunError`` with the reason ``commgate.run.diagnose`` gives
    once a rank has failed (after GRACE_S for its peers to settle), when the ranks stall, or ``deadline``
    seconds after ``started``."""
    watchdog = Watchdog(tmp, ran, scenario.stall_s)
    shown = 0.0
    while any(p.exitcode is None for p in procs):
        if failure(scenario.id, _exits(procs), tmp):  # let the others settle, then name the cause
            settle = time.monotonic() + GRACE_S
            while any(p.exitcode is None for p in procs) and time.monotonic() < settle:
                time.sleep(POLL_S)
            raise RunError(str(failure(scenario.id, _exits(procs), tmp)))
        if time.monotonic() - started > deadline:
            slowly = budget.slow_compute(scenario) if computes_on_cpu(scenario) else None
            raise RunError(hang_report(scenario.id, tmp, ran, deadline, slowly))
        if (stalled := watchdog.stalled([p.exitcode is None for p in procs])) is not None:
            raise RunError(stall_report(scenario.id, tmp, _exits(procs), stalled))
        if progress and time.monotonic() - shown > PROGRESS_S:  # the phase files read a few times a second
            shown = time.monotonic()
            progress(f"{phase(tmp, ran, scenario.warmup_steps + scenario.steps)}, {shown - started:.0f} s")
        # back at once when a rank exits, and at the deadline itself: the ranks' own timeout (gloo's, the same
        # length, from their first call) must not pass before the deadline's report names each rank's call
        wake = min(WAKE_S, max(0.0, started + deadline - time.monotonic()) + 0.001)
        connection.wait([p.sentinel for p in procs if p.exitcode is None], wake)
    if reason := failure(scenario.id, _exits(procs), tmp):
        raise RunError(reason)


def _merged(scenario: Scenario, ran: tuple[int, ...], tmp: Path) -> Capture:
    """The ranks' calls merged into the run's capture, with the backend and stack rank 0 saw and the run's
    timeline. A rank that exited with status 0 without writing them (``os._exit(0)`` in the model's or the
    trainer's code skips the record a rank writes as it ends) is a one-line ``RunError``, not a traceback
    (found by an adversarial pass)."""
    files = [tmp / "rank0.meta.json", *(tmp / f"rank{r}.json" for r in ran)]
    if missing := [f.name for f in files if not f.exists()]:
        raise RunError(
            f"{scenario.id}: a rank exited with status 0 without writing its record ({', '.join(missing)}): "
            "os._exit(0) in the model's or the trainer's code ends a rank before it; let the step return"
        )
    meta = json.loads((tmp / "rank0.meta.json").read_text())
    return merge(
        [tmp / f"rank{r}.json" for r in ran],
        world_size=scenario.world_size,
        ranks=ran if scenario.emulate else None,
        scenario=scenario.id,
        warmup_steps=scenario.warmup_steps,
        steps=scenario.steps,
        backend=meta["backend"],  # as the ranks resolved it (auto: nccl on GPUs)
        timeline=timeline(meta["marks"] | {"done": time.monotonic()}),  # finish: up to the merge
        stack=meta["stack"],
    )
