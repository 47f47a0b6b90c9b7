"""Start the ranks of a scenario on this machine and collect their capture.

Each rank is a fresh process forked from a forkserver that has imported torch (and, on a machine without
GPUs, DeepSpeed) once: a rank starts in milliseconds instead of the seconds those imports take, and no
state passes from one scenario to the next. (No fork after torch is imported in this process, which
imports neither; the forkserver itself never initialises CUDA.) Every rank runs in its own session, so
that it and anything it started are killed at once. Ranks meet through a ``FileStore`` in a private
temporary directory: no port to collide with; their gloo sockets listen on the loopback interface only.
The launcher fails a run

* when a rank raises: naming the rank and showing its traceback (the other ranks are killed at once),
* when a rank dies by a signal: naming the rank and the signal,
* at the deadline: naming what each rank last issued (the collective it is stuck in),

and in every case leaves no rank process behind. A launcher killed outright takes its forkserver with
it, and the kernel then kills the ranks (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario
from commgate.run import budget
from commgate.run.capture import Capture, merge, timeline
from commgate.run.emulate import started_ranks
from commgate.run.inject import Faults
from commgate.run.links import Network
from commgate.run.rank import child

POLL_S = 0.02


class RunError(CommgateError):
    """A scenario's run failed: a rank raised, died, or the deadline passed."""


