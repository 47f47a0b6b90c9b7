"""Stored baselines: what a scenario sent last time it was accepted, one JSON file per scenario and
backend (where: ``commgate.judge.store``), validated by a published schema.

Volumes and counts (calls per (window, op, group, dtype, size, phase), bytes per step per op, the
message-size histogram) are hardware-independent and compared exactly; latency is kept per hardware
fingerprint as a history of up to ``HISTORY`` runs (``commgate.judge.drift.RunLatency``: the run, not the
call, is what a latency verdict compares). Provenance records the
stack the baseline was taken on. Files are written atomically (temporary file, fsync, ``os.replace``).
A file with an older ``schema_version`` is migrated on load (``MIGRATIONS``); a malformed one is a
one-line ``BaselineError`` naming the file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from commgate.core import schemas
from commgate.core.errors import DocumentError, Problem
from commgate.core.fsutil import atomic_write_json, read_json
from commgate.core.provenance import commit as provenance_commit
from commgate.core.provenance import cpu_fingerprint, environment
from commgate.judge.drift import RunLatency, key_text, summarize
from commgate.judge.finding import Difference
from commgate.judge.reconcile import Reconciliation, call_label
from commgate.model.scenario import Tolerance
from commgate.run.capture import Capture

BASELINE_VERSION = 2
HISTORY = 8
"""Runs of latency kept per hardware (the oldest is dropped)."""


def _v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept every call's duration pooled over ranks and steps: no run can be told from another
    in it, so the latency history starts empty (volumes are kept as they are)."""
    return doc | {"schema_version": 2, "latency": {}}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}
"""``MIGRATIONS[v]`` turns a version-v document into a version-(v+1) one."""

CallKey = tuple[str, str, tuple[int, ...], str, int, str]
"""(window, op, group, dtype, bytes per call, phase), as in ``commgate.judge.reconcile``."""


