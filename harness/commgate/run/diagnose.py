"""Why a local run failed, in words: the rank to blame, the stall watchdog and its report, the first place
the ranks' call sequences part, the hang at the deadline.

The launcher (``commgate.run.launcher``) owns the rank processes and hands this module their exit statuses
(rank -> status, None while running); the rest it reads from what the ranks leave in the run's private
directory: each rank's traceback (``rank{r}.err``), output (``rank{r}.log``), last issued call
(``rank{r}.status``), heartbeat (``rank{r}.beat``, ``commgate.run.rank._heartbeat``) and, when asked, the
calls it issued (``rank{r}.calls.json``). A run fails

* when a rank raises: naming the rank and showing its traceback, its peers' errors as consequences,
* when a rank dies by a signal or exits without raising: naming the rank, the signal or status, and its
  last lines of output,
* when it stalls: naming where the ranks' call sequences part and what each rank is doing,
* at the deadline: naming what each rank last issued (the collective it is stuck in).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from commgate.run.extensions import build_locks

POLL_S = 0.02
"""How often the launcher looks at its ranks (their exit statuses, and the calls they dump when asked)."""

Exits = Mapping[int, int | None]
"""Each started rank's exit status, None while it runs (``multiprocessing``'s: negative, killed by that
signal)."""

CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                "ConnectionResetError", "ConnectionRefusedError", "BrokenPipeError", "Socket Timeout")  # fmt: skip
"""What a rank raises when a peer is gone: a consequence of that peer's failure, not a cause."""


def failure(scenario_id: str, exits: Exits, tmp: Path) -> str | None:
    """Why the run failed, or None while no rank has failed.

    When one rank fails its peers soon fail too. The cause is, in order: a rank killed by a signal; a
    rank that exited with a non-zero status without raising (``os._exit``, a library's ``exit``); the
    rank whose exception was written first, a peer's connection error ("connection reset by peer")
    only if no rank raised anything else. The other ranks' errors are listed after it as consequences.
    """
    failed = [(rank, code) for rank, code in exits.items() if code]
    if not failed:
        return None
    paths = {r: e for r in exits if (e := tmp / f"rank{r}.err").exists()}
    errors = {r: e.read_text(errors="replace").rstrip() for r, e in paths.items()}
    last = {r: exception_line(text) for r, text in errors.items()}
    if silent := [(rank, code) for rank, code in failed if rank not in errors]:
        cause, head = _silent_cause(scenario_id, silent, tmp)
    else:
        cause = _first_raised(paths, errors)
        detail = f"\n{errors[cause]}" if errors[cause] != last[cause] else ""  # a traceback (not a one-line error)
        head = f"{scenario_id}: rank {cause} raised {last[cause]}{detail}"
    after = [
        f"rank {r} then raised {'the same' if last[r] == last.get(cause) else last[r]}"
        for r in sorted(errors)
        if r != cause
    ]
    return head + ("\n(consequences: " + "; ".join(after) + ")" if after else "")


def _silent_cause(scenario_id: str, silent: list[tuple[int, int]], tmp: Path) -> tuple[int, str]:
    """(rank, what happened to it) of the cause among the ranks that failed without raising: the first killed
    by a signal, else the first that exited with a status; with what it printed last."""
    signalled = [(rank, code) for rank, code in silent if code < 0]
    rank, code = (signalled or silent)[0]
    how = f"died by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code} without raising"
    return rank, f"{scenario_id}: rank {rank} {how}" + _log_tail(tmp, rank)


def _first_raised(paths: dict[int, Path], errors: dict[int, str]) -> int:
    """The rank whose exception was written first, a peer's connection error only if no rank raised
    anything else."""
    first = sorted((e.stat().st_mtime_ns, r) for r, e in paths.items())
    own = [r for _, r in first if not any(c in errors[r] for c in CONSEQUENCES)]
    return own[0] if own else first[0][1]


_HEADER = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*")


