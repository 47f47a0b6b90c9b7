"""Latency drift: cold-start spikes within a run, and shifts against a baseline's raw samples.

Torch-free. Latencies are the captured calls' ``duration_ns`` (issue to observed completion, so a recv
includes waiting for its sender: exactly what the paper's cold-cache anomaly looks like).

* Cold start: for each (rank, op, peer or group, message size), the first call of step 0 against the
  median of the same calls in the measured steps, or, for a collective with no such twin (DDP's single
  first bucket), against the time the measured steps' calls of the same op give its size (their fastest
  call's time plus their median time per byte); flagged when the ratio passes the scenario's factor
  *and* the first call is at least ``min_excess_ms`` slower (a 20 us call taking 10x is noise, a recv
  taking seconds is not). Where the capture holds the ranks' clock origins (``Capture.clocks``), every
  call's time is counted from when its *last* party issued it (its group's members, a send's recv and a
  recv's send), on one time line: a first recv that waited for its sender's first forward is a slow
  start of that rank, not a cold link, and is not a spike; a link that is slow once both sides are there
  (the cold-cache recv of Anthony et al.) is, and a send and its recv flagged together are one finding.
  Without the clocks, the rank that arrived last is named instead: the member whose own instance of the
  call was the shortest (the others waited for it).
* Shift: per op, its time per measured step (median rank) and its floor per step (its calls' fastest
  decile) in this run against the stored runs', every call counted from when its last party had issued it
  (a wait for a late peer is that peer's compute or its wait for a core, not the op's cost). The
  *run* is the unit of replication: the calls of one run are not independent samples (on a busy or
  drifting machine they all move together; on the 2-core CI machine two unchanged runs differ by 2x and
  more in a third of their ops). So the baseline keeps a history of runs, a verdict needs
  ``min_runs`` of them, an op's threshold is the larger of ``factor`` and the widest spread the stored
  runs show among themselves in that op, a whole-machine drift (compute and the other collectives)
  excuses its share, and the gate reruns a scenario that looks shifted ``confirm`` times: *slower*
  (*faster*) only when every run is beyond, in both measures.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from commgate.model.collectives import Op
from commgate.model.scenario import ColdStartRule, LatencyRule
from commgate.run.capture import Capture, CapturedCall, busy_ns

_T = TypeVar("_T")
LatencyKey = tuple[str, str, int, str]
"""(op, where: ``peer 3`` or ``group 0,1``, bytes per call, phase)."""


def latency_key(c: CapturedCall) -> LatencyKey:
    where = f"peer {c.peer}" if c.peer is not None else "group " + ",".join(map(str, c.rooted_group))
    return (str(c.op), where, c.bytes, c.phase)


def key_text(key: LatencyKey) -> str:
    op, where, nbytes, phase = key
    return f"{op} {where} {nbytes} B {phase}"


@dataclass(frozen=True, slots=True)
class ColdStart:
    rank: int
    op: str
    where: str
    bytes: int
    first_ms: float
    steady_ms: float
    """What the call takes in the measured steps: its own median, or (``expected``) the time the measured
    steps' calls of the same op give a call of its size."""
    expected: bool = False
    late: int | None = None
    """The member rank that arrived last (its own call of the same instance was the shortest: everyone
    else waited for it), when another rank than ``rank`` (without the ranks' clocks)."""
    waited_ms: float | None = None
    """With the ranks' clocks: how long the call waited for its last party to issue it, left out of
    ``first_ms`` (None without the clocks)."""
    partner: int | None = None
    """A recv whose sender's send was flagged with it: the sender (one finding for the pair)."""

    @property
    def ratio(self) -> float:
        return self.first_ms / self.steady_ms if self.steady_ms > 0 else math.inf

    def text(self) -> str:
        vs = "expected from the measured steps' rate for its size" if self.expected else "steady"
        late = f"; rank {self.late} arrived last (the others waited for it)" if self.late is not None else ""
        waited = ""
        if self.waited_ms is not None:
            waited = " once every party had issued it" + (
                f" (after waiting {self.waited_ms:.1f} ms for the last)" if self.waited_ms >= 0.05 else ""
            )
        pair = f"; rank {self.partner}'s send to it was as slow" if self.partner is not None else ""
        return (
            f"cold-start spike: rank {self.rank} {self.op} {self.where} {self.bytes} B took {self.first_ms:.1f} ms "
            f"in step 0{waited} vs {self.steady_ms:.2f} ms {vs} ({self.ratio:.0f}x){late}{pair}"
        )


