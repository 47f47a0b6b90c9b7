"""commgate's pytest plugin (registered through the ``pytest11`` entry point): scenario files as tests.

``pytest scenarios/`` collects every scenario YAML file (a mapping with ``schema_version`` and
``parallelism``) as one item per scenario, sweep variants included, with the scenario's markers. An
item runs the scenario on local ranks (or skips with the reason), then applies ``commgate.judge.gate``: the
model, the paper, the stored baseline (``baselines/{backend}/{id}.json``), and the drift checks.
Options live in one group, ``--commgate-*``. The plugin is thin: the work is in ``commgate.judge.gate``,
``commgate.judge.baseline`` and the launcher; torch and DeepSpeed are imported only when a scenario runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from commgate.core.fsutil import atomic_write_json

MARKERS: dict[str, str] = {
    "gpu": "needs a GPU (NCCL/RCCL); skipped where none is present",
    "multinode": "starts several nodes (torchrun agents); slow",
    "slow": "takes more than a few seconds",
    "nightly": "part of the nightly cluster run, not of pull-request gating",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("commgate", "commgate: communication regression gate for scenario files")
    group.addoption(
        "--commgate-update-baselines",
        action="store_true",
        help="write the baselines of the scenarios run (missing or changed ones), and report what changed",
    )
    group.addoption(
        "--commgate-baseline-dir", metavar="DIR", type=Path, help="where baselines live (default: <rootdir>/baselines)"
    )
    group.addoption("--commgate-report-dir", metavar="DIR", type=Path, help="write report.json there")
    group.addoption(
        "--commgate-backend",
        choices=("auto", "gloo", "nccl"),
        help="run every scenario on this backend instead of the one it declares",
    )
    group.addoption("--commgate-deadline", metavar="S", type=float, help="per-scenario deadline in seconds")
    group.addoption(
        "--commgate-fault",
        metavar="FAULT",
        action="append",
        default=[],
        help="plant a fault to prove the gate: delay-first-recv[=MS], extra-collective, ddp-bucket-mb=MB, zero-stage=N",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    if config.getoption("commgate_update_baselines", False) and config.getoption("commgate_fault", []):
        raise pytest.UsageError(
            "--commgate-update-baselines with --commgate-fault would store a faulty run as the baseline; use one"
        )
    deadline = config.getoption("commgate_deadline", None)
    if deadline is not None and deadline <= 0:
        raise pytest.UsageError(f"--commgate-deadline {deadline:g}: expected a positive number of seconds")
    from commgate.core.errors import UsageError
    from commgate.run.inject import parse

    try:
        config.stash[FAULTS] = parse(config.getoption("commgate_fault", []))
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION] = _Session()


def _is_scenario(path: Path) -> bool:
    """A YAML file whose top level names ``schema_version`` and ``parallelism`` (cheap: no YAML parse)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    lines = [line.split(":", 1)[0] for line in text.splitlines() if line and not line[0].isspace()]
    return "schema_version" in lines and "parallelism" in lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix in (".yaml", ".yml") and _is_scenario(file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self) -> Any:
        from commgate.core.errors import ScenarioError
        from commgate.model.scenario import load_paths

        try:
            scenarios = load_paths([self.path])
        except ScenarioError as exc:
            raise self.CollectError(str(exc)) from None
        for s in scenarios:
            item = ScenarioItem.from_parent(self, name=s.id, scenario=s)
            for m in s.markers:
                item.add_marker(m)
            yield item