def exception_line(traceback_text: str) -> str:
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
    has issued or completed a call, nor slept in a planted fault's wait (``Recorder.holding``), for
    ``stall_s`` (a rank still starting, compiling or computing is not blocked, so the ranks' start-up never
    counts), by default max(STALL_MIN_S, 2 x the slowest step seen + 5 s); or some rank waits in a call and
    nothing has moved
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
        holding = any(alive and b.get("holding") for alive, b in zip(running, beats, strict=True))
        if progress != self.seen or holding:  # a planted fault's wait is the rank's doing, not a stall
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


def stall_report(scenario_id: str, tmp: Path, exits: Exits, waited: float) -> str:
    """The stall: the first place the ranks' call sequences part (from every rank's issued calls, which
    it asks them for), then each rank's state."""
    running = [r for r, code in exits.items() if code is None]
    dumps = _ask_for_calls(tmp, running)
    outside = [r for r in running if not _in_call(_beat(tmp, r))]
    who = (
        f"rank(s) {', '.join(map(str, outside))} outside any call (a rendezvous, a process group its peers do "
        "not build, or a very long computation; raise stall_s if it is the latter)"
        if outside
        else "every rank blocked"
    )
    lines = [f"{scenario_id}: stalled: no rank issued or completed a call for {waited:.0f} s, {who}"]
    parted = divergence({r: d["calls"] for r, d in dumps.items()})
    lines.append(f"  first divergence: {parted}" if parted else "  the ranks issued the same calls (a peer is slow?)")
    lines.append("  each rank:")
    lines += [f"    rank {r}: {_state(tmp, r, code, dumps.get(r, {}), r in outside)}" for r, code in exits.items()]
    return "\n".join(lines)


def _ask_for_calls(tmp: Path, running: list[int]) -> dict[int, dict[str, Any]]:
    """The calls each running rank issued so far, as its heartbeat writes them when asked
    (``dump.request``); a rank that has not answered within 3 s is left out."""
    (tmp / "dump.request").touch()
    until = time.monotonic() + 3
    while time.monotonic() < until and not all((tmp / f"rank{r}.calls.json").exists() for r in running):
        time.sleep(POLL_S)
    dumps: dict[int, dict[str, Any]] = {}
    for r in running:
        with contextlib.suppress(OSError, ValueError):
            dumps[r] = json.loads((tmp / f"rank{r}.calls.json").read_text())
    return dumps


def _state(tmp: Path, rank: int, code: int | None, dump: dict[str, Any], outside: bool) -> str:
    """What a stalled run's ``rank`` is doing: exited, in its teardown, in a call, or outside any."""
    text = _status(tmp, rank)
    if code is not None:
        return f"exited ({code})"
    if dump.get("teardown"):
        return f"finished its steps, in teardown (waiting for its peers); last call {text or 'none'}"
    if outside and text:
        return f"outside any call; its last, completed: {text}"
    return f"in {text}" if text else "no call issued yet"


def _beat(tmp: Path, rank: int) -> dict[str, Any]:
    """The rank's last heartbeat (``commgate.run.rank._heartbeat``); empty before its first."""
    try:
        beat: dict[str, Any] = json.loads((tmp / f"rank{rank}.beat").read_bytes().strip() or b"null") or {}
    except (OSError, ValueError):
        return {}
    return beat


PHASES = {
    "": "starting the ranks",
    "entry": "joining the process group",
    "joined": "building the model and the framework",
    "built": "steps",
    "stepped": "gathering the capture",
}
"""What a rank is doing after each mark of ``commgate.run.rank`` (its heartbeat's ``phase``)."""


def _phase_of(tmp: Path, rank: int) -> str:
    """What ``rank`` is doing by its last mark (``PHASES``)."""
    try:
        mark = json.loads((tmp / f"rank{rank}.phase.json").read_text())["phase"]
    except (OSError, ValueError, KeyError, TypeError):
        mark = ""
    return PHASES.get(mark, PHASES[""])