def _rate(calls: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(latency ns, ns per byte) of an op from its measured calls' (bytes, time): the fastest call's time
    as the floor, the median excess per byte as the rate; None with fewer than 3 calls."""
    if len(calls) < 3:
        return None
    floor = min(t for _, t in calls)
    per_byte = [(t - floor) / b for b, t in calls if b]
    return float(floor), statistics.median(per_byte) if per_byte else 0.0


_Call = tuple[int, int]
"""(rank, seq): a call of a capture."""


@dataclass(frozen=True, slots=True)
class _Waits:
    """Each call's wait for its last party (ns, on the ranks' common time line) and that party's rank, and
    each send's recv."""

    wait: dict[_Call, int]
    last: dict[_Call, int]
    recv_of: dict[_Call, _Call]


def _waits(capture: Capture) -> _Waits | None:
    """How long after its issue each call's last party issued it, from the ranks' clock origins (None
    where the capture has none). A collective's parties are its group's instances of it (same step, op,
    group and size, the same ordinal on every member; an instance some member lacks is left out; a rooted
    one's, its root alone: the root itself waits for nobody); a send's is the k-th recv on its peer from
    its rank (the k-th send from a to b meets the k-th recv on b from a), when their sizes agree."""
    origins = capture.origins()
    if origins is None:
        return None
    instances: dict[tuple[object, ...], dict[int, CapturedCall]] = defaultdict(dict)
    seen: dict[tuple[object, ...], int] = defaultdict(int)
    for c in capture.calls:
        if c.peer is None:
            k: tuple[object, ...] = (c.rank, c.step, str(c.op), c.group, c.bytes)
        elif c.op in (Op.SEND, Op.RECV):
            k = (c.rank, c.op, c.peer)
        else:
            continue
        ordinal = seen[k]
        seen[k] += 1
        if c.peer is None:
            instances[(c.step, str(c.op), c.group, c.bytes, ordinal)][c.rank] = c
        else:
            src, dst = (c.rank, c.peer) if c.op is Op.SEND else (c.peer, c.rank)
            instances[("p2p", src, dst, ordinal)][c.rank] = c
    wait: dict[_Call, int] = {}
    last: dict[_Call, int] = {}
    recv_of: dict[_Call, _Call] = {}
    for k, parties in instances.items():
        if k[0] == "p2p":
            if len(parties) != 2 or len({c.bytes for c in parties.values()}) != 1:
                continue
            send, recv = (c for c in sorted(parties.values(), key=lambda c: c.op is Op.RECV))
            recv_of[(send.rank, send.seq)] = (recv.rank, recv.seq)
        elif len(parties) < 2 or set(parties) != set(next(iter(parties.values())).group):
            continue
        starts = {r: origins[r] + c.start_ns for r, c in parties.items()}
        latest = max(starts, key=starts.__getitem__)
        # a rooted call (broadcast, scatter, gather, reduce) waits for its root alone, the root for nobody
        root = next(iter(parties.values())).root
        party = root if root in starts else latest
        for r, c in parties.items():
            wait[(r, c.seq)] = starts[party] - starts[r]
            last[(r, c.seq)] = party
    return _Waits(wait=wait, last=last, recv_of=recv_of)


def slow_starts(capture: Capture, rule: ColdStartRule) -> dict[int, float]:
    """With the ranks' clocks: the ranks that issued a collective of step 0 at least ``rule.min_excess_ms``
    after another member had, with the longest such wait in ms: a slow start of that rank (its first
    forward, its build, a loaded core), not a slow link and not a cold-start spike. A pipeline's recv
    waiting for its sender's forward is its schedule and is not counted. Empty without clocks or when
    there is a measured step 0 (no warm-up)."""
    aligned = _waits(capture) if capture.warmup_steps > 0 else None
    late: dict[int, float] = {}
    if aligned is None:
        return late
    for c in capture.calls:
        w = aligned.wait.get((c.rank, c.seq))
        if c.step == 0 and c.peer is None and w is not None and w / 1e6 >= rule.min_excess_ms:
            r = aligned.last[(c.rank, c.seq)]
            late[r] = max(late.get(r, 0.0), w / 1e6)
    return dict(sorted(late.items()))