class BaselineError(DocumentError):
    """A baseline file that cannot be used: unreadable, malformed, or from a newer commgate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    scenario: str
    backend: str
    provenance: dict[str, Any]
    calls: dict[CallKey, int]
    bytes_per_step: dict[str, Fraction]
    histogram: dict[int, Fraction]
    """Message size (bytes) -> calls per measured step, all ranks."""
    latency: dict[str, tuple[RunLatency, ...]] = field(default_factory=dict)
    """Hardware fingerprint -> the latency of the stored runs, oldest first."""
    unsteady: tuple[Difference, ...] = ()
    """Where runs joined into this one differed in volume (``commgate compare`` on several runs; never
    stored)."""

    @classmethod
    def of(
        cls,
        capture: Capture,
        calls: dict[CallKey, int],
        provenance: dict[str, Any],
    ) -> Baseline:
        """A run's measured counts, its bytes per step per op and message-size histogram derived from
        them exactly (as the reconciliation's measured bytes), its latency (one run) under
        ``provenance["hardware"]``."""
        steps = max(capture.steps, 1)
        hist: dict[int, Fraction] = {}
        bytes_per_step: dict[str, Fraction] = {}
        for (window, op, _, _, nbytes, _), n in calls.items():
            if window == "steps":
                hist[nbytes] = hist.get(nbytes, Fraction(0)) + Fraction(n, steps)
                bytes_per_step[op] = bytes_per_step.get(op, Fraction(0)) + Fraction(n * nbytes, steps)
        return cls(
            scenario=capture.scenario,
            backend=capture.backend,
            provenance=provenance,
            calls={k: n for k, n in calls.items() if n},
            bytes_per_step={op: b for op, b in bytes_per_step.items() if b},
            histogram={size: n for size, n in hist.items() if n},
            # an emulated run's calls complete at once: its timings are not latencies, never stored as such
            latency={}
            if capture.ranks is not None
            else {provenance["hardware"]: (summarize(capture, date=provenance.get("date", "")),)},
        )

    @classmethod
    def from_run(cls, capture: Capture, rec: Reconciliation, provenance: dict[str, Any]) -> Baseline:
        calls = {(k.window, k.op, k.group, k.dtype, k.bytes_per_call, k.phase): k.measured_calls for k in rec.keys}
        return cls.of(capture, calls, provenance)

    def with_history(self, stored: Baseline | None) -> Baseline:
        """This baseline with ``stored``'s latency runs before its own (other machines' kept as they are),
        the newest ``HISTORY`` per machine."""
        if stored is None:
            return self
        merged = dict(stored.latency)
        for hw, runs in self.latency.items():
            merged[hw] = (*stored.latency.get(hw, ()), *runs)[-HISTORY:]
        return replace(self, latency=merged)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": BASELINE_VERSION,
            "scenario": self.scenario,
            "backend": self.backend,
            "provenance": self.provenance,
            "calls": [
                {"window": w, "op": o, "group": list(g), "dtype": d, "bytes_per_call": b, "phase": p, "calls": n}
                for (w, o, g, d, b, p), n in sorted(self.calls.items(), key=str)
            ],
            "bytes_per_step": {op: exact(b) for op, b in sorted(self.bytes_per_step.items())},
            "histogram": {str(size): exact(n) for size, n in sorted(self.histogram.items())},
            "latency": {
                hw: [
                    {
                        "date": run.date,
                        **({"measure": run.measure} if run.measure else {}),
                        "compute_ns": list(run.compute),
                        "step_ns": list(run.step),
                        "keys": [
                            {
                                "key": key_text(k),
                                "op": k[0],
                                "where": k[1],
                                "bytes": k[2],
                                "phase": k[3],
                                "step_ns": list(v),
                            }
                            | ({"floor_ns": run.floor[k]} if k in run.floor else {})
                            for k, v in sorted(run.keys.items())
                        ],
                    }
                    for run in runs
                ]
                for hw, runs in sorted(self.latency.items())
            },
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Baseline:
        return cls(
            scenario=doc["scenario"],
            backend=doc["backend"],
            provenance=doc["provenance"],
            calls={
                (c["window"], c["op"], tuple(c["group"]), c["dtype"], c["bytes_per_call"], c["phase"]): c["calls"]
                for c in doc["calls"]
            },
            bytes_per_step={op: Fraction(b) for op, b in doc["bytes_per_step"].items()},
            histogram={int(size): Fraction(n) for size, n in doc["histogram"].items()},
            latency={
                hw: tuple(
                    RunLatency(
                        keys={(k["op"], k["where"], k["bytes"], k["phase"]): tuple(k["step_ns"]) for k in run["keys"]},
                        compute=tuple(run["compute_ns"]),
                        step=tuple(run["step_ns"]),
                        date=run["date"],
                        measure=run.get("measure", ""),
                        floor={
                            (k["op"], k["where"], k["bytes"], k["phase"]): k["floor_ns"]
                            for k in run["keys"]
                            if "floor_ns" in k
                        },
                    )
                    for run in runs
                )
                for hw, runs in doc["latency"].items()
            },
        )


def exact(x: Fraction | int) -> int | str:
    """An integer, or a fraction as ``"p/q"``: stored values compare exactly after a round trip."""
    f = Fraction(x)
    return f.numerator if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def validate(doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid current-version baseline."""
    schemas.validate("baseline", doc)


def migrate(doc: dict[str, Any], *, file: str = "<baseline>") -> dict[str, Any]:
    def fail(message: str) -> BaselineError:
        return BaselineError([Problem(file=file, path="$.schema_version", message=message)])

    version = doc.get("schema_version")
    if not isinstance(version, int):
        raise fail(f"{version!r} is not a baseline schema version")
    if version > BASELINE_VERSION:
        raise fail(f"{version} is newer than this commgate reads ({BASELINE_VERSION}); upgrade commgate")
    while version < BASELINE_VERSION:
        if version not in MIGRATIONS:
            raise fail(f"{version} has no migration to {BASELINE_VERSION}")
        doc = MIGRATIONS[version](doc)
        version = doc["schema_version"]
    return doc


