"""Pre-upgrade A/B: what changed in communication between two runs (``commgate compare BEFORE AFTER``).

Each side is a run report (``report.json`` from ``commgate run`` or ``--commgate-report-dir``) or a
baseline directory (``baselines/``, one file per scenario and backend). Per scenario present on both
sides: calls per (window, op, group, dtype, size, phase), bytes per step per op and the message-size
histogram, exactly (``commgate.judge.baseline.compare``); latency by ``commgate.judge.drift.shifts`` on the raw
samples. A change in volume, a scenario on one side only, or a significant slowdown is a change.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from commgate.core import schemas
from commgate.core.errors import CommgateError
from commgate.core.fsutil import read_json
from commgate.judge import baseline as bl
from commgate.judge.drift import Shift, shifts
from commgate.model.scenario import LatencyRule, Tolerance
from commgate.run.capture import Capture

EXACT = Tolerance()


def _from_report_entry(sc: dict[str, Any]) -> bl.Baseline | None:
    """A report's scenario as a baseline (None when it did not run: skipped, or an error)."""
    if "calls" not in sc or "capture" not in sc:
        return None
    capture = Capture.from_json(sc["capture"])
    calls = {
        (k["window"], k["op"], tuple(k["group"]), k["dtype"], k["bytes_per_call"], k["phase"]): k["measured_calls"]
        for k in sc["calls"]
    }
    bytes_per_step = {c["op"]: Fraction(c["measured_bytes"]) for c in sc["collectives"]}
    return bl.Baseline.of(capture, calls, bytes_per_step, {"hardware": capture.stack.get("hardware") or ""})


def load_side(path: Path) -> dict[str, bl.Baseline]:
    """Scenario id (with the backend when a baseline directory holds several) -> what it sent."""
    if path.is_dir():
        files = sorted(path.glob("*/*.json")) or sorted(path.glob("*.json"))
        if not files:
            raise CommgateError(f"{path}: no baseline files (expected {path}/<backend>/<scenario>.json)")
        loaded = [bl.load(f) for f in files]
        backends = {b.backend for b in loaded}
        return {(b.scenario if len(backends) == 1 else f"{b.scenario} ({b.backend})"): b for b in loaded}
    doc = read_json(path, lambda d: schemas.validate("report", d), hint=": expected a commgate report.json")
    out = {}
    for sc in doc["scenarios"]:
        b = _from_report_entry(sc)
        if b is not None:
            out[b.scenario] = b
    return out


@dataclass
class ScenarioChange:
    scenario: str
    volume: list[bl.Difference] = field(default_factory=list)
    latency: list[Shift] = field(default_factory=list)
    only: str = ""
    """'before' or 'after' when the scenario ran on one side only."""

    @property
    def changed(self) -> bool:
        return bool(self.volume or self.only or any(s.verdict == "slower" for s in self.latency))

    def lines(self) -> list[str]:
        if self.only:
            return [f"{self.scenario}: only in {self.only}"]
        moved = [s for s in self.latency if s.verdict != "~"]
        if not self.volume and not moved:
            return [f"{self.scenario}: unchanged (latency ~ on {len(self.latency)} keys)"]
        out = [f"{self.scenario}:"]
        out += [f"    {d.text(('after', 'before'))}" for d in self.volume]
        out += [f"    {s.text()}" for s in moved]
        return out


def compare(before: dict[str, bl.Baseline], after: dict[str, bl.Baseline], rule: LatencyRule) -> list[ScenarioChange]:
    out = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            out.append(ScenarioChange(name, only="before"))
        elif name not in before:
            out.append(ScenarioChange(name, only="after"))
        else:
            a, b = after[name], before[name]
            change = ScenarioChange(name, volume=bl.compare(a, b, bytes_tol=EXACT, calls_tol=EXACT))
            common = sorted(set(a.latency) & set(b.latency))  # the same hardware if both have it
            lat_a = a.latency[common[0]] if common else next(iter(a.latency.values()), {})
            lat_b = b.latency[common[0]] if common else next(iter(b.latency.values()), {})
            change.latency = shifts(lat_a, lat_b, rule)
            out.append(change)
    return out