class GateFailure(Exception):
    """The gate's findings for one scenario (shown by ``ScenarioItem.repr_failure``)."""


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario

    def runtest(self) -> None:
        from dataclasses import replace

        from commgate.judge.gate import judge
        from commgate.judge.reconcile import reconcile
        from commgate.model.expectation import predict
        from commgate.report.report import ScenarioResult
        from commgate.report.timemodel import assess
        from commgate.run.launcher import RunError, gpu_visible, launch_local
        from commgate.run.workloads import skip_reason

        config = self.config
        s = self.scenario
        backend = config.getoption("commgate_backend")
        if backend:
            s = replace(s, backend=backend)
        if reason := skip_reason(s, gpus=gpu_visible()):
            pytest.skip(reason)
        prediction = predict(s)
        session: _Session = config.stash[SESSION]
        try:
            capture = launch_local(s, deadline_s=config.getoption("commgate_deadline"), faults=config.stash[FAULTS])
        except RunError as exc:
            session.results.append(ScenarioResult(prediction=prediction, status="error", reason=str(exc)))
            raise GateFailure(str(exc)) from None
        rec = reconcile(prediction, capture)
        root = config.getoption("commgate_baseline_dir") or config.rootpath / "baselines"
        j = judge(s, prediction, capture, rec, root, update=config.getoption("commgate_update_baselines"))
        session.used.add(j.baseline.resolve())
        if j.written:
            session.updated.append(f"{s.id}: {j.written}")
        fail = [f for f in j.findings if f.fail]
        warn = [f for f in j.findings if not f.fail]
        session.results.append(
            ScenarioResult(
                prediction=prediction,
                status="failed" if fail else "passed",
                capture=capture,
                reconciliation=rec,
                time_model=assess(prediction, capture, root),
            )
        )
        if warn:
            text = "\n".join(f.text() for f in warn)
            self.add_report_section("call", "commgate warnings", text)
            session.warnings.append(f"{s.id}: " + text)
        if fail:
            faults = config.stash[FAULTS]
            planted = f"(planted fault: {faults.describe()})\n" if faults else ""
            raise GateFailure(planted + "\n".join(f.text() for f in fail))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, GateFailure):
            return f"{self.scenario.id}: {excinfo.value}"
        from commgate.core.errors import CommgateError

        if isinstance(excinfo.value, CommgateError):  # a malformed baseline, a bad option: one line
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"scenario {self.scenario.id}"


class _Session:
    def __init__(self) -> None:
        self.results: list[Any] = []
        self.updated: list[str] = []
        self.warnings: list[str] = []
        self.used: set[Path] = set()
        self.html: Path | None = None


SESSION = pytest.StashKey[_Session]()
FAULTS = pytest.StashKey[Any]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write report.json and the HTML page. Under xdist each worker writes report-gwN.json and the
    controller, which runs no scenario, merges them into report.json and the page."""
    state = session.config.stash.get(SESSION, None)
    out = session.config.getoption("commgate_report_dir", None)
    if state is None or out is None:
        return
    from commgate.report import htmlreport
    from commgate.report.report import Report, merge_documents

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        if state.results:
            Report(Path(out) / f"report-{worker}.json", list(state.results)).write()
        return
    if state.results:
        report = Report(Path(out) / "report.json", list(state.results))
        report.write()
        doc = report.document()
    else:
        parts = sorted(Path(out).glob("report-gw*.json"))
        if not parts:
            return
        doc = merge_documents([json.loads(p.read_text()) for p in parts])
        atomic_write_json(Path(out) / "report.json", doc)
    state.html = htmlreport.write(Path(out), doc)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(SESSION, None)
    if state is None:
        return
    if state.html is not None:
        terminalreporter.write_line(f"commgate report: {state.html}")
    if state.updated:
        terminalreporter.section("commgate baselines")
        for line in state.updated:
            terminalreporter.write_line(line)
    if state.warnings:
        terminalreporter.section("commgate warnings")
        for line in state.warnings:
            terminalreporter.write_line(line)
    if state.used and not os.environ.get("PYTEST_XDIST_WORKER"):
        root = config.getoption("commgate_baseline_dir") or config.rootpath / "baselines"
        unused = sorted(p for p in Path(root).glob("*/*.json") if p.resolve() not in state.used)
        whole = all(Path(a).is_dir() for a in config.args)  # no file or node id selected
        if unused and whole and not config.getoption("keyword") and not config.getoption("markexpr"):
            terminalreporter.section("commgate: baselines no scenario used")
            for p in unused:
                terminalreporter.write_line(str(p))