def load(path: Path, *, scenario: str | None = None) -> Baseline:
    """The baseline at ``path``, migrated and validated (and, given ``scenario``, of that scenario: a file
    copied or renamed from another's is not compared); ``BaselineError`` (one line) otherwise."""
    hint = "; delete it: the next gated run (pytest, commgate run --gate, commgate check) writes it anew"
    try:  # a field the schema refuses, or a failed migration, gets the fix too, not a parse error alone
        doc = read_json(
            path, validate, migrate=lambda d: migrate(d, file=str(path)), hint=hint, mend=hint, version=BASELINE_VERSION
        )
    except DocumentError as exc:
        raise BaselineError(exc.problems) from None
    if scenario is not None and doc["scenario"] != scenario:
        message = f"{doc['scenario']!r} is another scenario's baseline, not {scenario!r}'s" + hint
        raise BaselineError([Problem(file=str(path), path="$.scenario", message=message)])
    if twice := _listed_twice(doc):
        where, what = twice
        raise BaselineError([Problem(file=str(path), path=where, message=f"{what} is listed twice" + hint)])
    return Baseline.from_json(doc)


def _listed_twice(doc: dict[str, Any]) -> tuple[str, str] | None:
    """Where a hand-edited baseline lists one kind of call (or one latency key of a run) a second time,
    and which: the dictionaries ``from_json`` builds would keep the last silently."""
    seen: set[tuple[Any, ...]] = set()
    for i, c in enumerate(doc["calls"]):
        key = (c["window"], c["op"], tuple(c["group"]), c["dtype"], c["bytes_per_call"], c["phase"])
        if key in seen:
            return f"$.calls[{i}]", f"{c['op']} of {c['bytes_per_call']} B on group {c['group']} ({c['phase']})"
        seen.add(key)
    for hw, runs in doc["latency"].items():
        for j, run in enumerate(runs):
            keys: set[tuple[Any, ...]] = set()
            for i, k in enumerate(run["keys"]):
                if (k["op"], k["where"], k["bytes"], k["phase"]) in keys:
                    return f"$.latency[{hw!r}][{j}].keys[{i}]", f"the latency of {k['key']!r}"
                keys.add((k["op"], k["where"], k["bytes"], k["phase"]))
    return None


def write(path: Path, baseline: Baseline) -> Path:
    """``baseline`` as canonical JSON at ``path``, atomically."""
    return atomic_write_json(path, baseline.to_json())


def provenance(capture: Capture, world_size: int) -> dict[str, Any]:
    """The stack a run was taken on: package versions from metadata, the rest as rank 0 saw it."""
    env = environment()
    commit = provenance_commit()
    st = capture.stack
    return {
        "torch": env["torch"],
        "deepspeed": env["deepspeed"],
        "commgate": env["commgate"],
        "python": env["python"],
        "backend": capture.backend,
        "backend_version": st.get("backend_version"),
        "cuda": st.get("cuda"),
        "rocm": st.get("rocm"),
        "hardware": st.get("hardware") or cpu_fingerprint(),
        "world_size": world_size,
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def compare(now: Baseline, stored: Baseline, *, bytes_tol: Tolerance, calls_tol: Tolerance) -> list[Difference]:
    """Counts, bytes per step and the histogram of ``now`` against ``stored`` (tolerances from the
    scenario's ``expectations.baseline``; exact by default)."""
    out: list[Difference] = []
    for key in sorted(set(now.calls) | set(stored.calls), key=str):
        a, b = now.calls.get(key, 0), stored.calls.get(key, 0)
        if not calls_tol.allows(a, b):
            w, op, g, dtype, nbytes, phase = key
            out.append(Difference(call_label(w, op, dtype, nbytes, phase, g), a, b))
    for op in sorted(set(now.bytes_per_step) | set(stored.bytes_per_step)):
        a2, b2 = now.bytes_per_step.get(op, Fraction(0)), stored.bytes_per_step.get(op, Fraction(0))
        if not bytes_tol.allows(a2, b2):
            out.append(Difference(f"bytes per step, {op}", a2, b2))
    for size in sorted(set(now.histogram) | set(stored.histogram)):
        a3, b3 = now.histogram.get(size, Fraction(0)), stored.histogram.get(size, Fraction(0))
        if a3 != b3:
            out.append(Difference(f"messages of {size} B per step", a3, b3))
    return out
