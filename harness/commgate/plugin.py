"""commgate's pytest plugin (the ``pytest11`` entry point): scenario files as tests. It only adapts pytest
to a ``commgate.session.Session``: options (one group, ``--commgate-*``), collection (one item per scenario,
sweep variants included, with its markers), the item's outcome, the session's end. torch and DeepSpeed
are imported only when a scenario runs."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from commgate.core.errors import UsageError
from commgate.session import MARKERS, PYTEST_OPTIONS, Session, sigterm_as_interrupt

if TYPE_CHECKING:
    from collections.abc import Iterator

    from commgate.model.scenario import Scenario

SESSION: pytest.StashKey[Session] = pytest.StashKey()
DEFAULT_SCENARIO_DIR = "scenarios"
"""Where the gate looks for scenarios when the pytest configuration names no ``commgate_scenario_dirs``."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("commgate", "commgate: communication regression gate for scenario files")
    for name, kwargs in PYTEST_OPTIONS.items():
        group.addoption(f"--commgate-{name}", **kwargs)
    parser.addini(
        "commgate_scenario_dirs",
        type="linelist",
        default=[],
        help=f"directories (relative to the rootdir) whose every .yaml/.yml file is a scenario (default: "
        f"{DEFAULT_SCENARIO_DIR}, where it holds a file declaring schema_version); elsewhere a YAML file is one if "
        "it declares schema_version, or is named on the command line and has one of a scenario's required keys. A "
        "scenario file that cannot be read or validated is a collection error.",
    )


def pytest_configure(config: pytest.Config) -> None:
    _check_scenario_dirs(config)
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    progress = _Progress(config)
    config.stash[SESSION] = state = Session.for_pytest(config, progress)
    writing = contextlib.ExitStack()
    try:  # this session alone writes into its report directory (a pytest-xdist worker writes none)
        writing.enter_context(state.only_writer())
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.add_cleanup(writing.close)
    config.pluginmanager.register(progress, "commgate-progress")
    config.pluginmanager.register(_OnInterrupt(config.stash[SESSION]), "commgate-interrupt")
    config.add_cleanup(sigterm_as_interrupt())  # SIGTERM unwinds as Ctrl-C does until the session ends


def scenario_dirs(config: pytest.Config) -> tuple[list[str], bool]:
    """The scenario directories, and whether the configuration names them (else the default, ``scenarios``)."""
    dirs: list[str] = config.getini("commgate_scenario_dirs")
    return (dirs, True) if dirs else ([DEFAULT_SCENARIO_DIR], False)


def _check_scenario_dirs(config: pytest.Config) -> None:
    """A ``commgate_scenario_dirs`` the configuration sets names directories that exist: a misspelled one
    would collect no scenario and the gate would pass having judged nothing. (The default, ``scenarios``,
    may be absent: a project with commgate installed need not use it.)"""
    dirs, configured = scenario_dirs(config)
    where = config.inipath or config.rootpath
    missing = [d for d in dirs if not (config.rootpath / d).is_dir()]
    if missing and configured:
        raise pytest.UsageError(
            f"{where}: commgate_scenario_dirs names {', '.join(map(repr, missing))}, not a directory under "
            f"{config.rootpath}; create it, or fix the name"
        )
    root, here = config.rootpath.resolve(), config.invocation_params.dir
    named = [(here / a.split("::")[0]).resolve() for a in config.args]
    outside = [
        d
        for d in dirs
        if d not in missing
        and not (full := (root / d).resolve()).is_relative_to(root)
        and not any(full.is_relative_to(n) for n in named)
    ]
    if outside:  # pytest looks under its rootdir, or where it is told: the gate would judge none of them
        raise pytest.UsageError(
            f"{where}: commgate_scenario_dirs names {', '.join(map(repr, outside))}, outside the rootdir {root}, "
            f"where pytest does not look; name it on the command line (pytest {outside[0]}) or move it under the "
            "rootdir"
        )