def slow_start_text(late: dict[int, float]) -> str:
    """The note on ``slow_starts`` (empty for none)."""
    if not late:
        return ""
    who = ", ".join(f"rank {r} up to {ms:,.0f} ms" for r, ms in late.items())
    return f"slow start in step 0 (collectives issued after the other members': {who}): the rank, not the link"


def _late(capture: Capture, call: CapturedCall) -> int | None:
    """The member rank whose instance of ``call`` (same step, op, group and size, same ordinal) was the
    shortest: it arrived last. None for a send or recv, or when that is ``call``'s own rank."""
    if call.peer is not None:
        return None

    def same(c: CapturedCall) -> bool:
        return (c.step, c.op, c.group, c.bytes) == (call.step, call.op, call.group, call.bytes)

    mine = [c for c in capture.calls if c.rank == call.rank and same(c)]
    ordinal = next(i for i, c in enumerate(mine) if c.seq == call.seq)
    twins: dict[int, int] = {}
    for r in call.group:
        theirs = [c for c in capture.calls if c.rank == r and same(c)]
        if ordinal < len(theirs) and theirs[ordinal].duration_ns is not None:
            twins[r] = theirs[ordinal].duration_ns or 0
    late = min(twins, key=twins.__getitem__) if len(twins) > 1 else None
    return late if late != call.rank else None


def cold_starts(capture: Capture, rule: ColdStartRule) -> list[ColdStart]:
    """Calls whose first occurrence in step 0 was a spike by ``rule``, worst first."""
    steps = range(capture.warmup_steps, capture.warmup_steps + capture.steps)
    if 0 in steps:  # no warm-up: step 0 is measured, nothing to compare it with
        return []
    aligned = _waits(capture)

    def took(c: CapturedCall) -> int:
        """The call's time: from its issue, or (with the clocks) from when its last party issued it."""
        d = c.duration_ns or 0
        if aligned is not None and (w := aligned.wait.get((c.rank, c.seq))) is not None:
            return max(0, d - w)
        return d

    first: dict[tuple[int, LatencyKey], CapturedCall] = {}
    steady: dict[tuple[int, LatencyKey], list[int]] = defaultdict(list)
    measured: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for c in capture.calls:
        if c.duration_ns is None:
            continue
        k = (c.rank, latency_key(c))
        if c.step == 0:
            first.setdefault(k, c)
        elif c.step in steps:
            steady[k].append(took(c))
            measured[str(c.op)].append((c.bytes, took(c)))
    out: dict[_Call, ColdStart] = {}
    for k, call in first.items():
        rank, (op, where, nbytes, _) = k
        f = took(call)
        if k in steady:  # its own twin in the measured steps
            expected, estimated = float(statistics.median(steady[k])), False
        elif call.peer is None and (rate := _rate(measured.get(op, []))) is not None:
            # a collective with no twin (DDP's single first bucket, say); a send or recv without one (the
            # pipeline's first tensor-metadata recv) waits for its peer's compute, not for the network
            expected, estimated = rate[0] + rate[1] * nbytes, True
        else:
            continue
        if f > rule.factor * expected and (f - expected) / 1e6 >= rule.min_excess_ms:
            wait = aligned.wait.get((rank, call.seq)) if aligned is not None else None
            out[(rank, call.seq)] = ColdStart(
                rank=rank,
                op=op,
                where=where,
                bytes=nbytes,
                first_ms=f / 1e6,
                steady_ms=expected / 1e6,
                expected=estimated,
                late=_late(capture, call) if wait is None else None,
                waited_ms=None if wait is None else max(0, wait) / 1e6,
            )
    if aligned is not None:  # a send flagged with its recv: one finding, the recv's
        for send, recv in aligned.recv_of.items():
            if send in out and recv in out:
                out[recv] = replace(out[recv], partner=send[0])
                del out[send]
    return sorted(out.values(), key=lambda s: s.first_ms - s.steady_ms, reverse=True)


