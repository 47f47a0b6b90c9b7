"""One run of scenarios, whichever entry point drives it: the pytest plugin's hooks and ``commgate run``
each hold a ``Session`` and only adapt to it (as syrupy's ``SnapshotSession`` and pytest-benchmark's
``BenchmarkSession`` own a check's whole life).

The session checks the entry point's options once (``options``: contradictory flags are a one-line
``UsageError`` naming them), runs each scenario through ``commgate.pipeline.run_scenario`` and records its
result: report.json, rewritten after every scenario (so an interrupted run leaves a complete report of
what ran), the baselines judged against and those written, the warnings; at the end the HTML page beside
the report, and the baselines no scenario used. Under pytest-xdist each worker's session hands its part
to the controller's (``part``, ``merge``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commgate.core import env
from commgate.core.errors import CommgateError, UsageError
from commgate.core.fsutil import check_writable_dir
from commgate.judge.finding import Finding
from commgate.judge.store import BaselineStore
from commgate.model.scenario import Backend, Scenario
from commgate.pipeline import Options, run_scenario
from commgate.report.report import Report, ScenarioResult
from commgate.run.inject import SPECS, Faults, parse
from commgate.run.runners import LocalRanks, Runner

if TYPE_CHECKING:
    import pytest

LOCK_FILE = ".commgate.lock"
"""In a report directory: the lock of the session writing there (``Session.only_writer``), with its pid."""

# the pytest plugin's markers and options (``commgate.plugin`` registers them)
MARKERS: dict[str, str] = {
    "gpu": "needs a GPU (NCCL/RCCL); skipped where none is present",
    "multinode": "starts several nodes (torchrun agents); slow",
    "slurm": "brings up a two-node Slurm cluster on this machine (ci/slurm-in-a-box.sh; root, Linux); slow",
    "slow": "takes more than a few seconds",
    "nightly": "part of the nightly cluster run, not of pull-request gating",
}
PYTEST_OPTIONS: dict[str, dict[str, Any]] = {
    "update-baselines": {"action": "store_true", "help": "write the baselines of the scenarios run (missing or "
                         "changed ones), and report what changed"},
    "refresh-latency": {"action": "store_true", "help": "with --commgate-update-baselines: rewrite unchanged "
                        "baselines too, storing this run's latency samples"},
    "baseline-dir": {"metavar": "DIR", "type": env.path, "help": "where baselines live (default: <rootdir>/baselines)"},
    "report-dir": {"metavar": "DIR", "type": env.path, "help": "write report.json and the HTML there"},
    "backend": {"choices": ("auto", "gloo", "nccl"), "help": "run every scenario on this backend instead of the one "
                "it declares"},
    "deadline": {"metavar": "S", "type": float, "help": "per-scenario deadline in seconds"},
    "fault": {"metavar": "FAULT", "action": "append", "default": [], "help": "plant a fault to prove the gate: "
              + ", ".join(SPECS)},
}  # fmt: skip


def sigterm_as_interrupt() -> Callable[[], None]:
    """SIGTERM (a CI runner's cancel) and SIGHUP (a closed terminal, a dropped ssh) unwind as Ctrl-C does:
    ranks killed, report.json kept and marked interrupted. Only where each is at its default, on the main
    thread; returns what puts the handlers back (nothing where it left them alone)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {
        n: signal.signal(n, interrupt) for n in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(n) == signal.SIG_DFL
    }

    def restore() -> None:
        for n, handler in previous.items():
            signal.signal(n, handler)

    return restore


def options(
    flag: Callable[[str], str],
    *,
    baseline_dir: Path,
    gate: bool = True,
    update: bool = False,
    refresh_latency: bool = False,
    backend: Backend | None = None,
    deadline: float | None = None,
    faulty: bool = False,
) -> Options:
    """The pipeline's options from an entry point's flags, checked; ``flag(name)`` is how the entry point
    spells the option ``name`` (``--commgate-update-baselines``, ``--update-baselines``)."""
    if update and not gate:
        raise UsageError(f"{flag('update-baselines')} needs {flag('gate')}")
    if update and faulty:
        raise UsageError(
            f"{flag('update-baselines')} with {flag('fault')} would store a faulty run as the baseline; use one"
        )
    if refresh_latency and not update:
        raise UsageError(f"{flag('refresh-latency')} works with {flag('update-baselines')}; add it")
    if deadline is not None and not (math.isfinite(deadline) and deadline > 0):
        raise UsageError(f"{flag('deadline')} {deadline:g}: expected a positive, finite number of seconds")
    if baseline_dir.exists() and not baseline_dir.is_dir():  # every scenario failed on it, or (run without
        # --gate, found by an adversarial pass) it was accepted in silence and named as a place for curves
        raise UsageError(f"{flag('baseline-dir')} {baseline_dir}: not a directory; give a directory of baselines")
    env.check()
    return Options(
        baseline_dir=baseline_dir,
        gate=gate,
        update_baselines=update,
        refresh_latency=refresh_latency,
        update_flag=flag("update-baselines"),
        backend=backend,
        faulty=faulty,
    )


@dataclass(kw_only=True)
class Session:
    """The scenarios one command (or one pytest session) runs, with one runner and one set of options."""

    options: Options
    runner: Runner
    report_dir: Path | None = None
    """Where report.json and the HTML page go (None: nowhere; a pytest-xdist worker hands its part on)."""
    by_name: bool = False
    """Order report.json's scenarios by name (the pytest gate, whose xdist workers finish in any order)
    rather than as they finished."""
    faults: Faults = field(default_factory=Faults)
    """Faults planted in every run (``--commgate-fault``), named with each failure."""
    report: Report = field(init=False)
    updated: list[str] = field(default_factory=list)
    """``<id>: <what was written to its baseline>``, for the end of the run."""
    warnings: list[str] = field(default_factory=list)
    """``<id>: <finding>`` of every finding that did not fail its scenario."""
    used: set[str] = field(default_factory=set)
    """Resolved paths of the baseline files the scenarios were judged against."""
    html: Path | None = None
    """The HTML page, once ``finish`` wrote it."""
    ids: dict[str, str | None] = field(default_factory=dict)
    """The scenario ids collected so far, with their files (two files naming one scenario alike: an error)."""
    not_scenarios: list[str] = field(default_factory=list)
    """``<file>: <rule>`` of each YAML file in a directory the user named that is not collected."""
    unwritten: str | None = None
    """Why the report could not be written at the end (said in the run's last lines)."""
    flag: Callable[[str], str] = lambda name: f"--{name}"
    """How the entry point spells an option (``--commgate-report-dir``), for the fix a one-line error names."""
    _writable: bool = field(default=False, init=False, repr=False)
    _backends: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    """The backends of the scenarios ``expect`` was given: their baseline folders are probed too."""

    def __post_init__(self) -> None:
        self.report = Report(self.report_dir / "report.json" if self.report_dir is not None else None)

    @classmethod
    def for_pytest(cls, config: pytest.Config, progress: Callable[[str], None] | None = None) -> Session:
        """The pytest gate's session, from its ``--commgate-*`` options (on local ranks, telling ``progress``
        what a run is doing; a pytest-xdist worker's writes no report: it hands its part to the controller)."""

        import pytest

        def option(name: str) -> Any:
            return config.getoption(f"commgate_{name}", None)

        try:  # contradictory flags are pytest's usage errors (exit status 4)
            checked = options(
                lambda name: f"--commgate-{name}",
                baseline_dir=option("baseline_dir") or config.rootpath / "baselines",
                update=bool(option("update_baselines")),
                refresh_latency=bool(option("refresh_latency")),
                backend=option("backend"),
                deadline=option("deadline"),
                faulty=bool(option("fault")),
            )
            faults = parse(option("fault") or [])
        except UsageError as exc:
            raise pytest.UsageError(str(exc)) from None
        worker = hasattr(config, "workeroutput")
        runner = LocalRanks(deadline_s=option("deadline"), faults=faults, progress=progress)
        session = cls(
            options=checked,
            runner=runner,
            report_dir=None if worker else option("report_dir"),
            by_name=True,
            faults=faults,
            flag=lambda name: f"--commgate-{name}",
        )
        try:  # the report directory, named on the command line: refused before collection
            session.check_writable(baselines=False)
        except CommgateError as exc:
            raise pytest.UsageError(str(exc)) from None
        return session

    def check_writable(self, *, baselines: bool = True) -> None:
        """A one-line ``WriteError`` naming the path unless the report directory and, when the gate judges
        (it writes missing baselines) and ``baselines`` is asked for, the baseline directory can be written:
        before any rank starts."""
        if self._writable:
            return
        if self.report_dir is not None:
            fix = f"give another {self.flag('report-dir')}"
            check_writable_dir(self.report_dir, what="the report", fix=fix)
            from commgate.report import htmlreport

            htmlreport.check_outputs(self.report_dir, fix=fix)
        if baselines and self.options.gate:
            fix = f"give another {self.flag('baseline-dir')}"
            check_writable_dir(self.options.baseline_dir, what="baselines", fix=fix)
            store = BaselineStore(self.options.baseline_dir)
            for backend in sorted(self._backends):  # a file where a backend's folder goes: said after the run
                store.folder(backend)
        self._writable = baselines

    @contextlib.contextmanager
    def only_writer(self) -> Iterator[None]:
        """This session alone writes into its report directory while it lasts (an exclusive lock on a file
        there; nothing without one): two runs into one directory left one report saying "1 passed" where the
        other had failed. A one-line ``UsageError`` naming the holder's pid while another session holds it."""
        import fcntl

        if self.report_dir is None:
            yield
            return
        self.report_dir.mkdir(parents=True, exist_ok=True)
        with open(self.report_dir / LOCK_FILE, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "?"
                raise UsageError(
                    f"{self.flag('report-dir')} {self.report_dir}: another commgate run (pid {holder}) is writing its "
                    f"report there; give another {self.flag('report-dir')}, or wait for it"
                ) from None
            lock.seek(0)
            lock.truncate()
            lock.write(str(os.getpid()))
            lock.flush()
            yield

    def expect(self, scenarios: Iterable[Scenario]) -> None:
        """The scenarios this session will run: on local ranks, their trainers are imported once, by the
        ranks' forkserver, rather than by every rank of every scenario; their backends' baseline folders are
        probed with the baseline directory (``check_writable``)."""
        from commgate.run.launcher import planned_backend

        scenarios = list(scenarios)
        backend = self.options.backend
        self._backends = frozenset(planned_backend(replace(s, backend=backend or s.backend)) for s in scenarios)
        if isinstance(self.runner, LocalRanks):
            self.runner = replace(self.runner, trainers=frozenset(s.trainer for s in scenarios))

    def run(self, scenario: Scenario) -> ScenarioResult | None:
        """Run ``scenario`` and record its result (None: a torchrun rank that does not report)."""
        self.check_writable()
        result = run_scenario(scenario, self.runner, self.options)
        if result is None:
            return None
        felt = any(f.kind in ("latency", "cold-start") for f in result.findings)
        if self.faults and result.status == "passed" and not felt:
            result = replace(result, findings=(*result.findings, self._unfelt()))
        self.record(result)
        return result

    def _unfelt(self) -> Finding:
        """A planted fault under which a scenario still passed: said, never silent (a fault that changes what
        a scheme sends on some configurations only, e.g. ZeRO-1 for ZeRO-2 where both send alike)."""
        assert self.faults is not None
        return Finding(
            kind="fault",
            fail=False,
            title=f"planted fault {self.faults.describe()}: the run passed, so it changed nothing the gate checks in "
            "this scenario",
            hint=f"a fault meant to fail this scenario needs another {self.flag('fault')}",
        )

    def record(self, result: ScenarioResult) -> None:
        sid = result.prediction.scenario.id
        self.report.add(result)
        if result.baseline is not None:
            self.used.add(str(result.baseline.resolve()))
        if result.baseline_written:
            self.updated.append(f"{sid}: {result.baseline_written}")
        self.warnings += [f"{sid}: {f.text()}" for f in result.findings if not f.fail]

    def failure(self, result: ScenarioResult) -> str:
        """``<id>: why it failed``, the faults planted to make it fail first."""
        planted = f"(planted fault: {self.faults.describe()})\n" if self.faults else ""
        sid = f"{result.prediction.scenario.id}: "  # once: a run's error names its scenario itself (a deadline)
        return f"{sid}{planted}{result.reason.removeprefix(sid)}"

    def interrupt(self, why: str) -> None:
        """Mark the run as stopped before its end (report.json says ``interrupted``: why, and what finished)."""
        self.report.interrupted = f"{why}; {len(self.report.scenarios)} scenario(s) had finished"
        self.report.write()

    def part(self) -> dict[str, Any]:
        """What a pytest-xdist worker hands the controller (plain JSON values, as ``workeroutput`` carries)."""
        return {
            "scenarios": self.report.scenarios,
            "updated": self.updated,
            "warnings": self.warnings,
            "used": sorted(self.used),
        }

    def merge(self, part: dict[str, Any]) -> None:
        """A worker's ``part``, added to this (the controller's) session."""
        self.report.scenarios += part["scenarios"]
        self.report.write()
        self.updated += part["updated"]
        self.warnings += part["warnings"]
        self.used.update(part["used"])

    @property
    def counts(self) -> dict[str, int]:
        """Scenarios per status (passed, failed, error, skipped)."""
        counts: dict[str, int] = self.report.document()["summary"]
        return counts

    def finish(self) -> Path | None:
        """report.json in its final order and the HTML page beside it; the page (None without a report
        directory, or when no scenario ran and the run was not interrupted: a run stopped in its first scenario
        left the previous run's page and trace beside its report.json; found by an adversarial pass)."""
        path = self.report.path
        if path is None or not (self.report.scenarios or self.report.interrupted):
            return None
        from commgate.report import htmlreport

        if self.by_name:
            ordered = sorted(self.report.scenarios, key=lambda s: str(s["name"]))
            self.report = Report(path, ordered, started=self.report.started, interrupted=self.report.interrupted)
        self.report.write()
        self.html = htmlreport.write(path.parent, self.report.document())
        return self.html

    def sections(self, *, whole: bool) -> dict[str, list[str]]:
        """The end of the run, by title: the YAML files not collected (with the rule that decided), a report
        that could not be written, the baselines written, the warnings and, after a ``whole`` suite ran, the
        baselines no scenario used (only those with lines)."""
        unused = [str(p) for p in self.unused_baselines()] if whole else []
        sections = {
            "commgate: YAML files not collected as scenarios (the rule that decided)": self.not_scenarios,
            "commgate: the report was not written": [self.unwritten] if self.unwritten else [],
            "commgate baselines": self.updated,
            "commgate warnings": self.warnings,
            "commgate: baselines no scenario used": unused,
        }
        return {title: lines for title, lines in sections.items() if lines}

    def end(self) -> bool:
        """``finish``, a failure to write the report kept as one line (``unwritten``); whether it was written."""
        try:
            self.finish()
        except CommgateError as exc:  # e.g. the report directory filled up or was taken away
            self.unwritten = str(exc)
        return self.unwritten is None

    def unused_baselines(self) -> list[Path]:
        """The baselines no scenario was judged against (none when no scenario was judged against any);
        meaningful after a whole suite ran: the entry point says when that was."""
        return BaselineStore(self.options.baseline_dir).unused(self.used) if self.used else []