# What a rank would otherwise import for seconds: torch, what DDP imports on construction (dynamo), DTensor.
PRELOAD = (
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

_CONTEXT: ForkServerContext | None = None


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU device (without importing torch)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def _context() -> ForkServerContext:
    """The forkserver every rank is forked from, started on first use with torch preloaded."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD if gpu_visible() else PRELOAD + PRELOAD_CPU))
        _CONTEXT = ctx
    return _CONTEXT


def _sweep_orphans(parent: Path) -> None:
    """Remove the private directories of launchers that were killed outright (SIGKILL leaves no chance
    to clean up): ``commgate-{pid}-*`` whose launcher process no longer exists."""
    for d in parent.glob("commgate-*-*"):
        pid = d.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid():
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


CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                "ConnectionResetError", "ConnectionRefusedError", "BrokenPipeError", "Socket Timeout")  # fmt: skip
"""What a rank raises when a peer is gone: a consequence of that peer's failure, not a cause."""

GRACE_S = 1.0
"""After the first failure, how long the launcher lets the others settle before it names the cause (the
rank that died can be reaped a moment after its peers have raised)."""


def _failure(scenario: Scenario, procs: list[BaseProcess], tmp: Path) -> str | None:
    """Why the run failed, or None while no rank has failed.

    When one rank fails its peers soon fail too. The cause is, in order: a rank killed by a signal; a
    rank that exited with a non-zero status without raising (``os._exit``, a library's ``exit``); the
    rank whose exception was written first, a peer's connection error ("connection reset by peer")
    only if no rank raised anything else. The other ranks' errors are listed after it as consequences.
    """
    failed = [(rank, p.exitcode) for rank, p in _ranked(procs) if p.exitcode is not None and p.exitcode != 0]
    if not failed:
        return None
    paths = {r: e for r, _ in _ranked(procs) if (e := tmp / f"rank{r}.err").exists()}
    errors = {r: e.read_text(errors="replace").rstrip() for r, e in paths.items()}
    silent = [(rank, code) for rank, code in failed if rank not in errors]
    last = {r: _exception_line(text) for r, text in errors.items()}
    cause: int | None = None
    if signalled := [(rank, code) for rank, code in silent if code < 0]:  # with what it printed last
        rank, code = signalled[0]
        head = f"{scenario.id}: rank {rank} died by signal {signal.Signals(-code).name}" + _log_tail(tmp, rank)
        cause = rank
    elif silent:
        rank, code = silent[0]
        head = f"{scenario.id}: rank {rank} exited with status {code} without raising" + _log_tail(tmp, rank)
        cause = rank
    else:
        first = sorted((e.stat().st_mtime_ns, r) for r, e in paths.items())
        own = [r for _, r in first if not any(c in errors[r] for c in CONSEQUENCES)]
        cause = own[0] if own else first[0][1]
        head = f"{scenario.id}: rank {cause} raised {last[cause]}\n{errors[cause]}"
    after = [f"rank {r} then raised {last[r]}" for r in sorted(errors) if r != cause]
    return head + ("\n(consequences: " + "; ".join(after) + ")" if after else "")


_HEADER = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*")


def _exception_line(traceback_text: str) -> str:
    """The exception's own line of a traceback ("ValueError: ..."), which a multi-line message (pydantic's,
    say) would leave far from the last line; else the last line."""
    lines = traceback_text.rstrip().splitlines() or [""]
    headers = [line for line in lines if _HEADER.match(line)]
    return headers[-1] if headers else lines[-1]


def _log_tail(tmp: Path, rank: int, lines: int = 20) -> str:
    """The last lines of a rank's output, each on its own line after the first; empty if it printed nothing."""
    log = tmp / f"rank{rank}.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-lines:] if log.exists() else []
    return "".join(f"\n{line}" for line in tail)


STALL_MIN_S = 10.0
"""The stall watchdog's least patience (a scenario's ``stall_s`` overrides it)."""
PARTIAL_STALL = 3
"""With some rank outside any call, no progress for this many times the watchdog's limit is a stall too."""


class Watchdog:
    """Reads the ranks' heartbeats (``commgate.run.rank._heartbeat``) and says when the run has stalled:
    every running rank is blocked — in a call it issued, or in the teardown after its steps — and no rank
    has issued or completed a call for ``stall_s`` (a rank still starting, compiling or computing is not
    blocked, so the ranks' start-up never counts), by default
    max(STALL_MIN_S, 2 x the slowest step seen + 5 s); or some rank waits in a call and nothing has moved
    for ``PARTIAL_STALL`` times that (another rank is stuck outside any call: a rendezvous, a process group
    only some ranks build). The deadline stays the backstop."""

    def __init__(self, tmp: Path, ranks: Sequence[int], stall_s: float | None) -> None:
        self.tmp, self.ranks, self.stall_s = tmp, tuple(ranks), stall_s
        self.seen: tuple[object, ...] = ()
        self.since = time.monotonic()
        self.next_look = 0.0

    def limit(self, beats: list[dict[str, Any]]) -> float:
        slowest = max((ns for b in beats for ns in b.get("steps_ns", [])), default=0) / 1e9
        return self.stall_s if self.stall_s is not None else max(STALL_MIN_S, 2 * slowest + 5)

    def stalled(self, running: list[bool]) -> float | None:
        """The seconds without progress once that means a stall, else None."""
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + 0.25
        beats = [_beat(self.tmp, r) for r in self.ranks]
        progress = tuple((b.get("issued"), b.get("done"), b.get("teardown")) for b in beats)
        if progress != self.seen:
            self.seen, self.since = progress, now
            return None
        blocked = all(
            not alive or (b.get("issued") is not None and _in_call(b)) for alive, b in zip(running, beats, strict=True)
        )
        started = all(
            not alive or b.get("steps_ns") or b.get("open", 0) > 0 for alive, b in zip(running, beats, strict=True)
        )
        waited = now - self.since
        if blocked and started and waited > self.limit(beats):
            return waited
        # a rank waits in a call while another is stuck outside any (a rendezvous, a group only some ranks
        # build): nothing moves anywhere for PARTIAL_STALL x the limit, which no start-up or compute explains
        waiting = any(alive and b.get("open", 0) > 0 for alive, b in zip(running, beats, strict=True))
        return waited if waiting and started and waited > PARTIAL_STALL * self.limit(beats) else None


def _ranked(procs: Sequence[BaseProcess]) -> list[tuple[int, BaseProcess]]:
    """(rank, process) of each rank process started (named ``commgate-rank{r}``; an emulated run starts some
    ranks of the job only)."""
    return [(int((p.name or "").removeprefix("commgate-rank")), p) for p in procs]


def _stall_report(scenario: Scenario, tmp: Path, procs: list[BaseProcess], waited: float) -> str:
    """The stall: the first place the ranks' call sequences part (from every rank's issued calls, which
    the launcher asks them for), then each rank's state."""
    (tmp / "dump.request").touch()
    running = [r for r, p in _ranked(procs) if p.exitcode is None]
    until = time.monotonic() + 3
    while time.monotonic() < until and not all((tmp / f"rank{r}.calls.json").exists() for r in running):
        time.sleep(POLL_S)
    dumps: dict[int, dict[str, Any]] = {}
    for r in running:
        with contextlib.suppress(OSError, ValueError):
            dumps[r] = json.loads((tmp / f"rank{r}.calls.json").read_text())
    outside = [r for r in running if not _in_call(_beat(tmp, r))]
    who = (
        f"rank(s) {', '.join(map(str, outside))} outside any call (a rendezvous, a process group its peers do "
        "not build, or a very long computation; raise stall_s if it is the latter)"
        if outside
        else "every rank blocked"
    )
    lines = [f"{scenario.id}: stalled: no rank issued or completed a call for {waited:.0f} s, {who}"]
    parted = divergence({r: d["calls"] for r, d in dumps.items()})
    lines.append(f"  first divergence: {parted}" if parted else "  the ranks issued the same calls (a peer is slow?)")
    lines.append("  each rank:")
    for r, p in _ranked(procs):
        text = _status(tmp, r)
        if r not in running:
            state = f"exited ({p.exitcode})"
        elif dumps.get(r, {}).get("teardown"):
            state = f"finished its steps, in teardown (waiting for its peers); last call {text or 'none'}"
        else:
            state = f"in {text}" if text else "no call issued yet"
            if r in outside and text:
                state = f"outside any call; its last, completed: {text}"
        lines.append(f"    rank {r}: {state}")
    return "\n".join(lines)


def _beat(tmp: Path, rank: int) -> dict[str, Any]:
    """The rank's last heartbeat (``commgate.run.rank._heartbeat``); empty before its first."""
    try:
        beat: dict[str, Any] = json.loads((tmp / f"rank{rank}.beat").read_bytes().strip() or b"null") or {}
    except (OSError, ValueError):
        return {}
    return beat


def _in_call(beat: dict[str, Any]) -> bool:
    """Whether a heartbeat shows a call open, or the steps over (the rank waiting in the teardown)."""
    return bool(beat.get("open", 0) > 0 or beat.get("teardown"))


def _call_key(rank: int, call: dict[str, Any]) -> tuple[tuple[Any, ...], tuple[int, ...], Any]:
    """(key, member ranks, entry) of a call: a collective by its group and (op, bytes); a send or recv by
    its direction, so that one rank's send meets the other's receive."""
    peer = call.get("peer")
    if peer is not None:
        src, dst = (rank, peer) if call["op"] in ("send", "isend") else (peer, rank)
        return ("p2p", src, dst), (src, dst), ("send/recv", call["bytes"])
    group = tuple(call["group"])
    return ("group", group), group, (call["op"], call["bytes"])


def divergence(calls: dict[int, list[dict[str, Any]]]) -> str | None:
    """Where the ranks' call sequences first part: for each step in order, each group's (or send/recv
    pair's) calls on its member ranks compared in issue order. None if they never do."""
    for step in sorted({c["step"] for cs in calls.values() for c in cs}):
        seqs: dict[tuple[Any, ...], dict[int, list[Any]]] = {}
        members: dict[tuple[Any, ...], tuple[int, ...]] = {}
        for r, cs in calls.items():
            for c in cs:
                if c["step"] == step:
                    key, ranks, entry = _call_key(r, c)
                    members[key] = ranks
                    seqs.setdefault(key, {}).setdefault(r, []).append(entry)
        for key in sorted(seqs, key=str):
            lists = {r: seqs[key].get(r, []) for r in members[key] if r in calls}
            if len({tuple(v) for v in lists.values()}) <= 1:
                continue
            where = f"send/recv {key[1]} -> {key[2]}" if key[0] == "p2p" else f"group {list(key[1])}"
            for i in range(max(len(v) for v in lists.values())):
                at = {r: v[i] if i < len(v) else None for r, v in lists.items()}
                if len(set(at.values())) == 1:
                    continue
                short = [r for r, e in at.items() if e is None]
                full = next(r for r, e in at.items() if e is not None)
                op, nbytes = lists[full][i]
                if short:
                    r = short[0]
                    return (
                        f"rank {r} issued {len(lists[r])} call(s) in step {step} on {where}, rank {full} issued "
                        f"{len(lists[full])}: rank {r} never issued {op} #{i + 1} ({nbytes} B, {where})"
                    )
                other = next(r for r, e in at.items() if e != at[full])
                their_op, their_bytes = lists[other][i]
                return (
                    f"in step {step}, call #{i + 1} on {where}: rank {full} issued {op} ({nbytes} B), rank {other} "
                    f"issued {their_op} ({their_bytes} B)"
                )
    return None


def _status(tmp: Path, rank: int) -> str:
    """The call ``rank`` issued last, as its status file says ("" before its first)."""
    status = tmp / f"rank{rank}.status"
    return status.read_text(errors="replace").strip() if status.exists() else ""


def _hang_report(scenario: Scenario, tmp: Path, waited: float) -> str:
    lines = [f"{scenario.id}: deadline of {waited:g} s passed; the last call each rank issued:"]
    idle = 0
    for r in started_ranks(scenario):
        text = _status(tmp, r)
        lines.append(f"  rank {r}: {'in ' + text if text else 'no call issued yet'}")
        idle += not text
    if idle:
        lines += [
            f"  {lock}: a build lock of torch's C++ extensions, which a killed build leaves behind and every "
            "later build then waits for; delete it if no build is running"
            for lock in stale_build_locks()
        ]
    return "\n".join(lines)


def stale_build_locks() -> list[Path]:
    """Lock files in torch's C++-extension build directories (``TORCH_EXTENSIONS_DIR``)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock"))


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
) -> Capture:
    """Run ``scenario`` on ``world_size`` local processes and return the merged capture.

    The ranks' private directory (store, status, logs) is made under ``workdir`` (default: the system's
    temporary directory) and removed afterwards. With ``network`` (``commgate.run.links.shaped``) the
    ranks run in its two namespaces, half on each side of its shaped link.
    """
    world = scenario.world_size
    # an emulated run starts rank 0 alone, or one rank per pipeline stage and tensor shard, at the declared
    # world size (commgate.run.emulate)
    ran = started_ranks(scenario)
    if len(ran) > (limit := local_rank_limit()):
        raise RunError(
            f"{scenario.id}: world size {world} is more local ranks than this machine holds (at most {limit}: "
            f"{os.cpu_count()} cores, about {RANK_MEMORY >> 20} MiB a rank); run it under torchrun on a cluster "
            "(commgate run under torchrun), or see its prediction with commgate predict"
        )
    if too_big := budget.refusal(scenario, RANK_MEMORY):
        raise RunError(too_big)
    deadline = deadline_s if deadline_s is not None else scenario.deadline_s
    cpu = scenario.backend == "gloo" or (scenario.backend == "auto" and not gpu_visible())
    if cpu and (too_slow := budget.slow(scenario, deadline)):
        raise RunError(too_slow)
    _sweep_orphans(Path(workdir or tempfile.gettempdir()))
    tmp = Path(tempfile.mkdtemp(prefix=f"commgate-{os.getpid()}-", dir=workdir))
    procs: list[BaseProcess] = []
    started = time.monotonic()
    try:
        spec = tmp / "scenario.pickle"
        faults = faults or Faults()
        with open(spec, "wb") as f:
            pickle.dump(faults.apply(scenario), f)  # what runs; the caller predicts from what was declared
        ctx = _context()
        for rank in ran:
            # what torchrun sets (DeepSpeed insists on LOCAL_RANK)
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
            # nothing a local run opens is reachable from another machine (nor, shaped, from the host)
            env |= network.env(rank, world) if network is not None else loopback_env()
            args = (
                str(spec),
                rank,
                world,
                str(tmp / "store"),
                str(tmp),
                env | {"OMP_NUM_THREADS": "1"},
                started,
                faults,
            )
            p = ctx.Process(target=child, args=args, name=f"commgate-rank{rank}", daemon=False)
            p.start()
            procs.append(p)
        watchdog = Watchdog(tmp, ran, scenario.stall_s)
        while any(p.exitcode is None for p in procs):
            if _failure(scenario, procs, tmp):  # let the others settle, then name the cause
                settle = time.monotonic() + GRACE_S
                while any(p.exitcode is None for p in procs) and time.monotonic() < settle:
                    time.sleep(POLL_S)
                raise RunError(str(_failure(scenario, procs, tmp)))
            if time.monotonic() - started > deadline:
                raise RunError(_hang_report(scenario, tmp, deadline))
            if (stalled := watchdog.stalled([p.exitcode is None for p in procs])) is not None:
                raise RunError(_stall_report(scenario, tmp, procs, stalled))
            time.sleep(POLL_S)
        reason = _failure(scenario, procs, tmp)
        if reason:
            raise RunError(reason)
        if progress:
            done = f"{len(ran)} of {world} ranks (the others emulated)" if scenario.emulate else f"{world} ranks"
            progress(f"{scenario.id}: {done} done in {time.monotonic() - started:.1f} s")
        meta = json.loads((tmp / "rank0.meta.json").read_text())
        return merge(
            [tmp / f"rank{r}.json" for r in ran],
            world_size=world,
            ranks=ran if scenario.emulate else None,
            scenario=scenario.id,
            warmup_steps=scenario.warmup_steps,
            steps=scenario.steps,
            backend=meta["backend"],  # as the ranks resolved it (auto: nccl on GPUs)
            timeline=timeline(meta["marks"] | {"done": time.monotonic()}),  # finish: up to the merge
            stack=meta["stack"],
        )
    finally:
        _kill(procs)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