LAG_S = 1.0
"""A rank's status older than this at the deadline is said to be (its heartbeat writes it every 0.2 s)."""


def _lag(tmp: Path, rank: int) -> str:
    """``" (as of N s before: its heartbeat lagged)"`` where the rank's status is older than ``LAG_S``."""
    times = [f.stat().st_mtime for k in ("beat", "status") if (f := tmp / f"rank{rank}.{k}").exists()]
    if not times:
        return ""
    age = time.time() - max(times)
    return f" (as of {age:.1f} s before: its heartbeat lagged, the machine busy)" if age > LAG_S else ""


def phase(tmp: Path, ranks: Sequence[int], steps: int) -> str:
    """What the slowest of ``ranks`` is doing, from their phase files and heartbeats: ``building the
    model and the framework``, ``step 3 of 5``, ..."""
    order = list(PHASES)

    def where(rank: int) -> tuple[int, int]:
        try:
            mark = json.loads((tmp / f"rank{rank}.phase.json").read_text())["phase"]
        except (OSError, ValueError, KeyError):
            mark = ""
        return order.index(mark) if mark in PHASES else 0, len(_beat(tmp, rank).get("steps_ns", ()))

    at, done = min(where(r) for r in ranks)
    if order[at] == "built":
        return f"step {min(done + 1, steps)} of {steps}"
    return PHASES[order[at]]


def _in_call(beat: dict[str, Any]) -> bool:
    """Whether a heartbeat shows a call open, or the steps over (the rank waiting in the teardown)."""
    return bool(beat.get("open", 0) > 0 or beat.get("teardown"))


_Key = tuple[Any, ...]
"""A call's sequence: ("group", member ranks) for a collective, ("p2p", src, dst) for a send or recv."""


def _call_key(rank: int, call: dict[str, Any]) -> tuple[_Key, tuple[int, ...], Any]:
    """(key, member ranks, entry) of a call: a collective by its group and (op, bytes); a send or recv by
    its direction, so that one rank's send meets the other's receive."""
    peer = call.get("peer")
    if peer is not None:
        src, dst = (rank, peer) if call["op"] in ("send", "isend") else (peer, rank)
        return ("p2p", src, dst), (src, dst), ("send/recv", call["bytes"])
    group = tuple(call["group"])
    return ("group", group), group, (call["op"], call["bytes"])


UNEVEN = frozenset({"all_to_all"})
"""Ops whose ranks may each send a different number of bytes in one call (an all-to-all's splits: an MoE's
token dispatch): compared by op alone, as the capture records a rank's own input only."""


def divergence(calls: dict[int, list[dict[str, Any]]]) -> str | None:
    """Where the ranks' call sequences first part: each group's (or send/recv pair's) calls on its member
    ranks compared in issue order over the whole run. None if they never do. Where they part, the first
    step whose calls part names it: a rank that skipped a call meets its peers' later calls, so the step
    shows which one skipped. A step is each rank's own window (a rank's own forward after its last
    optimizer step opens one its peers never do): sequences that agree over the run agree, whatever
    their steps."""
    whole, members = _sequences(calls, None)
    if not any(_parts(whole, members, calls, key) for key in whole):
        return None
    for step in sorted({c["step"] for cs in calls.values() for c in cs}):
        seqs, members = _sequences(calls, step)
        for key in sorted(seqs, key=str):
            if lists := _parts(seqs, members, calls, key):
                return _parting(step, key, lists)
    return None


def _parts(
    seqs: dict[_Key, dict[int, list[Any]]],
    members: dict[_Key, tuple[int, ...]],
    calls: dict[int, list[dict[str, Any]]],
    key: _Key,
) -> dict[int, list[Any]]:
    """The member ranks' entries of sequence ``key`` if they part; empty if they agree."""
    lists = {r: seqs[key].get(r, []) for r in members[key] if r in calls}
    return lists if len({_same(v) for v in lists.values()}) > 1 else {}


