"""``commgate.pipeline.run_scenario`` owns a scenario's life: every result carries its status, findings
and reason, whichever runner produced it (no ranks are started here: the runners are stand-ins)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from commgate.model.loader import load_text
from commgate.model.scenario import Scenario
from commgate.pipeline import Options, run_scenario
from commgate.run.capture import Capture
from commgate.run.launcher import RunError

TEXT = "schema_version: 1\nname: p\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"


def scenario() -> Scenario:
    (s,) = load_text(TEXT)
    return s


@dataclass
class Stub:
    skip: str | None = None
    error: str | None = None
    capture: Capture | None = None
    ran: int = 0

    def skip_reason(self, scenario: Scenario) -> str | None:
        return self.skip

    def run(self, scenario: Scenario) -> Capture | None:
        self.ran += 1
        if self.error:
            raise RunError(self.error)
        return self.capture


def silent(s: Scenario) -> Capture:
    """A run in which no rank sent anything."""
    return Capture(scenario=s.id, world_size=2, warmup_steps=s.warmup_steps, steps=s.steps, backend="gloo", calls=())


def test_a_skipped_scenario_is_not_run_and_says_why(tmp_path: Path) -> None:
    runner = Stub(skip="needs GPUs")
    r = run_scenario(scenario(), runner, Options(baseline_dir=tmp_path))
    assert r is not None and (r.status, r.reason, r.findings, runner.ran) == ("skipped", "needs GPUs", (), 0)
    assert r.document()["reason"] == "needs GPUs"


def test_a_failed_run_is_an_error_with_the_runners_reason(tmp_path: Path) -> None:
    r = run_scenario(scenario(), Stub(error="rank 1 raised"), Options(baseline_dir=tmp_path))
    assert r is not None and (r.status, r.reason) == ("error", "rank 1 raised")


def test_a_failing_scenario_carries_its_findings_and_reason_in_every_output(tmp_path: Path) -> None:
    s = scenario()
    for gate in (True, False):  # the pytest gate, and `commgate run` without --gate
        r = run_scenario(s, Stub(capture=silent(s)), Options(baseline_dir=tmp_path, gate=gate))
        assert r is not None and r.status == "failed"
        kinds = [f.kind for f in r.findings if f.fail]
        assert "model" in kinds and r.reason.startswith("[model] ")
        doc = r.document()
        assert doc["reason"] == r.reason and {f["kind"] for f in doc["findings"]} >= {"model"}
        assert "[model]" not in r.summary().splitlines()[0]
    assert not list(tmp_path.rglob("*.json"))  # a run that fails the model is never stored as a baseline


def test_a_torchrun_rank_that_does_not_report_gets_no_result(tmp_path: Path) -> None:
    assert run_scenario(scenario(), Stub(capture=None), Options(baseline_dir=tmp_path)) is None


def test_the_backend_override_reaches_the_runner(tmp_path: Path) -> None:
    seen: list[str] = []

    class Spy(Stub):
        def skip_reason(self, scenario: Scenario) -> str | None:
            seen.append(scenario.backend)
            return "stop"

    run_scenario(scenario(), Spy(), Options(baseline_dir=tmp_path, backend="gloo"))
    assert seen == ["gloo"]


def test_baseline_only_mode_says_the_model_was_not_checked(tmp_path: Path) -> None:
    (s,) = load_text(TEXT + "expectations: {model: {check: false}}\n")
    for gate in (True, False):
        r = run_scenario(s, Stub(capture=silent(s)), Options(baseline_dir=tmp_path / str(gate), gate=gate))
        assert r is not None and not any(f.fail and f.kind in ("model", "paper") for f in r.findings)
        assert any("the model was not checked" in f.title for f in r.findings)
        assert "the model was not checked" in r.summary()
        assert "unexplained" not in r.summary()
        # without --gate nothing judges it: not "passed" (issue: a status says what was checked)
        assert (r.status == "unjudged") == (not gate), r.status
    # under the gate, the first run writes the baseline (and fails on that alone, as every first run does)
    assert (tmp_path / "True" / "gloo" / "p.json").exists()


def test_a_run_nothing_judged_is_unjudged_in_the_report_and_the_summary(tmp_path: Path) -> None:
    """commgate run without --gate of a baseline-only scenario: the status is 'unjudged', the reason names the
    flag that judges it, and report.json (valid against its schema) counts it apart from 'passed'."""
    from commgate.core import schemas
    from commgate.report.report import Report

    (s,) = load_text(TEXT + "expectations: {model: {check: false}}\n")
    r = run_scenario(s, Stub(capture=silent(s)), Options(baseline_dir=tmp_path, gate=False))
    assert r is not None and r.status == "unjudged" and "add --gate" in r.reason
    assert r.summary().startswith("UNJUDGED")
    report = Report(tmp_path / "out" / "report.json")
    report.add(r)
    doc = json.loads((tmp_path / "out" / "report.json").read_text())  # as written
    schemas.validate("report", doc)
    assert (doc["summary"]["passed"], doc["summary"]["unjudged"]) == (0, 1)