class _Progress:
    """A long scenario under pytest is never silent: what its run is doing (the launcher's progress: the
    forkserver, the ranks' phase, step k of n), one line after each ``QUIET_S`` without one, written to the
    terminal around pytest's capture as its live logging is; a short run prints nothing more. A pytest-xdist
    worker has no terminal: its controller shows the results."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.nodeid = ""
        self.last = time.monotonic()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.nodeid, self.last = nodeid, time.monotonic()

    def __call__(self, text: str) -> None:
        from commgate.report.liveline import QUIET_S

        if time.monotonic() - self.last < QUIET_S:
            return
        plugins = self.config.pluginmanager
        terminal, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if terminal is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            terminal.write_line(f"    {self.nodeid}: {text}")
        self.last = time.monotonic()


class _OnInterrupt:
    """Ctrl-C or SIGTERM: the session's report says so (pytest then ends the session: report.json kept)."""

    def __init__(self, state: Session) -> None:
        self.state = state

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.state.interrupt(f"{str(excinfo.value) or 'Ctrl-C'} during the session")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """YAML scenarios (one that cannot be read or validated fails collection): every one declaring
    ``schema_version``, and every one under the ini's ``commgate_scenario_dirs`` where the configuration names
    them or the default ``scenarios`` holds a scenario. Elsewhere, a file named on the command line or in a
    directory named there, or one in a ``scenarios`` of a project that has none, is loaded where it may be a
    scenario (it has one of a scenario's required keys) and is listed at the end with the rule that decided
    where it is named and is none: another project's YAML (pytest's own YAML-test example, a BDD suite's
    ``scenarios/``) is not commgate's to refuse, found by an adversarial pass."""
    if file_path.suffix not in (".yaml", ".yml"):
        return None
    from commgate.model.loader import declares_scenario, not_a_scenario

    config = parent.config
    dirs = [(config.rootpath / d).resolve() for d in scenario_dirs(config)[0]]
    under = any(file_path.resolve().is_relative_to(d) for d in dirs)
    if declares_scenario(file_path) or (under and _commgate_dirs(config)):
        return ScenarioFile.from_parent(parent, path=file_path)
    named = parent.session.isinitpath(file_path) or (
        config.args_source == pytest.Config.ArgsSource.ARGS and _under_args(config, file_path)
    )
    if named or under:
        if (rule := not_a_scenario(file_path)) is None:  # it may be one: load it, and say what is wrong with it
            return ScenarioFile.from_parent(parent, path=file_path)
        if named:
            config.stash[SESSION].not_scenarios.append(f"{file_path}: {rule}")
    return None


_COMMGATE_DIRS: pytest.StashKey[bool] = pytest.StashKey()


def _commgate_dirs(config: pytest.Config) -> bool:
    """Whether the scenario directories are commgate's: the configuration names them, or the default holds a
    file declaring ``schema_version`` (then every YAML file there must be a scenario: a broken one is an
    error, never a silent pass)."""
    if _COMMGATE_DIRS not in config.stash:
        from commgate.model.loader import declares_scenario

        default = config.rootpath / DEFAULT_SCENARIO_DIR
        config.stash[_COMMGATE_DIRS] = scenario_dirs(config)[1] or any(
            declares_scenario(f) for pattern in ("*.yaml", "*.yml") for f in default.rglob(pattern) if f.is_file()
        )
    return config.stash[_COMMGATE_DIRS]


def pytest_collection_finish(session: pytest.Session) -> None:
    """The session told the scenarios it will run (``Session.expect``). A scenario-named link to a missing
    file under the ini's ``commgate_scenario_dirs`` or a directory named on the command line (pytest's walk
    passes over it: the gate would stay green without it) is a usage error naming it."""
    config = session.config
    state = config.stash[SESSION]
    state.expect(i.scenario for i in session.items if isinstance(i, ScenarioItem))
    # a YAML file another plugin or conftest collected (pytest's YAML-test example) is not listed as no scenario
    theirs = {f"{i.path}: " for i in session.items if not isinstance(i, ScenarioItem)}
    state.not_scenarios[:] = [n for n in state.not_scenarios if not any(n.startswith(t) for t in theirs)]
    dirs = [(config.rootpath / d).resolve() for d in scenario_dirs(config)[0]]
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        dirs += [Path(config.invocation_params.dir, a.split("::")[0]) for a in config.args]
    from commgate.model.loader import dangling

    if links := dangling(dirs):
        where = ", ".join(f"{f} -> {os.readlink(f)}" for f in links[:3]) + (" ..." if len(links) > 3 else "")
        raise pytest.UsageError(
            f"{len(links)} scenario link(s) to a missing file: {where}; restore the files or remove the links"
        )


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
            if twins := duplicate_ids(scenarios, self.config.stash[SESSION].ids):  # as validate refuses them
                raise ScenarioError(twins)
        except ScenarioError as exc:
            raise self.CollectError(str(exc)) from None
        for s in scenarios:
            item = ScenarioItem.from_parent(self, name=s.id, scenario=s, nodeid=self._nodeid(s.id))
            for m in s.markers:
                item.add_marker(m)
            yield item

    def _nodeid(self, name: str) -> Any:
        """A sweep variant's node id (``b[s=128]``) as pytest 9 parses one back from its cache: the name ``b`` with
        the parameters ``s=128``, as a parametrized test's; ``--lf`` compares those, and an item named ``b[s=128]``
        never matched (found by an adversarial pass). None (pytest's own id) for any other item, and before
        pytest 9, whose ids are strings."""
        base, bracket, params = name.partition("[")
        parent_id = getattr(self, "id", None)
        if not bracket or not hasattr(parent_id, "with_params"):
            return None
        return parent_id.child(base).with_params(params.removesuffix("]"))  # type: ignore[union-attr]


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
    elif state is not None and not state.end():  # the report not written: said in one line, and exit 1
        session.exitstatus = max(int(session.exitstatus), int(pytest.ExitCode.TESTS_FAILED))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if (state := config.stash.get(SESSION, None)) is None or hasattr(config, "workeroutput"):
        return
    if state.html is not None:
        terminalreporter.write_line(f"commgate report: {state.html}")
    whole = all(Path(a).is_dir() for a in config.args) and not config.option.keyword and not config.option.markexpr
    for title, lines in state.sections(whole=whole).items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
