"""Pre-upgrade A/B: what changed in communication between two runs (``commgate compare BEFORE AFTER``).

Each side is a run report (``report.json`` from ``commgate run`` or ``--commgate-report-dir``, or the
report directory holding it), a directory of several runs' reports (``*/report.json``:
``ci/pre-upgrade.sh`` writes ``before/1..N`` and ``after/1..N``, interleaved so that a drifting machine
weighs on both sides alike), or a baseline directory (``baselines/``, one file per scenario and backend,
with its stored runs, as ``commgate.judge.store`` lays it out, each file where its scenario's runs read
it; obtained files are not baselines). A directory holding two of these kinds, a report listing a scenario
twice, a baseline file under another name: a one-line error. Per scenario present on both sides: calls
per (window, op, group, dtype, size, phase), bytes per step per op and the message-size histogram,
exactly (``commgate.judge.baseline.compare``; the first run of a side stands for it, and a side whose
runs disagree in volume is itself a change); latency per op by ``commgate.judge.drift.shifts``, the after
runs against the before runs, once each side has ``min_runs``. A change in volume, a scenario on one side
only, or a slowdown in every run is a change. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from commgate.core import schemas
from commgate.core.errors import CommgateError, DocumentError, Problem
from commgate.core.fsutil import read_json
from commgate.judge import baseline as bl
from commgate.judge.causes import Cause, recognise
from commgate.judge.drift import Assessment, shifts
from commgate.judge.finding import Difference
from commgate.judge.reconcile import measured_calls
from commgate.judge.store import BaselineStore
from commgate.model.scenario import LatencyRule, Tolerance
from commgate.run.capture import Capture

EXACT = Tolerance()


def _from_report_entry(sc: dict[str, Any]) -> bl.Baseline | None:
    """A report's scenario as a baseline (None when it did not run: skipped, or an error). A run no scenario
    describes (``commgate check`` of a job without ``--scenario``) lists no per-key table, its model being a
    stand-in's: its calls are counted from its capture, as the reconciliation counts them."""
    if "capture" not in sc:
        return None
    capture = Capture.from_json(sc["capture"])
    if "calls" in sc:
        calls = {
            (k["window"], k["op"], tuple(k["group"]), k["dtype"], k["bytes_per_call"], k["phase"]): k["measured_calls"]
            for k in sc["calls"]
        }
    else:
        calls = {(w, *key): n for w, counted in measured_calls(capture).items() for key, n in counted.items()}
    # bytes per step derived from the integer counts, exactly (the report's measured_bytes are floats)
    return bl.Baseline.of(capture, calls, {"hardware": capture.stack.get("hardware") or ""})


Side = dict[str, bl.Baseline | str]
"""Scenario id -> what it sent, or, where a report holds it but it did not run (an error, a skip), its
status."""


def load_side(path: Path) -> Side:
    """Scenario id (with the backend when a baseline directory holds several) -> what it sent, with the
    latency of every run the side holds; or the status of a scenario that did not run (in any of them).

    A directory holding ``report.json`` (``--report-dir``'s) is that report; one holding ``*/report.json``,
    those runs; else a baseline directory. A directory that holds two of these kinds is a one-line error:
    which to compare is not guessed."""
    if not path.is_dir():
        return _load_report(path)
    own = path / "report.json"
    reports = sorted(path.glob("*/report.json"), key=_run_order)
    runs = {p.parent for p in reports}
    # baseline files are in the backends' folders; a run's folder holds its trace.json, no baseline
    stored = [p for p in BaselineStore(path).query() if p.parent != path and p.parent not in runs]
    held = [
        f"a run's report ({own})" if own.is_file() else "",
        f"runs' reports ({reports[0]}{', ...' if len(reports) > 1 else ''})" if reports else "",
        f"baseline files ({stored[0]}{', ...' if len(stored) > 1 else ''})" if stored else "",
    ]
    if len(kinds := [k for k in held if k]) > 1:
        raise CommgateError(
            f"{path}: holds {' and '.join(kinds)}: compare one kind at a time; give the report.json, the folder "
            "of runs or the baseline folder alone (move the others out)"
        )
    if own.is_file():
        return _load_report(own)
    if reports:
        runs_read = [_load_report(p) for p in reports]
        out = dict(runs_read[0])
        for run in runs_read[1:]:
            for name, b in run.items():
                first = out.setdefault(name, b)
                if first is not b:
                    out[name] = first if isinstance(first, str) else b if isinstance(b, str) else _join(first, b)
        return out
    files = BaselineStore(path).query()
    if not files:
        raise CommgateError(f"{path}: no baseline files (expected {path}/<backend>/<scenario>.json)")
    loaded = [_load_baseline(path, f) for f in files]
    backends = {b.backend for b in loaded}
    side: Side = {(b.scenario if len(backends) == 1 else f"{b.scenario} ({b.backend})"): b for b in loaded}
    return side


