"""Latency drift: cold-start spikes within a run, and shifts against a baseline's raw samples.

Torch-free. Latencies are the captured calls' ``duration_ns`` (issue to observed completion, so a recv
includes waiting for its sender: exactly what the paper's cold-cache anomaly looks like).

* Cold start: for each (rank, op, peer or group, message size), the first call of step 0 against the
  median of the same calls in the measured steps; flagged when the ratio passes the scenario's factor
  *and* the first call is at least ``min_excess_ms`` slower (a 20 us call taking 10x is noise, a recv
  taking seconds is not).
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

    @property
    def ratio(self) -> float:
        return self.first_ms / self.steady_ms if self.steady_ms > 0 else math.inf

    def text(self) -> str:
        return (
            f"cold-start spike: rank {self.rank} {self.op} {self.where} {self.bytes} B took {self.first_ms:.1f} ms "
            f"in step 0 vs {self.steady_ms:.2f} ms steady ({self.ratio:.0f}x)"
        )


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
    out = []
    for k, durations in steady.items():
        if k not in first:
            continue
        med, f = statistics.median(durations), first[k]
        if f > rule.factor * med and (f - med) / 1e6 >= rule.min_excess_ms:
            rank, (op, where, nbytes, _) = k
            out.append(ColdStart(rank=rank, op=op, where=where, bytes=nbytes, first_ms=f / 1e6, steady_ms=med / 1e6))
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
