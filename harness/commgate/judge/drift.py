"""Latency drift: cold-start spikes within a run, and shifts against a baseline's raw samples.

Torch-free. Latencies are the captured calls' ``duration_ns`` (issue to observed completion, so a recv
includes waiting for its sender: exactly what the paper's cold-cache anomaly looks like).

* Cold start: for each (rank, op, peer or group, message size), the first call of step 0 against the
  median of the same calls in the measured steps, or, for a collective with no such twin (DDP's single
  first bucket), against the time the measured steps' calls of the same op give its size (their fastest
  call's time plus their median time per byte); flagged when the ratio passes the scenario's factor
  *and* the first call is at least ``min_excess_ms`` slower (a 20 us call taking 10x is noise, a recv
  taking seconds is not). The rank that arrived last is named: the member whose own instance of the
  call was the shortest (the others waited for it).
* Shift: per (op, peer or group, size, phase), the measured steps' samples against the baseline's;
  "slower"/"faster" only when the ratio of medians passes the factor *and* a two-sided Mann-Whitney U
  test rejects equality at ``p_value`` (shared among the keys tested: Bonferroni) with at least
  ``min_samples`` on each side (as asv does); "~" otherwise. Raw samples, never trimmed means.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from commgate.model.scenario import ColdStartRule, LatencyRule
from commgate.run.capture import Capture, CapturedCall

LatencyKey = tuple[str, str, int, str]
"""(op, where: ``peer 3`` or ``group 0,1``, bytes per call, phase)."""


def latency_key(c: CapturedCall) -> LatencyKey:
    where = f"peer {c.peer}" if c.peer is not None else "group " + ",".join(map(str, c.rooted_group))
    return (str(c.op), where, c.bytes, c.phase)


def key_text(key: LatencyKey) -> str:
    op, where, nbytes, phase = key
    return f"{op} {where} {nbytes} B {phase}"


def samples(capture: Capture) -> dict[LatencyKey, list[int]]:
    """Durations (ns) of the measured steps' completed calls, all ranks, per latency key."""
    steps = range(capture.warmup_steps, capture.warmup_steps + capture.steps)
    out: dict[LatencyKey, list[int]] = defaultdict(list)
    for c in capture.calls:
        if c.step in steps and c.duration_ns is not None:
            out[latency_key(c)].append(c.duration_ns)
    return dict(out)


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
    else waited for it), when another rank than ``rank``."""

    @property
    def ratio(self) -> float:
        return self.first_ms / self.steady_ms if self.steady_ms > 0 else math.inf

    def text(self) -> str:
        vs = "expected from the measured steps' rate for its size" if self.expected else "steady"
        late = f"; rank {self.late} arrived last (the others waited for it)" if self.late is not None else ""
        return (
            f"cold-start spike: rank {self.rank} {self.op} {self.where} {self.bytes} B took {self.first_ms:.1f} ms "
            f"in step 0 vs {self.steady_ms:.2f} ms {vs} ({self.ratio:.0f}x){late}"
        )


def _rate(calls: list[CapturedCall]) -> tuple[float, float] | None:
    """(latency ns, ns per byte) of an op from its measured calls: the fastest call's time as the floor,
    the median excess per byte as the rate; None with fewer than 3 calls."""
    if len(calls) < 3:
        return None
    floor = min(c.duration_ns or 0 for c in calls)
    per_byte = [((c.duration_ns or 0) - floor) / c.bytes for c in calls if c.bytes]
    return float(floor), statistics.median(per_byte) if per_byte else 0.0


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
    first: dict[tuple[int, LatencyKey], int] = {}
    steady: dict[tuple[int, LatencyKey], list[int]] = defaultdict(list)
    for c in capture.calls:
        if c.duration_ns is None:
            continue
        k = (c.rank, latency_key(c))
        if c.step == 0:
            first.setdefault(k, c.duration_ns)
        elif c.step in steps:
            steady[k].append(c.duration_ns)
    if 0 in steps:  # no warm-up: step 0 is measured, nothing to compare it with
        return []
    firsts = {(c.rank, latency_key(c)): c for c in reversed(capture.calls) if c.step == 0 and c.duration_ns is not None}
    measured: dict[str, list[CapturedCall]] = defaultdict(list)
    for c in capture.calls:
        if c.step in steps and c.duration_ns is not None:
            measured[str(c.op)].append(c)
    out = []
    for k, f in first.items():
        rank, (op, where, nbytes, _) = k
        if k in steady:  # its own twin in the measured steps
            expected, estimated = float(statistics.median(steady[k])), False
        elif firsts[k].peer is None and (rate := _rate(measured.get(op, []))) is not None:
            # a collective with no twin (DDP's single first bucket, say); a send or recv without one (the
            # pipeline's first tensor-metadata recv) waits for its peer's compute, not for the network
            expected, estimated = rate[0] + rate[1] * nbytes, True
        else:
            continue
        if f > rule.factor * expected and (f - expected) / 1e6 >= rule.min_excess_ms:
            out.append(
                ColdStart(
                    rank=rank,
                    op=op,
                    where=where,
                    bytes=nbytes,
                    first_ms=f / 1e6,
                    steady_ms=expected / 1e6,
                    expected=estimated,
                    late=_late(capture, firsts[k]),
                )
            )
    return sorted(out, key=lambda s: s.first_ms - s.steady_ms, reverse=True)


def mann_whitney_u(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie correction and
    continuity correction; adequate from ~8 samples a side)."""
    n1, n2 = len(a), len(b)
    if not n1 or not n2:
        return 1.0
    pooled = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 0)
    u1 = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma2 = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if sigma2 <= 0:
        return 1.0
    z = (abs(u1 - n1 * n2 / 2) - 0.5) / math.sqrt(sigma2)
    return max(0.0, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2))))


Verdict = Literal["slower", "faster", "~"]


@dataclass(frozen=True, slots=True)
class Shift:
    key: LatencyKey
    verdict: Verdict
    ratio: float
    """Median now / median in the baseline."""
    p: float
    n_now: int
    n_base: int

    def text(self) -> str:
        return (
            f"latency {self.verdict}: {key_text(self.key)}: median x{self.ratio:.2f} "
            f"(Mann-Whitney p={self.p:.2g}, n={self.n_now} vs {self.n_base})"
        )


def shifts(now: dict[LatencyKey, list[int]], base: dict[LatencyKey, list[int]], rule: LatencyRule) -> list[Shift]:
    """Every key with enough samples on both sides, with its verdict. A scenario tests many keys at
    once, so the significance level is shared among them (Bonferroni: ``p_value`` / keys tested);
    otherwise some key of a noisy run would always look shifted."""
    keys = [k for k in sorted(set(now) & set(base)) if min(len(now[k]), len(base[k])) >= rule.min_samples]
    alpha = rule.p_value / max(len(keys), 1)
    out = []
    for key in keys:
        a, b = now[key], base[key]
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = ma / mb if mb > 0 else math.inf
        p = mann_whitney_u(a, b)
        verdict: Verdict = "~"
        if p < alpha and ratio >= rule.factor:
            verdict = "slower"
        elif p < alpha and ratio <= 1 / rule.factor:
            verdict = "faster"
        out.append(Shift(key=key, verdict=verdict, ratio=ratio, p=p, n_now=len(a), n_base=len(b)))
    return out


def changed(found: Iterable[Shift]) -> list[Shift]:
    return [s for s in found if s.verdict != "~"]