@dataclass(frozen=True, slots=True)
class RunLatency:
    """One run's latency, the unit the shift verdict compares (calls of one run are not independent
    samples: a busy machine slows them all, so runs, not calls, are what is replicated).

    Per latency key, the time per measured step that the median rank spent in that key's calls, each call
    counted from when its last party had issued it (``_waits``; from its issue where the capture holds no
    clocks) and a worker of its group was free (``WORKERS``), to its observed completion, summed over the
    step's calls; and its floor per step, the measure the verdict judges (``shifts``). The compute
    time per measured step (the step less the time with a call in flight, median rank), the machine's own
    speed."""

    keys: dict[LatencyKey, tuple[int, ...]]
    compute: tuple[int, ...] = ()
    step: tuple[int, ...] = ()
    """Step time per measured step (median rank)."""
    date: str = ""
    """When the run was stored (UTC, ISO 8601); empty when not stored."""
    floor: dict[LatencyKey, int] = field(default_factory=dict)
    """Per key, its calls' floor per step: the fastest decile of their own times (``FLOOR_QUANTILE`` of the
    key's calls over the measured steps and every rank) times the key's calls per step and rank. A wait for
    a core only ever adds to a call's time, so the fastest calls of a key keep its cost, and a slower
    collective slows those too."""
    measure: str = ""
    """How the times were measured (``MEASURE`` for runs summarized by this version); a run stored by an
    earlier version, whose times included other waits (for late peers, for the calls queued before), is not
    compared with these."""

    def op_time(self, op: str) -> float:
        """Median time per step in ``op`` (all its keys), over the measured steps that issue it (DDP
        broadcasts its buffers in the first measured step only)."""
        per_step: dict[int, int] = defaultdict(int)
        for (o, _, _, _), times in self.keys.items():
            if o == op:
                for i, t in enumerate(times):
                    per_step[i] += t
        return _median_issued(per_step.values())

    def op_floor(self, op: str) -> float:
        """``op``'s floor per step: its keys' floors summed (0 for a run stored without floors)."""
        return float(sum(f for k, f in self.floor.items() if k[0] == op))

    def ops(self) -> set[str]:
        return {k[0] for k in self.keys}


def _median_issued(times: Iterable[int]) -> float:
    issued = [t for t in times if t > 0]
    return float(statistics.median(issued)) if issued else 0.0


