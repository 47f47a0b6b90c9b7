"""``commgate run``'s progress while a scenario runs (issue 29, item 7): the phase the slowest rank is in,
one line rewritten on a terminal, a line per quiet stretch in a CI log; the forkserver's own output kept out
of the terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from commgate.report import liveline
from commgate.report.liveline import LiveLine
from commgate.run.diagnose import phase


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_rewritten_in_place_and_cleared_before_the_result() -> None:
    out = Terminal()
    live = LiveLine(out)
    live.start("g")
    live("building the model and the framework, 1 s")
    live("building the model and the framework, 1 s")  # unchanged: not written again
    live("step 2 of 3, 2 s")
    live.clear()
    assert out.getvalue() == (
        "\r\033[K    building the model and the framework, 1 s\r\033[K    step 2 of 3, 2 s\r\033[K"
    )


def test_in_a_log_a_line_comes_only_after_a_quiet_stretch(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(liveline.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    live = LiveLine(out)
    live.start("zero3")
    live("building the model and the framework, 1 s")
    assert out.getvalue() == ""  # a short run prints nothing more
    now[0] += liveline.QUIET_S
    live("building the model and the framework, 16 s")
    live("step 1 of 3, 16 s")
    now[0] += liveline.QUIET_S
    live("step 3 of 3, 31 s")
    live.clear()
    assert out.getvalue().splitlines() == [
        "    zero3: building the model and the framework, 16 s",
        "    zero3: step 3 of 3, 31 s",
    ]


def test_the_phase_is_the_slowest_ranks(tmp_path: Path) -> None:
    def rank(r: int, mark: str | None, steps: int = 0) -> None:
        if mark is not None:
            (tmp_path / f"rank{r}.phase.json").write_text(json.dumps({"phase": mark}))
        (tmp_path / f"rank{r}.beat").write_text(json.dumps({"steps_ns": [1] * steps}))

    rank(0, None)
    rank(1, "joined")
    assert phase(tmp_path, [0, 1], 5) == "starting the ranks"
    rank(0, "entry")
    assert phase(tmp_path, [0, 1], 5) == "joining the process group"
    rank(0, "built", steps=2)
    assert phase(tmp_path, [0, 1], 5) == "building the model and the framework"
    rank(1, "built", steps=4)
    assert phase(tmp_path, [0, 1], 5) == "step 3 of 5"  # rank 0 is in its third step, rank 1 in its fifth
    rank(0, "stepped", steps=5)
    rank(1, "stepped", steps=5)
    assert phase(tmp_path, [0, 1], 5) == "gathering the capture"


def test_under_pytest_a_long_scenario_says_what_its_run_is_doing(pytester: pytest.Pytester) -> None:
    """The pytest gate tells the same progress between the scenario's name and its result, one line per
    quiet stretch (here made zero, so every progress call of the run prints), past pytest's capture."""
    pytester.makeconftest("import commgate.report.liveline as live\nlive.QUIET_S = 0.0\n")
    pytester.makefile(
        ".yaml",
        ddp="schema_version: 1\nname: ddp-tiny\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
        "steps: 2\n",
    )
    flags = ("--commgate-update-baselines", "-p", "no:cacheprovider", "-p", "no:randomly")
    result = pytester.runpytest_subprocess("ddp.yaml", *flags, timeout=600)
    result.assert_outcomes(passed=1)
    lines = [line for line in result.stdout.lines if line.startswith("    ddp.yaml::ddp-tiny: ")]
    # which phases a poll sees depends on the machine's speed; the last one, after the ranks, always comes
    assert lines and lines[-1].endswith("merging the ranks' captures"), result.stdout.str()
