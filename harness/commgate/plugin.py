"""commgate's pytest plugin (the ``pytest11`` entry point): scenario files as tests. It only adapts pytest
to a ``commgate.session.Session``: options (one group, ``--commgate-*``), collection (one item per scenario,
sweep variants included, with its markers), the item's outcome, the session's end. torch and DeepSpeed
are imported only when a scenario runs."""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from commgate.model.scenario import Scenario
    from commgate.session import Session

MARKERS: dict[str, str] = {
    "gpu": "needs a GPU (NCCL/RCCL); skipped where none is present",
    "multinode": "starts several nodes (torchrun agents); slow",
    "slurm": "brings up a two-node Slurm cluster on this machine (ci/slurm-in-a-box.sh; root, Linux); slow",
    "slow": "takes more than a few seconds",
    "nightly": "part of the nightly cluster run, not of pull-request gating",
}
OPTIONS: dict[str, dict[str, Any]] = {
    "update-baselines": {"action": "store_true", "help": "write the baselines of the scenarios run (missing or "
                         "changed ones), and report what changed"},
    "refresh-latency": {"action": "store_true", "help": "with --commgate-update-baselines: rewrite unchanged "
                        "baselines too, storing this run's latency samples"},
    "baseline-dir": {"metavar": "DIR", "type": Path, "help": "where baselines live (default: <rootdir>/baselines)"},
    "report-dir": {"metavar": "DIR", "type": Path, "help": "write report.json and the HTML there"},
    "backend": {"choices": ("auto", "gloo", "nccl"), "help": "run every scenario on this backend instead of the one "
                "it declares"},
    "deadline": {"metavar": "S", "type": float, "help": "per-scenario deadline in seconds"},
    "fault": {"metavar": "FAULT", "action": "append", "default": [], "help": "plant a fault to prove the gate: "
              "delay-first-recv[=MS], late-rank[=MS], extra-collective, ddp-bucket-mb=MB, zero-stage=N"},
}  # fmt: skip
SESSION: pytest.StashKey[Session] = pytest.StashKey()
IDS: pytest.StashKey[dict[str, str | None]] = pytest.StashKey()
"""The scenario ids collected so far, with their files."""
NOT_SCENARIOS: pytest.StashKey[list[str]] = pytest.StashKey()
"""``<file>: <rule>`` of each YAML file under a directory named on the command line that is not collected."""
UNWRITTEN: pytest.StashKey[str] = pytest.StashKey()
"""Why the report could not be written at the session's end (shown in the terminal summary)."""
SIGTERM: pytest.StashKey[Any] = pytest.StashKey()
"""The SIGTERM handler the plugin replaced (restored at the end)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("commgate", "commgate: communication regression gate for scenario files")
    for name, kwargs in OPTIONS.items():
        group.addoption(f"--commgate-{name}", **kwargs)
    parser.addini("commgate_scenario_dirs", type="linelist", default=["scenarios"], help="directories (relative to "
                  "the rootdir) whose every .yaml/.yml file is a scenario; elsewhere a YAML file is one if it declares "
                  "schema_version or is named on the command line. A scenario file that cannot be read or validated "
                  "is a collection error.")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    from commgate.session import Session

    config.stash[SESSION] = Session.for_pytest(config)
    config.pluginmanager.register(_OnInterrupt(config.stash[SESSION]), "commgate-interrupt")
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        # a CI runner's cancel unwinds as Ctrl-C does: ranks killed, report.json kept and marked interrupted
        config.stash[SIGTERM] = signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def pytest_unconfigure(config: pytest.Config) -> None:
    if (previous := config.stash.get(SIGTERM, None)) is not None:
        signal.signal(signal.SIGTERM, previous)


class _OnInterrupt:
    """Ctrl-C or SIGTERM: the session's report says so (pytest then ends the session: report.json kept)."""

    def __init__(self, state: Session) -> None:
        self.state = state

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.state.interrupt(f"{str(excinfo.value) or 'Ctrl-C'} during the session")


