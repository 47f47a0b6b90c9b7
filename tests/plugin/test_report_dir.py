"""--commgate-report-dir: the run's report.json, valid against the published schema, and the HTML page."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from commgate.report.report import validate


def test_report_dir_gets_a_valid_report(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("g")
    out = pytester.path / "out"
    result = pytester.runpytest("--commgate-update-baselines", "--commgate-report-dir", str(out))
    result.assert_outcomes(passed=1)
    doc = json.loads((out / "report.json").read_text())
    validate(doc)
    assert [s["name"] for s in doc["scenarios"]] == ["g"] and doc["summary"]["passed"] == 1
    assert (out / "trace.json").exists() and (out / "plots" / "volume.png").exists()
    page = (out / "index.html").read_text()
    assert '<details id="d-g">' in page and 'aria-label="timeline of g"' in page  # its own figures, inline
    result.stdout.fnmatch_lines([f"commgate report: {out / 'index.html'}"])


def test_a_report_dir_that_is_a_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    (pytester.path / "out").write_text("")
    result = pytester.runpytest("--commgate-report-dir", str(pytester.path / "out"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: */out: cannot write the report there: */out is not a directory; give another "
                                 "--commgate-report-dir"])  # fmt: skip


@pytest.mark.parametrize("option", ["--commgate-report-dir", "--commgate-baseline-dir"])
def test_an_empty_directory_option_is_a_usage_error_not_the_working_directory(
    option: str, pytester: pytest.Pytester
) -> None:
    """``--commgate-report-dir=$OUT`` with OUT unset wrote report.json and index.html into the working directory,
    over the user's own index.html (found by an adversarial pass)."""
    (pytester.path / "index.html").write_text("<h1>mine</h1>")
    result = pytester.runpytest(f"{option}=")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*argument {option}: an empty path (an unset variable?): give a file or directory"])
    assert (pytester.path / "index.html").read_text() == "<h1>mine</h1>"


def test_a_report_dir_gone_by_the_end_is_one_line_not_a_crash(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("g", tail="markers: [gpu]\n")  # skipped here, quickly: the report still has it
    out = pytester.path / "out"
    pytester.makeconftest(f"""
import shutil, pytest

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    shutil.rmtree({str(out)!r})
    open({str(out)!r}, "w").close()
""")  # fmt: skip
    result = pytester.runpytest("--commgate-report-dir", str(out))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*commgate: the report was not written*", f"{out}/*: cannot be written (*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_sigterm_mid_suite_keeps_the_report_of_what_finished(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """A CI runner's cancel while the second scenario runs (rank 1 wedged: it never ends by itself):
    report.json holds the first and says the run was interrupted."""
    scenario_file("a", tail="markers: [gpu]\n")  # skipped here, at once
    scenario_file("b", tail="workload: commgate.run.workloads.faults:wedge\ndeadline_s: 600\n")
    out = pytester.path / "out"
    argv = [sys.executable, "-m", "pytest", "a.yaml", "b.yaml", "--commgate-report-dir", "out"]
    with subprocess.Popen(argv, cwd=pytester.path, stdout=subprocess.PIPE, text=True) as proc:
        left = time.monotonic() + 300  # the first scenario's entry, written as soon as it is done
        while not (out / "report.json").exists() and time.monotonic() < left:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, stdout
    doc = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["a"]
    assert doc["interrupted"] == "SIGTERM during the session; 1 scenario(s) had finished"
    validate(doc)


def test_a_report_dir_another_session_writes_into_is_a_usage_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """Two sessions into one ``--commgate-report-dir`` (two CI jobs on one runner, a run beside a rerun): the
    second is refused before it runs anything, naming the first's pid, as ``commgate run --report-dir`` is. The
    lock is held here as a running session holds it; released, the same command goes on."""
    import fcntl
    import os

    from commgate.session import LOCK_FILE

    scenario_file("g", tail="markers: [gpu]\n")  # skipped here, quickly: the report still has it
    out = pytester.path / "out"
    out.mkdir()
    with open(out / LOCK_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(str(os.getpid()))
        held.flush()
        refused = pytester.runpytest_subprocess("--commgate-report-dir", str(out))
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    says = (f"ERROR: --commgate-report-dir {out}: another commgate run (pid {os.getpid()}) is writing its report "
            "there; give another --commgate-report-dir, or wait for it")  # fmt: skip
    refused.stderr.fnmatch_lines([says])
    assert not (out / "report.json").exists()
    after = pytester.runpytest_subprocess("--commgate-report-dir", str(out))
    after.assert_outcomes(skipped=1)
    assert (out / "report.json").exists()