def _same(entries: list[Any]) -> tuple[Any, ...]:
    """What must agree between ranks in a sequence's entries: op and bytes (op alone where ``UNEVEN``)."""
    return tuple((op, None if op in UNEVEN else nbytes) for op, nbytes in entries)


def _sequences(
    calls: dict[int, list[dict[str, Any]]], step: int | None
) -> tuple[dict[_Key, dict[int, list[Any]]], dict[_Key, tuple[int, ...]]]:
    """Step ``step``'s calls (every step's: None) of each rank by sequence (key -> rank -> entries in issue
    order), and each sequence's member ranks."""
    seqs: dict[_Key, dict[int, list[Any]]] = {}
    members: dict[_Key, tuple[int, ...]] = {}
    for r, cs in calls.items():
        for c in cs:
            if step is None or c["step"] == step:
                key, ranks, entry = _call_key(r, c)
                members[key] = ranks
                seqs.setdefault(key, {}).setdefault(r, []).append(entry)
    return seqs, members


def _parting(step: int, key: _Key, lists: dict[int, list[Any]]) -> str:
    """Where the member ranks' differing ``lists`` of one sequence first part: a rank that never issued a
    call its peer did, or two ranks that issued different ones."""
    where = f"send/recv {key[1]} -> {key[2]}" if key[0] == "p2p" else f"group {list(key[1])}"
    compared = {r: list(_same(v)) for r, v in lists.items()}
    i = next(i for i in range(max(map(len, lists.values()))) if len(set(_column(compared, i).values())) > 1)
    at = _column(compared, i)
    full = next(r for r, e in at.items() if e is not None)
    op, nbytes = lists[full][i]
    if short := [r for r, e in at.items() if e is None]:
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


def _column(lists: dict[int, list[Any]], i: int) -> dict[int, Any]:
    """Each rank's ``i``-th entry, None past the end of its list."""
    return {r: v[i] if i < len(v) else None for r, v in lists.items()}


def _status(tmp: Path, rank: int) -> str:
    """The call ``rank`` issued last, as its status file says ("" before its first)."""
    status = tmp / f"rank{rank}.status"
    return status.read_text(errors="replace").strip() if status.exists() else ""


SLOW_FIX = "deadline_s in the scenario, or --deadline S (--commgate-deadline S)"


def hang_report(
    scenario_id: str, tmp: Path, ranks: Sequence[int], waited: float, slow_compute: str | None = None
) -> str:
    """The deadline passed: the call each of ``ranks`` issued last (or, outside calls, what it was doing: its
    phase), how old that word is where the rank's heartbeat lagged (a busy machine), and any stale build lock
    of torch's C++ extensions where a rank issued none; ``slow_compute``: why the ranks compute slowly on this
    machine (``commgate.run.budget.slow_compute``), said beside the fix for a slow run."""
    lines = [f"{scenario_id}: deadline of {waited:g} s passed; the last call each rank issued:"]
    idle = 0
    for r in ranks:
        text, beat, doing = _status(tmp, r), _beat(tmp, r), _phase_of(tmp, r)
        if text and beat.get("issued") is not None and not _in_call(beat):  # computing, or stuck outside calls
            text = f"in no call ({doing}); the last it issued, {text}, had completed"
        elif text:
            text = f"in {text}"
        lines.append(f"  rank {r}: {text or f'no call issued yet ({doing})'}{_lag(tmp, r)}")
        idle += not text
    if idle:
        lines += [
            f"  {lock}: a build lock of torch's C++ extensions, which a killed build leaves behind and every "
            "later build then waits for; delete it if no build is running"
            for lock in build_locks()
        ]
    # the fix, where nothing hung (found by an adversarial pass: neither was named)
    lines.append(f"  a run that is only slow needs longer: {SLOW_FIX}")
    if slow_compute:
        lines.append(f"  its steps compute slowly here: {slow_compute}")
    return "\n".join(lines)
