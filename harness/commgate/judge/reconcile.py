"""Measured vs predicted: every captured call matched to a row of the per-collective model.

Two windows are compared: initialisation (step -1) and the measured steps (after warm-up). A *key* is
(op, process group — or (rank, peer) for send/recv —, dtype, bytes per call, phase); for each key the
calls counted over all ranks must equal the model's. Per op, the measured bytes per step are set
against the model's steady rows, the named residual terms (rows that happen once, such as DDP's
bucket rebuild, when they fall into the window), and what is left: ``unexplained_bytes``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from fractions import Fraction

from commgate.model.collectives import OPS, Op, add_traffic
from commgate.model.expectation import ExpectedCollective, Prediction
from commgate.model.layout import group_text
from commgate.run.capture import INIT_STEP, Capture

Key = tuple[str, tuple[int, ...], str, int, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyCount:
    window: str
    op: str
    group: tuple[int, ...]
    dtype: str
    bytes_per_call: int
    phase: str
    measured_calls: int
    predicted_calls: int
    source: str

    @property
    def ok(self) -> bool:
        return self.measured_calls == self.predicted_calls

    @property
    def label(self) -> str:
        return call_label(self.window, self.op, self.dtype, self.bytes_per_call, self.phase, self.group)


def call_label(window: str, op: str, dtype: str, nbytes: int, phase: str, group: tuple[int, ...]) -> str:
    """How a call key is shown wherever calls are counted (reconciliation, gate, baseline, compare)."""
    return f"calls [{window}] {op} {dtype} {nbytes} B {phase} group {group_text(group)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpBalance:
    """One op's bytes per measured step, whole job."""

    op: str
    measured_bytes: Fraction
    predicted_bytes: Fraction
    residuals: tuple[tuple[str, Fraction], ...]

    @property
    def unexplained_bytes(self) -> Fraction:
        return self.measured_bytes - self.predicted_bytes - sum((b for _, b in self.residuals), Fraction(0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconciliation:
    scenario: str
    keys: tuple[KeyCount, ...]
    ops: tuple[OpBalance, ...]
    traffic_measured: dict[tuple[int, int], Fraction]
    traffic_predicted: dict[tuple[int, int], Fraction]
    steps: int = 0
    """The measured steps the ``steps`` window's counts are over."""

    @property
    def mismatches(self) -> tuple[KeyCount, ...]:
        return tuple(k for k in self.keys if not k.ok)

    @property
    def ok(self) -> bool:
        return (
            not self.mismatches
            and all(o.unexplained_bytes == 0 for o in self.ops)
            and self.traffic_measured == self.traffic_predicted
        )


def _row_keys(row: ExpectedCollective, ran: frozenset[int]) -> list[tuple[Key, int]]:
    """(key, participants among the ranks that ran) for every process group instance of a predicted row
    that one of them issues."""
    p2p = OPS[row.op].p2p
    out = []
    for g in row.groups:
        n = int(g[0] in ran) if p2p else len(ran.intersection(g))
        if n:
            out.append(((str(row.op), tuple(g), row.dtype, row.bytes_per_call, str(row.phase)), n))
    return out


def measured_calls(capture: Capture) -> dict[str, Counter[Key]]:
    """The calls the ranks issued, counted by key, in initialisation (``init``) and in the measured steps
    (``steps``; the warm-up's are counted in neither)."""
    steps = range(capture.warmup_steps, capture.warmup_steps + capture.steps)
    measured: dict[str, Counter[Key]] = {"init": Counter(), "steps": Counter()}
    for c in capture.calls:
        which = "init" if c.step == INIT_STEP else ("steps" if c.step in steps else None)
        if which is None:
            continue
        group = (c.rank, c.peer) if c.peer is not None else c.rooted_group
        measured[which][(str(c.op), group, c.dtype, c.bytes, c.phase)] += 1
    return measured


def reconcile(prediction: Prediction, capture: Capture) -> Reconciliation:
    """Every rank's calls against the model's; for an emulated run (``capture.ranks``), the calls of the
    ranks that ran against the rows they issue, each call standing for its whole group's (the job seen from
    rank 0: the others hold the same by symmetry)."""
    ran = frozenset(capture.ran)
    steps = range(capture.warmup_steps, capture.warmup_steps + capture.steps)
    n_steps = max(len(steps), 1)
    windows: dict[str, range | None] = {"init": None, "steps": steps}
    measured = measured_calls(capture)

    keys: list[KeyCount] = []
    predicted_bytes: dict[str, Fraction] = defaultdict(Fraction)
    residuals: dict[str, list[tuple[str, Fraction]]] = defaultdict(list)
    traffic_predicted: dict[tuple[int, int], Fraction] = {}
    for name, window in windows.items():
        predicted: Counter[Key] = Counter()
        sources: dict[Key, str] = {}
        for row in prediction.collectives:
            calls = row.calls_in(window)
            if not calls:
                continue
            instances = _row_keys(row, ran)
            for key, participants in instances:
                predicted[key] += calls * participants
                sources.setdefault(key, row.source)
            if name == "steps" and instances:
                participants = sum(n for _, n in instances)
                job = Fraction(calls * row.bytes_per_call * participants, n_steps)
                if row.once:
                    residuals[str(row.op)].append((row.source, job))
                else:
                    predicted_bytes[str(row.op)] += job
                for (_op, g, *_), _n in instances:
                    add_traffic(
                        str(row.op),
                        tuple(g),
                        Fraction(calls) * row.bytes_per_call * row.bus_factor / n_steps,
                        traffic_predicted,
                    )
        for key in sorted(set(predicted) | set(measured[name]), key=str):
            op, group, dtype, nbytes, phase = key
            keys.append(
                KeyCount(
                    window=name,
                    op=op,
                    group=group,
                    dtype=dtype,
                    bytes_per_call=nbytes,
                    phase=phase,
                    measured_calls=measured[name][key],
                    predicted_calls=predicted[key],
                    source=sources.get(key, "not in the model"),
                )
            )

    measured_bytes: dict[str, Fraction] = defaultdict(Fraction)
    traffic_measured: dict[tuple[int, int], Fraction] = {}
    for (op, group, _dtype, nbytes, _phase), count in measured["steps"].items():
        measured_bytes[op] += Fraction(count * nbytes, n_steps)
        spec = OPS[Op(op)]
        group_calls = count if spec.p2p else Fraction(count, len(ran.intersection(group)))
        add_traffic(op, group, group_calls * nbytes * spec.bus(len(group)) / n_steps, traffic_measured)

    ops = tuple(
        OpBalance(
            op=op,
            measured_bytes=measured_bytes[op],
            predicted_bytes=predicted_bytes[op],
            residuals=tuple(residuals[op]),
        )
        for op in sorted(set(measured_bytes) | set(predicted_bytes) | set(residuals))
    )
    return Reconciliation(
        scenario=capture.scenario,
        keys=tuple(keys),
        ops=ops,
        traffic_measured={k: v for k, v in traffic_measured.items() if v},
        traffic_predicted={k: v for k, v in traffic_predicted.items() if v},
        steps=len(steps),
    )