_DECLARES = re.compile(r"""^[\s{"']*schema_version\b""", re.MULTILINE)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """YAML files that are scenarios (never a silent pass: such a file that cannot be read or validated
    fails collection): every one under the ``commgate_scenario_dirs`` ini option (default ``scenarios``),
    every one named on the command line, and any other that declares ``schema_version`` (``text_head``)."""
    if file_path.suffix not in (".yaml", ".yml"):
        return None
    from commgate.core.fsutil import text_head

    config = parent.config
    dirs = [(config.rootpath / d).resolve() for d in config.getini("commgate_scenario_dirs")]
    named = parent.session.isinitpath(file_path) or any(file_path.resolve().is_relative_to(d) for d in dirs)
    if named or _DECLARES.search(text_head(file_path, 1 << 20) or ""):
        return ScenarioFile.from_parent(parent, path=file_path)
    if config.args_source == pytest.Config.ArgsSource.ARGS and _under_args(config, file_path):
        from commgate.model.loader import not_a_scenario

        if (rule := not_a_scenario(file_path)) is None:  # it may be one, in a directory the user named: load it
            return ScenarioFile.from_parent(parent, path=file_path)
        config.stash.setdefault(NOT_SCENARIOS, []).append(f"{file_path}: {rule}")
    return None


def _under_args(config: pytest.Config, path: Path) -> bool:
    """Whether ``path`` is under a directory named on the command line."""
    named = (Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args)
    return any(d.is_dir() and path.resolve().is_relative_to(d) for d in named)


class ScenarioFile(pytest.File):
    def collect(self) -> Iterator[ScenarioItem]:
        from commgate.core.errors import ScenarioError
        from commgate.model.loader import duplicate_ids, load_paths

        try:
            scenarios = load_paths([self.path])
            if twins := duplicate_ids(scenarios, self.config.stash.setdefault(IDS, {})):  # as validate refuses them
                raise ScenarioError(twins)
        except ScenarioError as exc:
            raise self.CollectError(str(exc)) from None
        for s in scenarios:
            item = ScenarioItem.from_parent(self, name=s.id, scenario=s)
            for m in s.markers:
                item.add_marker(m)
            yield item


class GateFailure(Exception):
    """A scenario failed or errored; the message says why (shown by ``ScenarioItem.repr_failure``)."""


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario: Scenario, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario

    def runtest(self) -> None:
        result = self.config.stash[SESSION].run(self.scenario)
        assert result is not None  # local ranks always report
        if result.status == "skipped":
            pytest.skip(result.reason)
        if warnings := [f.text() for f in result.findings if not f.fail]:
            self.add_report_section("call", "commgate warnings", "\n".join(warnings))
        if result.status in ("failed", "error"):
            raise GateFailure(self.config.stash[SESSION].failure(result))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        from commgate.core.errors import CommgateError

        if isinstance(excinfo.value, (GateFailure, CommgateError)):  # a malformed baseline: one line too
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"scenario {self.scenario.id}"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist, on the controller: a worker's results (its ``pytest_sessionfinish`` put them there)."""
    if (state := node.config.stash.get(SESSION, None)) and (part := getattr(node, "workeroutput", {}).get("commgate")):
        state.merge(part)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its results to the controller; the controller (or a plain run) writes the report."""
    if (state := session.config.stash.get(SESSION, None)) is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["commgate"] = state.part()
    elif state is not None:
        from commgate.core.errors import CommgateError

        try:
            state.finish()
        except CommgateError as exc:  # e.g. the report directory filled up or was taken away: one line, exit 1
            session.config.stash[UNWRITTEN] = str(exc)
            session.exitstatus = max(int(session.exitstatus), int(pytest.ExitCode.TESTS_FAILED))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if (state := config.stash.get(SESSION, None)) is None or hasattr(config, "workeroutput"):
        return
    if state.html is not None:
        terminalreporter.write_line(f"commgate report: {state.html}")
    if skipped := config.stash.get(NOT_SCENARIOS, None):
        terminalreporter.section("commgate: YAML files not collected as scenarios (the rule that decided)")
        for line in skipped:
            terminalreporter.write_line(line)
    if unwritten := config.stash.get(UNWRITTEN, None):
        terminalreporter.section("commgate: the report was not written")
        terminalreporter.write_line(unwritten)
    whole = all(Path(a).is_dir() for a in config.args) and not config.option.keyword and not config.option.markexpr
    for title, lines in state.sections(whole=whole).items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