def _load_baseline(root: Path, file: Path) -> bl.Baseline:
    """The baseline in ``file`` of the baseline directory ``root``, kept where its scenario's runs look for it
    (``commgate.judge.store``): a file renamed or moved from its place is not compared under another name."""
    b = bl.load(file)
    expected = BaselineStore(root).path(b.backend, b.scenario)
    if file.name != expected.name:
        message = f"{b.scenario!r}, but the file is named {file.name}: rename it {expected.name}"
        raise bl.BaselineError([Problem(file=str(file), path="$.scenario", message=message + _WHOSE)])
    if file.parent != root and file.parent.name != b.backend:
        message = f"{b.backend!r}, but the file is in {file.parent.name}/: move it to {expected}"
        raise bl.BaselineError([Problem(file=str(file), path="$.backend", message=message + _WHOSE)])
    return b


_WHOSE = " (where its scenario's runs read it), or delete it if it is another scenario's"


def _run_order(p: Path) -> tuple[int, str]:
    name = p.parent.name
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def _join(a: bl.Baseline, b: bl.Baseline) -> bl.Baseline:
    """``a`` with ``b``'s latency runs added; a volume that differs between the two runs is kept as a
    difference (``ScenarioChange.unsteady``)."""
    latency = {hw: (*a.latency.get(hw, ()), *b.latency.get(hw, ())) for hw in set(a.latency) | set(b.latency)}
    unsteady = bl.compare(b, a, bytes_tol=EXACT, calls_tol=EXACT)
    return replace(a, latency=latency, unsteady=(*a.unsteady, *unsteady))


def _load_report(path: Path) -> Side:
    hint, version = ": expected a commgate report.json", schemas.load("report")["properties"]["schema_version"]["const"]
    doc = read_json(path, lambda d: schemas.validate("report", d), hint=hint, version=version)
    out: Side = {}
    where: dict[str, int] = {}
    for i, sc in enumerate(doc["scenarios"]):
        b = _from_report_entry(sc)
        name = sc["name"] if b is None else b.scenario
        if name in where:
            message = f"{name!r} is listed twice (also $.scenarios[{where[name]}]): which run is it? Give a report "
            message += "that lists each scenario once, as commgate run writes it"
            raise DocumentError([Problem(file=str(path), path=f"$.scenarios[{i}]", message=message)])
        where[name] = i
        out[name] = sc["status"] if b is None else b
    return out


@dataclass
class ScenarioChange:
    scenario: str
    volume: list[Difference] = field(default_factory=list)
    causes: tuple[Cause, ...] = ()
    """What the calls that differ mean, in words, where a pattern proves it (``commgate.judge.causes``)."""
    latency: Assessment = field(default_factory=Assessment)
    only: str = ""
    """'before' or 'after' when the scenario is on one side only."""
    statuses: tuple[str, str] | None = None
    """Before and after, where a side holds the scenario but did not run it ('error', 'skipped'; 'ran')."""
    backends: tuple[str, str] | None = None
    """Before's and after's backends where they differ (gloo and emulated: an emulated run is rank 0's view,
    its counts no change of the job's): the calls are not compared."""

    @property
    def changed(self) -> bool:
        ran_differently = self.statuses is not None and self.statuses[0] != self.statuses[1]
        return bool(self.volume or self.only or self.latency.slower or ran_differently or self.backends)

    @property
    def blind(self) -> bool:
        """On both sides, run on neither (skipped alike excepted): nothing compared, nothing to call the same."""
        return self.statuses is not None and not self.changed and self.statuses[0] != "skipped"

    def lines(self) -> list[str]:
        if self.only:
            return [f"{self.scenario}: only in {self.only}"]
        if self.backends is not None:
            before, after = self.backends
            return [f"{self.scenario}: ran on {before} before, on {after} after: two backends' calls are not compared"]
        if self.statuses is not None:
            before, after = self.statuses
            if self.changed:
                return [f"{self.scenario}: {before} before, {after} after"]
            return [f"{self.scenario}: not compared ({before} on both sides)"]
        moved = self.latency.changed()
        if not self.volume and not moved:
            return [f"{self.scenario}: unchanged ({self.latency.summary()})"]
        out = [f"{self.scenario}:"]
        out += [f"    {c.text}" for c in self.causes]
        out += [f"    {d.text(('after', 'before'))}" for d in self.volume]
        out += [f"    {s.text()}" for s in moved]
        return out


