"""What a run sent: one record per collective or point-to-point call on every rank, merged into one document.

Torch-free: the records are written by ``commgate.run.interpose`` inside the rank processes and read here.
Message size ``elements`` follows the convention of ``commgate.model.collectives`` (the largest buffer of the
call on that rank), so measured and predicted rows compare directly.

Steps: ``-1`` is initialisation (engine construction), ``0 .. warmup-1`` the warm-up steps, then the
measured steps. Phases: ``init``, ``forward`` (anything outside backward and the optimizer),
``backward`` (issued while autograd runs a graph), ``optimizer``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commgate.core import schemas
from commgate.core.fsutil import atomic_write_json
from commgate.model.collectives import Op

CAPTURE_VERSION = 1
INIT_STEP = -1
RUN_DIR = "COMMGATE_RUN_DIR"
"""The environment variable naming a locally launched rank's private directory (the launcher's, where the
rank writes its calls; removed after the run): where a workload makes what its run needs (a trainer's
tokenizer and data)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CapturedCall:
    rank: int
    """Global rank that issued the call."""
    seq: int
    """Order of the call on its rank."""
    step: int
    phase: str
    op: Op
    group: tuple[int, ...]
    """Global ranks of the process group the call ran on."""
    peer: int | None
    """Global rank of the other side of a send/recv."""
    dtype: str
    elements: int
    bytes: int
    tensors: int
    """How many tensors a coalesced call carried (1 otherwise)."""
    start_ns: int
    """Issue time, from the rank's own clock origin (when its recorder was installed, before its first call)."""
    duration_ns: int | None
    """Issue to completion; None when the call never completed (a hang)."""
    root: int | None = None
    """Global rank of the root of a broadcast, reduce, gather or scatter (None for other ops)."""

    @property
    def rooted_group(self) -> tuple[int, ...]:
        """The group with the root listed first (the convention of ``commgate.model.collectives``)."""
        if self.root is None:
            return self.group
        return (self.root, *(r for r in self.group if r != self.root))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapturedCall:
        return cls(**{**d, "op": Op(d["op"]), "group": tuple(d["group"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWindow:
    """When one rank ran one training step, on the clock of its calls' ``start_ns``."""

    rank: int
    step: int
    start_ns: int
    end_ns: int
    blocked_ns: int | None = None
    """How long the training thread was blocked in the step: neither running nor waiting for a CPU, so
    waiting on a collective (``commgate.run.threadclock``). It is the step's exposed
    communication on CPU ranks; None where not measured."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True, kw_only=True)
class RankClock:
    """Where one rank's clock origin (the zero of its calls' ``start_ns``) lies on its host's clocks, so
    that the calls of different ranks can be put on one time line: ``monotonic_ns`` on the host's
    monotonic clock (one clock for every process of a host), ``wall_ns`` on its real-time clock (between
    hosts, as well as their clocks are synchronised)."""

    rank: int
    host: str
    monotonic_ns: int
    wall_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Capture:
    """The merged capture of one run."""

    scenario: str
    world_size: int
    warmup_steps: int
    steps: int
    backend: str
    calls: tuple[CapturedCall, ...]
    stack: dict[str, str | None] = field(default_factory=dict)
    """What rank 0 ran on: ``hardware`` (GPU model and count, or CPU model and cores), ``cuda``,
    ``rocm``, ``backend_version`` (NCCL/RCCL; None for gloo). Empty when not recorded."""
    timeline: dict[str, float] = field(default_factory=dict)
    """Where rank 0's wall time went, in seconds: ``start`` (launch to the rank's first line), ``join``
    (process-group rendezvous), ``build`` (workload and engine construction), ``steps`` (warm-up and
    measured steps), ``finish`` (collecting the calls, teardown). Empty when not measured."""
    step_windows: tuple[StepWindow, ...] = ()
    """Every rank's step boundaries (warm-up included), for step times and the communication fraction."""
    ranks: tuple[int, ...] | None = None
    """The ranks that ran and were captured; None: all ``world_size`` of them. An emulated run
    (``commgate.run.emulate``): rank 0 alone, the job seen from it."""
    clocks: tuple[RankClock, ...] = ()
    """Each rank's clock origin; empty where not recorded (a Flight Recorder dump, an older capture)."""

    def origins(self) -> dict[int, int] | None:
        """Each rank's clock origin on one time line (ns): the host's monotonic clock when every rank ran
        on one host, the real-time clock otherwise; None unless every rank with a call has a clock."""
        if not self.clocks:
            return None
        one_host = len({c.host for c in self.clocks}) == 1
        out = {c.rank: c.monotonic_ns if one_host else c.wall_ns for c in self.clocks}
        return out if all(c.rank in out for c in self.calls) else None

    @property
    def ran(self) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else tuple(range(self.world_size))

    def to_json(self) -> dict[str, Any]:
        doc = self._json()
        if self.ranks is not None:
            doc["ranks"] = list(self.ranks)
        if self.clocks:
            doc["clocks"] = [asdict(c) for c in self.clocks]
        return doc

    def _json(self) -> dict[str, Any]:
        return {
            "capture_version": CAPTURE_VERSION,
            "scenario": self.scenario,
            "world_size": self.world_size,
            "warmup_steps": self.warmup_steps,
            "steps": self.steps,
            "backend": self.backend,
            "calls": [asdict(c) | {"op": str(c.op), "group": list(c.group)} for c in self.calls],
            "timeline": dict(self.timeline),
            "stack": dict(self.stack),
            "step_windows": [asdict(w) for w in self.step_windows],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Capture:
        return cls(
            scenario=d["scenario"],
            world_size=d["world_size"],
            warmup_steps=d["warmup_steps"],
            steps=d["steps"],
            backend=d["backend"],
            calls=tuple(CapturedCall.from_json(c) for c in d["calls"]),
            timeline=dict(d.get("timeline", {})),
            stack=dict(d.get("stack", {})),
            step_windows=tuple(StepWindow(**w) for w in d.get("step_windows", [])),
            ranks=tuple(d["ranks"]) if "ranks" in d else None,
            clocks=tuple(RankClock(**c) for c in d.get("clocks", [])),
        )


def schema() -> dict[str, Any]:
    """The published capture JSON Schema (draft 2020-12)."""
    return schemas.load("capture")


def validate(doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid capture document."""
    schemas.validate("capture", doc)


def write_rank_calls(
    path: Path, calls: Iterable[CapturedCall], windows: Iterable[StepWindow] = (), clock: RankClock | None = None
) -> None:
    """One rank's file: its calls, its step windows and its clock origin."""
    doc: dict[str, Any] = {
        "calls": [asdict(c) | {"group": list(c.group)} for c in calls],
        "step_windows": [asdict(w) for w in windows],
    }
    if clock is not None:
        doc["clock"] = asdict(clock)
    atomic_write_json(path, doc)


def rank_clock(doc: dict[str, Any]) -> tuple[RankClock, ...]:
    """The clock of a rank file's document (``write_rank_calls``), if it has one."""
    return (RankClock(**doc["clock"]),) if "clock" in doc else ()


def timeline(marks: dict[str, float]) -> dict[str, float]:
    """``Capture.timeline`` from a rank's clock marks (``launch`` when known, ``entry``, ``joined``,
    ``built``, ``stepped``, ``done``; one system-wide monotonic clock)."""
    spans = {"join": ("entry", "joined"), "build": ("joined", "built"), "steps": ("built", "stepped")}
    spans |= {"finish": ("stepped", "done"), "start": ("launch", "entry")}
    return {k: round(marks[b] - marks[a], 6) for k, (a, b) in spans.items() if a in marks and b in marks}


def merge(
    rank_files: list[Path],
    *,
    scenario: str,
    warmup_steps: int,
    steps: int,
    backend: str,
    timeline: dict[str, float] | None = None,
    stack: dict[str, str | None] | None = None,
    world_size: int | None = None,
    ranks: tuple[int, ...] | None = None,
) -> Capture:
    """One capture from every rank's file, ordered by (rank, seq); ``world_size`` and ``ranks`` where
    the files are some ranks of a larger job (an emulated run)."""
    calls: list[CapturedCall] = []
    windows: list[StepWindow] = []
    clocks: list[RankClock] = []
    for f in rank_files:
        doc = json.loads(f.read_text())
        calls += [CapturedCall.from_json(c) for c in doc["calls"]]
        windows += [StepWindow(**w) for w in doc["step_windows"]]
        clocks += rank_clock(doc)
    calls.sort(key=lambda c: (c.rank, c.seq))
    windows.sort(key=lambda w: (w.rank, w.step))
    return Capture(
        scenario=scenario,
        world_size=world_size or len(rank_files),
        warmup_steps=warmup_steps,
        steps=steps,
        backend=backend,
        calls=tuple(calls),
        timeline=timeline or {},
        stack=stack or {},
        step_windows=tuple(windows),
        ranks=ranks,
        clocks=tuple(sorted(clocks, key=lambda c: c.rank)),
    )


def busy_ns(calls: Iterable[CapturedCall], start: int, end: int) -> int:
    """Length of the union of the calls' [start, start + duration) intervals within [start, end)."""
    spans = sorted(
        (max(c.start_ns, start), min(c.start_ns + c.duration_ns, end))
        for c in calls
        if c.duration_ns is not None and c.start_ns < end and c.start_ns + c.duration_ns > start
    )
    total, cur_a, cur_b = 0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None and cur_a is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_a is not None and cur_b is not None:
        total += cur_b - cur_a
    return total
