"""The run report: ``report.json`` with, per scenario, its status, the reconciliation per collective
type, the traffic matrices, the prediction and the raw per-call capture. Rewritten atomically after
every scenario, so an interrupted suite leaves a complete report of what ran. Each scenario is encoded
once, on a line of its own, so a rewrite costs the file's I/O, not its encoding again."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from commgate.core import schemas
from commgate.core.fsutil import atomic_write_text, dumps
from commgate.core.provenance import environment
from commgate.core.units import human_bytes, number, shown
from commgate.judge.causes import Cause
from commgate.judge.drift import cold_starts
from commgate.judge.finding import Finding
from commgate.judge.reconcile import Reconciliation
from commgate.model.expectation import Prediction
from commgate.model.scenario import Scenario
from commgate.model.trainers import derived
from commgate.report.render import prediction_document
from commgate.report.timemodel import TimeAssessment
from commgate.run.capture import Capture

REPORT_VERSION = 1
Status = Literal["passed", "failed", "error", "skipped", "unjudged"]


def schema() -> dict[str, Any]:
    """The published report JSON Schema (draft 2020-12); its scenarios' ``capture`` is the capture schema."""
    return schemas.load("report")


def validate(doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid report document."""
    schemas.validate("report", doc)


def _matrix(m: dict[tuple[int, int], Fraction]) -> list[dict[str, Any]]:
    return [{"src": s, "dst": d, "bytes_per_step": number(b)} for (s, d), b in sorted(m.items())]


def scheme(s: Scenario) -> str:
    """The scheme a result names: none where no scenario describes the job (its model is a stand-in)."""
    return s.parallelism.scheme if s.expectations.model_known else "no scenario"


@dataclass(frozen=True, kw_only=True)
class ScenarioResult:
    """What became of one scenario (``commgate.pipeline.run_scenario``), whichever entry point ran it."""

    prediction: Prediction
    status: Status
    reason: str = ""
    """Why it failed (its failing findings), errored or was skipped; empty when it passed."""
    findings: tuple[Finding, ...] = ()
    """The gate's findings, warnings included."""
    baseline: Path | None = None
    """The baseline file it was judged against (or wrote)."""
    baseline_written: str | None = None
    """A line saying what was written to the baseline, if anything."""
    latency_note: str = ""
    """How latency was judged against the stored runs, or why it was not."""
    wall_s: float = 0.0
    capture: Capture | None = None
    reconciliation: Reconciliation | None = None
    time_model: TimeAssessment | None = None

    def document(self) -> dict[str, Any]:
        s = self.prediction.scenario
        doc: dict[str, Any] = {
            "name": s.id,
            "scheme": scheme(s),
            "world_size": s.world_size,
            "status": self.status,
            "reason": self.reason,
            "findings": [f.to_json() for f in self.findings],
            "wall_s": round(self.wall_s, 3),
            "latency_note": self.latency_note,
            "model_checked": s.expectations.model_check and s.expectations.model_known,
            "prediction": prediction_document(self.prediction),
        }
        r = self.reconciliation
        if r is not None and s.expectations.model_known:  # else against a stand-in: the capture alone says it
            doc["collectives"] = [
                {
                    "op": o.op,
                    "measured_bytes": number(o.measured_bytes),
                    "predicted_bytes": number(o.predicted_bytes),
                    "residuals": [{"name": n, "bytes": number(b)} for n, b in o.residuals],
                    "unexplained_bytes": number(o.unexplained_bytes),
                }
                for o in r.ops
            ]
            doc["calls"] = [asdict(k) | {"ok": k.ok} for k in r.keys]
            doc["traffic_matrix"] = {"measured": _matrix(r.traffic_measured), "predicted": _matrix(r.traffic_predicted)}
        if self.time_model is not None:
            doc["time_model"] = self.time_model.document()
            p, m = self.time_model.predicted, self.time_model.measured
            doc["comm_fraction"] = {
                "predicted": p.in_flight_fraction if p else None,
                "measured": m.comm_fraction if m else None,
            }
        if self.capture is not None:
            doc["capture"] = self.capture.to_json()
            doc["cold_starts"] = [asdict(c) for c in cold_starts(self.capture, s.expectations.cold_start)]
        return doc

    def summary(self) -> str:
        """What the console shows of the result: the head line, then per op the bytes measured (and
        predicted, when the model is checked), the model's mismatches and the other findings."""
        head, view = self._head()
        r = self.reconciliation
        if r is None:
            return f"{head}: {self.reason}" if self.reason else head
        lines = [head]
        if not self.prediction.scenario.expectations.model_check:  # the ops the job issued, not the model's
            issued = {k.op for k in r.keys if k.measured_calls}
            lines += [
                f"    {o.op:<15} measured {human_bytes(o.measured_bytes):>11}/step ({view})"
                for o in r.ops
                if o.op in issued
            ]
            lines += [f"    {line}" for f in self.findings for line in f.text().splitlines()]
            return "\n".join(lines)
        causes = [c for f in self.findings if f.kind == "model" and f.fail for c in f.causes]
        lines += self._model_lines(r, view, causes)
        s = self.prediction.scenario
        lines += [f"    {s.trainer}: {line}" for line in derived(s)]  # what the trainer resolved, never silent
        for f in self.findings:
            if not (f.kind == "model" and f.fail):  # the model's differences are the lines above
                lines += [f"    {line}" for line in f.text().splitlines()]
        lines += [f"    {note}" for note in (self.latency_note, self.baseline_written) if note]
        lines += self._unjudged_cold_starts()
        return "\n".join(lines)

    def _unjudged_cold_starts(self) -> list[str]:
        """The spikes the report's pages mark, when the gate did not judge them (``commgate run`` without
        ``--gate``): said on the console too, never only in the HTML."""
        if self.capture is None or self.capture.ranks is not None or any(f.kind == "cold-start" for f in self.findings):
            return []
        spikes = cold_starts(self.capture, self.prediction.scenario.expectations.cold_start)
        if not spikes:
            return []
        more = f" (and {len(spikes) - 1} more in the report)" if len(spikes) > 1 else ""
        return [f"    not judged (run with --gate to judge): {spikes[0].text()}{more}"]

    def _head(self) -> tuple[str, str]:
        """The summary's first line (status, id, scheme, ranks, times, comm fraction), and whose view the
        measured bytes are (all ranks, or those an emulated run started)."""
        s = self.prediction.scenario
        started = self.capture.ranks if self.capture is not None else None
        ranks, view = f"{s.world_size} ranks", "all ranks"
        if started is not None:  # an emulated run (commgate.run.emulate)
            who = "rank 0" if started == (0,) else "ranks " + ", ".join(map(str, started))
            ranks, view = (
                f"{ranks}, {who} run, the others emulated",
                f"{who}'s view" if started == (0,) else "their view",
            )
        head = f"{self.status.upper():7} {s.id} ({scheme(s)}, {ranks}, {self.wall_s:.1f} s)"
        t = self.capture.timeline if self.capture is not None else {}
        if "steps" in t and "build" in t:
            head += f" [build {t['build']:.1f} s, steps {t['steps']:.1f} s]"
        tm = self.time_model
        if tm is not None and tm.measured is not None:
            pred = f"{tm.predicted.in_flight_fraction:.0%}" if tm.predicted else f"-: {tm.note}"
            if tm.domain:  # "out of the model's domain: 4 ranks on 2 cores"
                pred += f"; {tm.domain.replace('out of the model', 'outside the model')}"
            head += f" comm fraction {tm.measured.comm_fraction:.0%} (model {pred})"
        return head, view

    @staticmethod
    def _model_lines(r: Reconciliation, view: str, causes: Sequence[Cause] = ()) -> list[str]:
        """Per op measured, predicted and unexplained bytes, then what the differing counts mean in words
        (``causes``), then the first call counts that differ."""
        lines = []
        for o in r.ops:
            extra = f" + {human_bytes(sum((b for _, b in o.residuals), Fraction(0)))} named" if o.residuals else ""
            lines.append(
                f"    {o.op:<15} measured {human_bytes(o.measured_bytes):>11}/step ({view})  predicted "
                f"{human_bytes(o.predicted_bytes):>11}{extra}  unexplained {shown(o.unexplained_bytes)} B"
            )
        lines += [f"    {c.text}" for c in causes]
        for k in r.mismatches[:10]:
            lines.append(f"    {k.label}: measured {k.measured_calls}, predicted {k.predicted_calls} ({k.source})")
        if len(r.mismatches) > 10:
            lines.append(f"    ... and {len(r.mismatches) - 10} more mismatches (see report.json)")
        if r.traffic_measured != r.traffic_predicted:
            lines.append("    traffic matrix differs from the prediction (see report.json)")
        return lines


STATUSES: tuple[Status, ...] = ("passed", "failed", "error", "skipped", "unjudged")
"""unjudged: it ran, and nothing judged it (a baseline-only scenario under ``commgate run`` without ``--gate``)."""


@dataclass
class Report:
    """report.json: every scenario's document, in the order they finished (rewritten after each one)."""

    path: Path | None
    scenarios: list[dict[str, Any]] = field(default_factory=list)
    """Scenario documents (``ScenarioResult.document()``); from other processes too (pytest-xdist workers)."""
    started: float = field(default_factory=time.time)
    interrupted: str | None = None
    """Why the run stopped before its end (``Session.interrupt``); None when it finished."""
    _encoded: list[str] = field(default_factory=list, init=False, repr=False)
    """``scenarios[i]`` as compact JSON, encoded once (``scenarios`` is only ever appended to)."""

    def add(self, result: ScenarioResult) -> None:
        self.scenarios.append(result.document())
        self.write()

    def document(self) -> dict[str, Any]:
        doc = {
            "schema_version": REPORT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "environment": environment(),
            "summary": {k: sum(1 for s in self.scenarios if s["status"] == k) for k in STATUSES},
            "scenarios": self.scenarios,
        }
        return doc if self.interrupted is None else doc | {"interrupted": self.interrupted}

    def text(self) -> str:
        """The JSON text of ``document()``: its head indented, each scenario compact on a line of its own.
        A scenario is encoded the first time it is written: rewriting the report after every scenario would
        otherwise encode the whole growing document each time (100 scenarios of raw capture: 87 s)."""
        self._encoded += [json.dumps(s, sort_keys=True) for s in self.scenarios[len(self._encoded) :]]
        head = self.document()
        head["scenarios"] = _SLOT
        items = ",\n".join(self._encoded)
        return dumps(head).replace(json.dumps(_SLOT), f"[\n{items}\n  ]" if items else "[]", 1)

    def write(self) -> None:
        if self.path is not None:
            atomic_write_text(self.path, self.text())


_SLOT = "\x00scenarios\x00"
"""Where the encoded scenarios go in the head's text (encoded as ``"\\u0000scenarios\\u0000"``, which no
other value of the head can spell)."""


def ran(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenarios of a report document that ran (those with a reconciliation)."""
    return [s for s in doc["scenarios"] if "collectives" in s]


def modelled(op_row: dict[str, Any]) -> float:
    """The model's bytes per step for one op of a report: its steady rows plus the named once-per-run
    terms the reconciliation attributes to the measured steps (e.g. DDP's bucket-rebuild broadcast)."""
    return float(op_row["predicted_bytes"]) + sum(float(r["bytes"]) for r in op_row["residuals"])