def summarize(capture: Capture, *, date: str = "") -> RunLatency:
    """A run's ``RunLatency`` from its captured calls and step windows."""

    steps = range(capture.warmup_steps, capture.warmup_steps + capture.steps)
    per: dict[LatencyKey, dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
    by_rank_step: dict[tuple[int, int], list[CapturedCall]] = defaultdict(list)
    durations: dict[LatencyKey, list[int]] = defaultdict(list)  # every call's, for the key's floor
    aligned = _waits(capture)
    wait = aligned.wait if aligned is not None else {}
    depth = WORKERS.get(capture.backend, 1)
    queue: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    """(rank, group) -> until when the group's workers on that rank are busy: the latest ``depth`` completions
    of the collectives issued in it so far."""
    for c in sorted(capture.calls, key=lambda c: (c.rank, c.seq)):
        if c.duration_ns is None:
            continue
        end = c.start_ns + c.duration_ns
        # the call's own time: from when its last party had issued it (a wait for a late peer, that peer's
        # compute or its wait for a core, is not the op's cost) and a worker of its group was free (a
        # prefetched all-gather queued behind others is not slower for it), to its completion
        start = c.start_ns + max(0, wait.get((c.rank, c.seq), 0))
        if c.peer is None:
            workers = queue.get((c.rank, c.group), [])
            if len(workers) == depth:
                start = max(start, workers[0])
            queue[(c.rank, c.group)] = sorted([*workers, end])[-depth:]
        if c.step in steps:
            key = latency_key(c)
            own = max(0, end - start)
            per[key][(c.step, c.rank)] += own
            durations[key].append(own)
            by_rank_step[(c.rank, c.step)].append(c)
    ranks = sorted({c.rank for c in capture.calls}) or [0]

    def median_rank(times: dict[tuple[int, int], int], step: int) -> int:
        return int(statistics.median(times.get((step, r), 0) for r in ranks))

    keys = {k: tuple(median_rank(t, s) for s in steps) for k, t in sorted(per.items())}
    compute: dict[int, list[int]] = defaultdict(list)
    step: dict[int, list[int]] = defaultdict(list)
    for w in capture.step_windows:
        if w.step in steps:
            busy = busy_ns(by_rank_step.get((w.rank, w.step), []), w.start_ns, w.end_ns)
            compute[w.step].append(w.duration_ns - busy)
            step[w.step].append(w.duration_ns)

    def per_step(d: dict[int, list[int]]) -> tuple[int, ...]:
        return tuple(int(statistics.median(d[s])) for s in sorted(d))

    per_rank_step = len(steps) * len(ranks)
    floor = {
        k: round(sorted(v)[int(FLOOR_QUANTILE * (len(v) - 1))] * len(v) / per_rank_step)
        for k, v in sorted(durations.items())
    }
    return RunLatency(
        keys=keys, compute=per_step(compute), step=per_step(step), date=date, floor=floor, measure=MEASURE
    )


MEASURE = "queue"
"""``RunLatency.measure`` of this version: each call's own time, counted from when its last party had issued it
and a worker of its group was free (``summarize``). Earlier: "own", from the last party's issue alone, which
counted a queued call's wait behind the calls before it; "service", with one worker a group on gloo too.
Runs measured otherwise are not compared."""
WORKERS = {"gloo": 2}
"""How many of a group's collectives the backend runs at once on a rank: gloo, its process group's worker
threads (``ProcessGroupGloo``'s default ``threads``, 2); a backend not named here, one (NCCL runs a group's
collectives on one stream). Taken as one, gloo's prefetched all-gathers that ran two at once were counted
from each other's completion: user-module-zero3's floor fell into two clusters, x0.44-0.60 and x1.67-2.61 of
its median across 12 unchanged runs (docs/gate.md)."""
FLOOR_QUANTILE = 0.1
"""The fastest decile of a key's calls is its floor (``RunLatency.floor``)."""
FLOOR_MIN_SHARE = 0.01
"""An op whose floor per step is under this share of the step is not judged (found by 10 unchanged runs of
the default suite: an 8 B broadcast held 5% of the step by its time, waiting for peers, and its floor of
microseconds moved x0.14)."""


Verdict = Literal["slower", "faster", "~"]


@dataclass(frozen=True, slots=True)
class Shift:
    """One op's latency, this run (or these runs) against the stored runs: its floor per step against its
    threshold (the verdict), its time per step beside it."""

    op: str
    verdict: Verdict
    ratio: float
    """Median floor per step in the op now / the stored runs' median (``RunLatency.op_floor``)."""
    threshold: float
    """The ratio that counts: the rule's factor, or how far the stored runs themselves reach from their
    median on the verdict's side (``spread``; above it for *slower* and *~*)."""
    runs_now: int
    runs_base: int
    machine: float = 1.0
    """Compute time now / stored (shown beside a shift). Alone it excuses nothing: where calls overlap
    compute a slower collective lengthens the measured compute too (a planted 2x all-gather under ZeRO++
    moved it x1.5-2.1); only as far as the scenario's other collectives moved the same way (``_drift``)."""
    keys: tuple[tuple[str, float], ...] = ()
    """The op's keys whose floor moved most (key text, ratio), for the report."""
    time_ratio: float = 1.0
    """Median time per step now / the stored runs' median: shown, not judged (the time per step of an
    unchanged run on a 2-core machine reached x7.3 from the median of 12; its floor spreads less)."""

    def text(self) -> str:
        machine = f"; the run's compute x{self.machine:.2f}" if abs(self.machine - 1) >= 0.05 else ""
        detail = "; ".join(f"{k} x{r:.2f}" for k, r in self.keys)
        return (
            f"latency {self.verdict}: {self.op} floor per step x{self.ratio:.2f} in each of {self.runs_now} run(s) "
            f"vs {self.runs_base} reference run(s) (counts beyond x{self.threshold:.2f}; time per step "
            f"x{self.time_ratio:.2f}{machine})" + (f": {detail}" if detail else "")
        )


@dataclass(frozen=True, slots=True)
class Assessment:
    """The latency verdict of one scenario: a shift per op, or why latency was not judged."""

    shifts: tuple[Shift, ...] = ()
    note: str = ""
    threshold: float = 0.0
    unjudged: int = 0
    """Ops left out: under ``min_share`` of the step, or with a floor under ``FLOOR_MIN_SHARE`` of it."""

    def changed(self) -> list[Shift]:
        return [s for s in self.shifts if s.verdict != "~"]

    def summary(self) -> str:
        """``no latency shift beyond x1.75 in 2 op(s)``, or the ops that shifted and how many did not (it said
        "no latency shift ... in 0 op(s)" under a shift's finding: found by an adversarial pass), or that no op
        was judged; and how many were too small a share of the step to judge; or the note."""
        if self.note:
            return self.note
        small = (
            f"; {self.unjudged} too small a share of the step to judge (under min_share, or a floor under "
            f"{FLOOR_MIN_SHARE:.0%} of it)"
            if self.unjudged
            else ""
        )
        moved = self.changed()
        steady = len(self.shifts) - len(moved)
        beyond = f"beyond x{self.threshold:.2f}"
        if moved:
            which = ", ".join(f"{s.op} {s.verdict}" for s in moved)
            return f"{len(moved)} op(s) shifted {beyond} ({which}), {steady} unchanged{small}"
        return (f"no latency shift {beyond} in {steady} op(s)" if steady else "no op judged") + small

    @property
    def slower(self) -> bool:
        return any(s.verdict == "slower" for s in self.shifts)

    @property
    def faster(self) -> bool:
        return any(s.verdict == "faster" for s in self.shifts)


def _common(sets: Iterable[set[_T]]) -> set[_T]:
    """What every one of ``sets`` holds (nothing for no sets)."""
    out: set[_T] | None = None
    for s in sets:
        out = set(s) if out is None else out & s
    return out or set()


def spread(runs: Sequence[RunLatency], op: str) -> tuple[float, float]:
    """How far from their median ``runs`` themselves put ``op``'s floor per step: (the highest over the
    median, the median over the lowest), what this machine does with nothing changed, each way ((1.0, 1.0)
    for no runs, or a floor of 0)."""
    floors = [r.op_floor(op) for r in runs]
    if not floors or min(floors) <= 0:
        return 1.0, 1.0
    med = statistics.median(floors)
    return float(max(floors) / med), float(med / min(floors))


def _machine(now: Sequence[RunLatency], base: Sequence[RunLatency]) -> float:
    """Median compute time per step now / in ``base`` (1.0 when either is unknown, or zero: not measured)."""
    a = [statistics.median(r.compute) for r in now if r.compute]
    b = [statistics.median(r.compute) for r in base if r.compute]
    if not a or not b or statistics.median(b) <= 0 or statistics.median(a) <= 0:
        return 1.0
    return float(statistics.median(a) / statistics.median(b))


def shifts(now: Sequence[RunLatency], base: Sequence[RunLatency], rule: LatencyRule) -> Assessment:
    """Each op's floor per step in the ``now`` runs against the ``base`` runs (the baseline's history, or
    the before side of ``commgate compare``); every call counted from when its last party had issued it
    and a worker of its group was free (``summarize``).

    The run is the unit: an op is *slower* only when, in **every** run now, its floor per step is beyond
    the threshold times the base runs' median: the larger of ``rule.factor`` and how far above their median
    the base runs themselves reach in that op (``spread``: what this machine does with nothing changed;
    each op its own). The floor, the fastest tenth of the op's calls, is what a wait for a core leaves alone
    and a slower collective moves; the time per step, which every late core adds to, is shown beside it
    (``Shift.time_ratio``), not judged. A drift of the whole machine, its compute *and* the scenario's other
    collectives slower (``_drift``), excuses that much. *faster* mirrors it, below the median by the larger
    of the factor and the base runs' own reach below it (reported, never a failure). Fewer than
    ``rule.min_runs`` base runs measured as this version measures: not judged; an op under
    ``rule.min_share`` of the step in the base runs is not judged either (a 20 us broadcast is scheduling
    noise on a shared machine), nor one whose floor is under ``FLOOR_MIN_SHARE``, unless its floor is
    ``rule.min_share`` of the step or more in every run now: an op that was cheap and has grown into the
    step (a broadcast of 0.6 ms whose floor became seconds passed the gate, found by an adversarial pass)."""
    older = sum(r.measure != MEASURE for r in base)
    base = [r for r in base if r.measure == MEASURE]
    if len(base) < rule.min_runs or not now:
        what = f" measured by this version ({older} stored by an earlier one counted other waits)"
        what = what if older else ""
        return Assessment(note=f"latency not judged: {len(base)} run(s){what} to compare with, {rule.min_runs} needed")
    step = statistics.median(_median_issued(r.step) for r in base)
    ops = _common(r.ops() for r in (*base, *now))
    judged = {
        op
        for op in ops
        if (
            _share(op, base, step) >= rule.min_share
            and statistics.median(r.op_floor(op) for r in base) >= FLOOR_MIN_SHARE * step
        )
        or all(r.op_floor(op) >= rule.min_share * _median_issued(r.step) > 0 for r in now)
    }
    all_now, all_base = now, base
    base = [_only(r, judged) for r in base]
    now = [_only(r, judged) for r in now]
    machine = _machine(now, base)
    out = []
    for op in sorted(judged):
        ref = statistics.median(r.op_floor(op) for r in base)
        time_ref = statistics.median(r.op_time(op) for r in base)
        if ref <= 0 or time_ref <= 0:
            continue
        up, down = (max(rule.factor, s) for s in spread(base, op))
        floors = [r.op_floor(op) / ref for r in now]
        drift = _drift(op, machine, all_now, all_base, RunLatency.op_floor)
        verdict: Verdict = "~"
        threshold = up
        if min(floors) / max(drift, 1.0) >= up:
            verdict = "slower"
        elif max(floors) / min(drift, 1.0) <= 1 / down:
            verdict, threshold = "faster", down
        out.append(
            Shift(
                op=op,
                verdict=verdict,
                ratio=float(statistics.median(floors)),
                threshold=threshold,
                runs_now=len(now),
                runs_base=len(base),
                machine=machine,
                keys=_moved_keys(op, now, base) if verdict != "~" else (),
                time_ratio=float(statistics.median(r.op_time(op) for r in now) / time_ref),
            )
        )
    threshold = max((s.threshold for s in out), default=rule.factor)
    return Assessment(shifts=tuple(out), threshold=threshold, unjudged=len(ops - judged))


def _drift(
    op: str,
    machine: float,
    now: Sequence[RunLatency],
    base: Sequence[RunLatency],
    value: Callable[[RunLatency, str], float] = RunLatency.op_time,
) -> float:
    """How much slower (> 1) or faster the whole machine ran: the run's compute ratio, but only as far
    as the scenario's *other* collectives moved the same way (the nearer of the two to 1); the compute
    ratio alone where the op is the scenario's only collective. A machine-wide slowdown moves both; a
    slower collective alone moves only the compute (its calls overlap it), not the other collectives."""
    others = []
    for other in _common(r.ops() for r in (*now, *base)) - {op}:
        ref, at = statistics.median(value(r, other) for r in base), statistics.median(value(r, other) for r in now)
        if ref > 0 and at > 0:  # zero: not measured (a hand-edited baseline), nothing to corroborate with
            others.append(at / ref)
    if not others:  # nothing to corroborate it with: the compute ratio stands alone
        return machine
    common = float(statistics.median(others))
    if (machine - 1) * (common - 1) <= 0:  # they disagree: no drift shown
        return 1.0
    return min(machine, common) if machine > 1 else max(machine, common)


def _share(op: str, runs: Sequence[RunLatency], step: float) -> float:
    """The op's median time per step as a share of the step (1.0 when the step time is unknown)."""
    if step <= 0:
        return 1.0
    return float(statistics.median(r.op_time(op) for r in runs)) / step


def _only(run: RunLatency, ops: set[str]) -> RunLatency:
    return replace(run, keys={k: v for k, v in run.keys.items() if k[0] in ops})


def _moved_keys(
    op: str, now: Sequence[RunLatency], base: Sequence[RunLatency], top: int = 3
) -> tuple[tuple[str, float], ...]:
    """The ``top`` keys of ``op`` whose floor per step moved most (key text, ratio of medians)."""
    found = []
    for key in _common(set(r.floor) for r in (*now, *base)):
        if key[0] != op:
            continue
        ref = statistics.median(r.floor[key] for r in base)
        if ref > 0:
            found.append((key_text(key), float(statistics.median(r.floor[key] for r in now) / ref)))
    return tuple(sorted(found, key=lambda kr: abs(math.log(kr[1])) if kr[1] > 0 else 0.0, reverse=True)[:top])
