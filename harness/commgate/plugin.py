"""commgate's pytest plugin (the ``pytest11`` entry point): scenario files as tests.

It only adapts pytest to ``commgate.pipeline.run_scenario``: options (one group, ``--commgate-*``),
collection (one item per scenario, sweep variants included, with the scenario's markers), the item's
outcome from the result, and the session's report. torch and DeepSpeed are imported only when a scenario
runs. Under pytest-xdist each worker hands its results to the controller through ``workeroutput``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from commgate.model.scenario import Scenario
    from commgate.pipeline import Options
    from commgate.report.report import ScenarioResult
    from commgate.run.inject import Faults

MARKERS: dict[str, str] = {
    "gpu": "needs a GPU (NCCL/RCCL); skipped where none is present",
    "multinode": "starts several nodes (torchrun agents); slow",
    "slurm": "brings up a two-node Slurm cluster on this machine (ci/slurm-in-a-box.sh; root, Linux); slow",
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
        "--commgate-refresh-latency",
        action="store_true",
        help="with --commgate-update-baselines: rewrite unchanged baselines too, storing this run's latency samples",
    )
    group.addoption(
        "--commgate-baseline-dir", metavar="DIR", type=Path, help="where baselines live (default: <rootdir>/baselines)"
    )
    group.addoption("--commgate-report-dir", metavar="DIR", type=Path, help="write report.json and the HTML there")
    group.addoption(
        "--commgate-backend",
        choices=("auto", "gloo", "nccl"),
        help="run every scenario on this backend instead of the one it declares",
    )
    group.addoption("--commgate-deadline", metavar="S", type=float, help="per-scenario deadline in seconds")
    parser.addini(
        "commgate_scenario_dirs",
        type="linelist",
        default=["scenarios"],
        help="directories (relative to the rootdir) whose every .yaml/.yml file is a scenario; elsewhere a YAML "
        "file is one if it declares schema_version or is named on the command line. A scenario file that cannot "
        "be read or validated is a collection error.",
    )
    group.addoption(
        "--commgate-fault",
        metavar="FAULT",
        action="append",
        default=[],
        help="plant a fault to prove the gate: delay-first-recv[=MS], late-rank[=MS], extra-collective, "
        "ddp-bucket-mb=MB, zero-stage=N",
    )


@dataclass
class _Session:
    options: Options
    faults: Faults
    scenarios: list[dict[str, Any]] = field(default_factory=list)
    """Report documents of the scenarios run (by this process, or by the xdist workers)."""
    updated: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    """Baseline files the scenarios were judged against."""
    html: Path | None = None

    def record(self, result: ScenarioResult) -> None:
        s = result.prediction.scenario
        self.scenarios.append(result.document())
        if result.baseline is not None:
            self.used.add(str(result.baseline.resolve()))
        if result.baseline_written:
            self.updated.append(f"{s.id}: {result.baseline_written}")
        self.warnings += [f"{s.id}: {f.text()}" for f in result.findings if not f.fail]

    def merge(self, part: dict[str, Any]) -> None:
        self.scenarios += part["scenarios"]
        self.updated += part["updated"]
        self.warnings += part["warnings"]
        self.used.update(part["used"])


SESSION = pytest.StashKey[_Session]()


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    update = config.getoption("commgate_update_baselines", False)
    if update and config.getoption("commgate_fault", []):
        raise pytest.UsageError(
            "--commgate-update-baselines with --commgate-fault would store a faulty run as the baseline; use one"
        )
    if config.getoption("commgate_refresh_latency", False) and not update:
        raise pytest.UsageError("--commgate-refresh-latency works with --commgate-update-baselines; add it")
    deadline = config.getoption("commgate_deadline", None)
    if deadline is not None and deadline <= 0:
        raise pytest.UsageError(f"--commgate-deadline {deadline:g}: expected a positive number of seconds")
    from commgate.core.errors import UsageError
    from commgate.pipeline import Options
    from commgate.run.inject import parse

    try:
        faults = parse(config.getoption("commgate_fault", []))
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    options = Options(
        baseline_dir=config.getoption("commgate_baseline_dir", None) or config.rootpath / "baselines",
        update_baselines=update,
        refresh_latency=config.getoption("commgate_refresh_latency", False),
        backend=config.getoption("commgate_backend", None),
    )
    config.stash[SESSION] = _Session(options=options, faults=faults)


_DECLARES = re.compile(r"""^[\s{"']*schema_version\b""", re.MULTILINE)


def _is_scenario(path: Path, parent: pytest.Collector) -> bool:
    """Which YAML files are scenarios (never a silent pass: such a file that cannot be read or validated
    fails collection): every one under the ``commgate_scenario_dirs`` ini option (default ``scenarios``),
    every one named on the command line, and any other that declares ``schema_version`` (read as UTF-8,
    or as UTF-16/32 when it starts with their byte-order mark)."""
    config = parent.config
    if parent.session.isinitpath(path):
        return True
    here = path.resolve()
    if any(here.is_relative_to((config.rootpath / d).resolve()) for d in config.getini("commgate_scenario_dirs")):
        return True
    try:
        with path.open("rb") as f:
            head = f.read(1 << 20)
    except OSError:
        return False
    for bom, codec in (
        (b"\xff\xfe\x00\x00", "utf-32"),
        (b"\x00\x00\xfe\xff", "utf-32"),
        (b"\xff\xfe", "utf-16"),
        (b"\xfe\xff", "utf-16"),
    ):
        if head.startswith(bom):
            return bool(_DECLARES.search(head.decode(codec, errors="replace")))
    return bool(_DECLARES.search(head.decode("utf-8", errors="replace").lstrip("\ufeff")))


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix in (".yaml", ".yml") and _is_scenario(file_path, parent):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self) -> Iterator[ScenarioItem]:
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
    """A scenario failed or errored; the message is its reason (shown by ``ScenarioItem.repr_failure``)."""


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario: Scenario, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario

    def runtest(self) -> None:
        from commgate.pipeline import run_scenario
        from commgate.run.runners import LocalRanks

        state = self.config.stash[SESSION]
        runner = LocalRanks(deadline_s=self.config.getoption("commgate_deadline"), faults=state.faults)
        result = run_scenario(self.scenario, runner, state.options)
        assert result is not None  # local ranks always report
        state.record(result)
        if result.status == "skipped":
            pytest.skip(result.reason)
        if warnings := [f.text() for f in result.findings if not f.fail]:
            self.add_report_section("call", "commgate warnings", "\n".join(warnings))
        if result.status in ("failed", "error"):
            planted = f"(planted fault: {state.faults.describe()})\n" if state.faults else ""
            raise GateFailure(planted + result.reason)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, GateFailure):
            return f"{self.scenario.id}: {excinfo.value}"
        from commgate.core.errors import CommgateError

        if isinstance(excinfo.value, CommgateError):  # a malformed baseline, a bad option: one line
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"scenario {self.scenario.id}"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist, on the controller: a worker's results (``pytest_sessionfinish`` put them there)."""
    state = node.config.stash.get(SESSION, None)
    part = getattr(node, "workeroutput", {}).get("commgate")
    if state is not None and part:
        state.merge(part)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its results to the controller; the controller (or a plain run) writes the report."""
    config = session.config
    state = config.stash.get(SESSION, None)
    if state is None:
        return
    if hasattr(config, "workeroutput"):
        config.workeroutput["commgate"] = {
            "scenarios": state.scenarios,
            "updated": state.updated,
            "warnings": state.warnings,
            "used": sorted(state.used),
        }
        return
    out = config.getoption("commgate_report_dir", None)
    if out is None or not state.scenarios:
        return
    from commgate.report import htmlreport
    from commgate.report.report import Report

    report = Report(Path(out) / "report.json", sorted(state.scenarios, key=lambda s: str(s["name"])))
    report.write()
    state.html = htmlreport.write(Path(out), report.document())


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(SESSION, None)
    if state is None or hasattr(config, "workeroutput"):
        return
    if state.html is not None:
        terminalreporter.write_line(f"commgate report: {state.html}")
    for title, lines in (("commgate baselines", state.updated), ("commgate warnings", state.warnings)):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
    whole = all(Path(a).is_dir() for a in config.args)  # no file or node id selected
    if state.used and whole and not config.getoption("keyword") and not config.getoption("markexpr"):
        from commgate.judge.store import BaselineStore

        unused = BaselineStore(state.options.baseline_dir).unused(state.used)
        if unused:
            terminalreporter.section("commgate: baselines no scenario used")
            for p in unused:
                terminalreporter.write_line(str(p))