def _by_backend(side: Side) -> bool:
    """Whether ``side`` names its scenarios with their backend (a baseline directory of several backends)."""
    return any(isinstance(v, bl.Baseline) and k != v.scenario for k, v in side.items())


def _named_as(side: Side, other: Side) -> Side:
    """``side`` keyed as ``other`` is, where ``other`` names its scenarios with their backend and ``side`` does
    not (``compare baselines/ out/``: the repository's baselines hold gloo's and the emulated ones; a report,
    one run's): else nothing would match, and every scenario would be "only in" one side."""
    if not _by_backend(other) or _by_backend(side):
        return side
    out: Side = {}
    for name, v in side.items():
        if isinstance(v, bl.Baseline):
            out[f"{v.scenario} ({v.backend})"] = v
        else:  # a scenario that did not run has no backend: the other side's one of that name, if one
            alike = [k for k in other if k.startswith(f"{name} (")]
            out[alike[0] if len(alike) == 1 else name] = v
    return out


def compare(before: Side, after: Side, rule: LatencyRule) -> list[ScenarioChange]:
    before, after = _named_as(before, after), _named_as(after, before)
    out = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            out.append(ScenarioChange(name, only="before"))
        elif name not in before:
            out.append(ScenarioChange(name, only="after"))
        elif isinstance(a := after[name], str) or isinstance(b := before[name], str):
            out.append(ScenarioChange(name, statuses=(_status(before[name]), _status(a))))
        elif a.backend != b.backend:  # an emulated run is rank 0's view: its counts are no change of the job's
            out.append(ScenarioChange(name, backends=(b.backend, a.backend)))
        else:
            volume = bl.compare(a, b, bytes_tol=EXACT, calls_tol=EXACT)
            volume += [replace(d, what=f"{d.what} (differs between the before runs)") for d in b.unsteady]
            volume += [replace(d, what=f"{d.what} (differs between the after runs)") for d in a.unsteady]
            change = ScenarioChange(name, volume=volume, causes=recognise(a.calls, b.calls))
            common = sorted(set(a.latency) & set(b.latency))  # the same hardware if both have it
            lat_a = a.latency[common[0]] if common else next(iter(a.latency.values()), ())
            lat_b = b.latency[common[0]] if common else next(iter(b.latency.values()), ())
            change.latency = shifts(lat_a, lat_b, rule)
            if min(len(lat_a), len(lat_b)) < rule.min_runs:
                change.latency = Assessment(
                    note=f"latency not judged: {len(lat_b)} before and {len(lat_a)} after run(s), "
                    f"{rule.min_runs} a side needed"
                )
            out.append(change)
    return out


def _status(side: bl.Baseline | str) -> str:
    return side if isinstance(side, str) else "ran"


def verdict(changes: list[ScenarioChange]) -> tuple[str, int]:
    """The last line of ``commgate compare`` and its exit status: 1 on a change, and where nothing (or not
    everything that is on both sides) was compared: a scenario that errored on both sides is not "the same"."""
    n, blind = sum(c.changed for c in changes), sum(c.blind for c in changes)
    compared = sum(c.statuses is None and not c.only for c in changes)
    line = f"{n} of {len(changes)} scenario(s) changed"
    sides = [f"{k} only in {side}" for side in ("before", "after") if (k := sum(c.only == side for c in changes))]
    if sides:  # (a scenario added or removed changes the suite: counted, and said apart)
        line += f" ({', '.join(sides)})"
    if blind:
        line += f"; {blind} not compared (run on neither side)"
    if n:
        return line, 1
    if not compared:
        return line + ": nothing compared, no scenario ran on both sides", 1
    if blind:
        return line + ": cannot say the two runs communicate the same", 1
    return line + ": the two runs communicate the same", 0
