"""``commgate compare BEFORE AFTER``: identical runs pass, a planted volume change fails and is shown."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from commgate.cli import main
from commgate.judge import baseline as bl
from commgate.model.scenario import LatencyRule

DATA = Path(__file__).parent / "data" / "baselines"


def baseline_dir(tmp: Path, name: str, fixture: str) -> Path:
    """``tmp/name``: a baseline directory holding ``fixture`` where its scenario's runs keep it
    (``gloo/ddp-19m-dp4.json``)."""
    (tmp / name / "gloo").mkdir(parents=True)
    shutil.copy(DATA / fixture, tmp / name / "gloo" / "ddp-19m-dp4.json")
    return tmp / name


def test_identical_baseline_sets_compare_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = baseline_dir(tmp_path, "a", "ddp.json"), baseline_dir(tmp_path, "b", "ddp.json")
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    # (the fixture's stored runs predate calls counted from their last party: latency is not judged on them)
    assert "ddp-19m-dp4: unchanged (latency not judged: 0 run(s) measured by this version" in out
    assert "0 of 1 scenario(s) changed" in out


def test_a_volume_change_fails_and_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = baseline_dir(tmp_path, "a", "ddp.json"), baseline_dir(tmp_path, "b", "ddp-split-bucket.json")
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [  # what changed in words, then the numbers that prove it
        "ddp-19m-dp4:",
        "    all_reduce fp32 1,061,888 B (backward, group [0, 1, 2, 3]) became 2 calls of 530,432 B and 531,456 B: "
        "a bucket split",
        "    calls [steps] all_reduce fp32 1061888 B backward group [0, 1, 2, 3]: after 0, before 12 (-12)",
    ]
    assert out[-1] == "1 of 1 scenario(s) changed"


def _report_of_a_real_run(tmp_path: Path) -> Path:
    """``commgate run`` of a 2-rank DDP scenario; its report.json."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "commgate", "run", str(scenario), "--report-dir", str(tmp_path / "a")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return tmp_path / "a" / "report.json"


def test_reports_of_real_runs(tmp_path: Path) -> None:
    before = _report_of_a_real_run(tmp_path)
    assert main(["compare", str(before), str(before)]) == 0
    doc = json.loads(before.read_text())
    doc["scenarios"][0]["calls"][-1]["measured_calls"] += 1  # a planted extra call
    after = tmp_path / "after.json"
    after.write_text(json.dumps(doc))
    assert main(["compare", str(before), str(after)]) == 1


def test_runs_on_two_backends_are_not_compared_call_by_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real run against an emulated one of the same scenario showed the emulated side's halved counts as 13
    changes of communication (an emulated run is rank 0's view), never naming the backends (found by an
    adversarial pass); baseline folders kept the two apart. One line names both backends."""
    before = _report_of_a_real_run(tmp_path)
    doc = json.loads(before.read_text())
    doc["scenarios"][0]["capture"]["backend"] = "emulated"
    after = tmp_path / "after.json"
    after.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["compare", str(before), str(after)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "s: ran on gloo before, on emulated after: two backends' calls are not compared",
        "1 of 1 scenario(s) changed",
    ]


def test_reports_of_jobs_no_scenario_describes_compare_their_calls(tmp_path: Path) -> None:
    """``commgate check`` of a job without ``--scenario`` reports no per-key table (its model is a stand-in's):
    two such reports compared said "not compared (passed on both sides)" and "nothing compared, no scenario
    ran on both sides" (found by an adversarial pass). Their calls are counted from the capture, as the
    reconciliation counts them: the same table a report with a scenario lists."""
    from commgate.judge.compare import _from_report_entry

    doc = json.loads(_report_of_a_real_run(tmp_path).read_text())
    listed = _from_report_entry(doc["scenarios"][0])
    for key in ("calls", "collectives", "traffic_matrix"):  # what a report of a job no scenario describes lacks
        del doc["scenarios"][0][key]
    counted = _from_report_entry(doc["scenarios"][0])
    assert listed is not None and counted is not None and counted.calls == listed.calls
    before = tmp_path / "before.json"
    before.write_text(json.dumps(doc))
    assert main(["compare", str(before), str(before)]) == 0
    calls = doc["scenarios"][0]["capture"]["calls"]
    extra = max(calls, key=lambda c: c["step"]) | {"seq": 10**6}  # one more call in the last step, on one rank
    calls.append(extra)
    after = tmp_path / "after.json"
    after.write_text(json.dumps(doc))
    assert main(["compare", str(before), str(after)]) == 1


def _slowed(doc: dict[str, object], op: str, factor: float) -> dict[str, object]:
    out = json.loads(json.dumps(doc))
    for c in out["scenarios"][0]["capture"]["calls"]:  # type: ignore[index]
        if c["op"] == op and c["duration_ns"] is not None:
            c["duration_ns"] = int(c["duration_ns"] * factor)
    return out


def test_a_fresh_run_of_unchanged_code_compares_equal_to_its_committed_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DDP broadcasts 1280/3 B per step: the baseline stores the fraction, the report a float; the
    comparison is exact on both sides (from the report's integer counts), so it says unchanged."""
    root = Path(__file__).resolve().parents[1]
    committed = bl.load(root / "baselines" / "gloo" / "ddp-19m-dp4.json")
    assert committed.bytes_per_step["broadcast"].denominator == 3
    (tmp_path / "base" / "gloo").mkdir(parents=True)
    shutil.copy(root / "baselines" / "gloo" / "ddp-19m-dp4.json", tmp_path / "base" / "gloo")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "commgate",
            "run",
            str(root / "scenarios" / "ddp.yaml"),
            "--report-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "r" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "ddp-19m-dp4: unchanged" in out and "0 of 1 scenario(s) changed" in out


def _quiet(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its calls' times laid out as on a quiet machine: every rank issues call k at the same
    moment, 2 ms after call k - 1, and each takes 0.1 ms; each step's window holds its calls with 0.5 ms of
    compute either side. A real run's times are the machine's: on a loaded one, DDP's bucket all-reduces
    queue behind each other, and tripling each call's time from its issue moved their floor (each counted
    from when a worker of its group was free) by x1.72 in one of 8 runs, under the x1.75 the rule judges:
    the test judged the machine, not ``compare``."""
    out = json.loads(json.dumps(doc))
    cap = out["scenarios"][0]["capture"]
    for clock in cap["clocks"]:
        clock["monotonic_ns"] = cap["clocks"][0]["monotonic_ns"]  # one time line: no rank waits for another
    for c in cap["calls"]:
        c["start_ns"], c["duration_ns"] = 10_000_000 + 2_000_000 * c["seq"], 100_000
    for w in cap["step_windows"]:
        held = [c for c in cap["calls"] if c["rank"] == w["rank"] and c["step"] == w["step"]]
        if held:
            w["start_ns"] = min(c["start_ns"] for c in held) - 500_000
            w["end_ns"] = max(c["start_ns"] + c["duration_ns"] for c in held) + 500_000
            w["blocked_ns"] = sum(c["duration_ns"] for c in held)
    return out


def test_runs_on_each_side_judge_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Directories of run reports (ci/pre-upgrade.sh's before/1..3, after/1..3): latency is judged on
    runs once each side has three; a slowdown in every after run is a change, a speed-up is not. The calls
    of a real run, timed as on a quiet machine (``_quiet``)."""
    doc = _quiet(json.loads(_report_of_a_real_run(tmp_path).read_text()))

    def side(name: str, docs: list[dict[str, object]]) -> str:
        for i, d in enumerate(docs, 1):
            (tmp_path / name / str(i)).mkdir(parents=True)
            (tmp_path / name / str(i) / "report.json").write_text(json.dumps(d))
        return str(tmp_path / name)

    before = side("before", [doc, doc, doc])
    assert main(["compare", before, side("same", [doc, doc, doc])]) == 0
    assert "s: unchanged (no latency shift beyond x" in capsys.readouterr().out
    assert main(["compare", before, side("one", [_slowed(doc, "all_reduce", 3)])]) == 0
    assert "latency not judged: 3 before and 1 after run(s), 3 a side needed" in capsys.readouterr().out
    assert main(["compare", before, side("slow", [_slowed(doc, "all_reduce", 3)] * 3)]) == 1
    out = capsys.readouterr().out
    # every all-reduce 3x as long from its issue: its floor (each call less the wait for its peer and for the
    # group's call before it, which now ends later too) beyond the factor
    import re

    shown = re.search(r"latency slower: all_reduce floor per step x([\d.]+) in each of 3 run\(s\) vs 3", out)
    assert shown and float(shown[1]) >= LatencyRule().factor, out
    assert main(["compare", before, side("fast", [_slowed(doc, "all_reduce", 0.25)] * 3)]) == 0
    assert "latency faster: all_reduce" in capsys.readouterr().out
    unsteady = json.loads(json.dumps(doc))
    unsteady["scenarios"][0]["calls"][-1]["measured_calls"] += 1
    assert main(["compare", side("mixed", [doc, unsteady, doc]), before]) == 1
    assert "(differs between the before runs)" in capsys.readouterr().out


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a report"}')
    assert main(["compare", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{bad}: $: 'schema_version' is a required property"  # validated as a report
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(bad)]) == 2
    assert "no baseline files" in capsys.readouterr().err


def _errored(path: Path, scenario: Path) -> Path:
    """A report.json in which every scenario of ``scenario`` errored (a rank died before any call)."""
    from commgate.model.loader import load_paths
    from commgate.model.predict import predict
    from commgate.report.report import Report, ScenarioResult

    report = Report(path / "report.json")
    for s in load_paths([scenario]):
        report.add(ScenarioResult(prediction=predict(s), status="error", reason="rank 1 exited with status 1"))
    return path / "report.json"


def test_nothing_compared_is_not_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs whose scenarios all errored compared nothing: exit 1, and never "communicate the same"; a
    scenario that ran before and errored after is a change, not "only in before"."""
    ddp = Path(__file__).resolve().parents[1] / "scenarios" / "ddp.yaml"  # ddp-19m-dp4, as the baseline fixture
    before, after = _errored(tmp_path / "before", ddp), _errored(tmp_path / "after", ddp)
    assert main(["compare", str(before), str(after)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "ddp-19m-dp4: not compared (error on both sides)",
        "0 of 1 scenario(s) changed; 1 not compared (run on neither side): nothing compared, no scenario ran on "
        "both sides",
    ]
    ran = baseline_dir(tmp_path, "ran", "ddp.json")
    assert main(["compare", str(ran), str(after)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["ddp-19m-dp4: ran before, error after", "1 of 1 scenario(s) changed"]


def test_scenarios_on_one_side_only_are_counted_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ "3 of 3 scenario(s) changed" where two were only in the before run read as three changes of
    communication (a newcomer's walkthrough): the count says how many are on one side only."""
    a = baseline_dir(tmp_path, "a", "ddp.json")
    b = baseline_dir(tmp_path, "b", "ddp.json")
    shutil.copy(a / "gloo" / "ddp-19m-dp4.json", a / "gloo" / "other.json")
    doc = json.loads((a / "gloo" / "other.json").read_text())
    doc["scenario"] = "other"
    (a / "gloo" / "other.json").write_text(json.dumps(doc))
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "other: only in before" in out and out[-1] == "1 of 2 scenario(s) changed (1 only in before)"


DDP = Path(__file__).resolve().parents[1] / "scenarios" / "ddp.yaml"
"""ddp-19m-dp4, as the baseline fixture."""


def test_a_scenario_listed_twice_in_a_report_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The last copy won: a changed copy listed first compared as "0 of 1 scenario(s) changed"."""
    report = _errored(tmp_path / "r", DDP)
    doc = json.loads(report.read_text())
    doc["scenarios"] = doc["scenarios"] * 2
    report.write_text(json.dumps(doc))
    assert main(["compare", str(report), str(report)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        f"{report}: $.scenarios[1]: 'ddp-19m-dp4' is listed twice (also $.scenarios[0]): which run is it? Give a "
        "report that lists each scenario once, as commgate run writes it"
    )


def _report_dir(path: Path) -> Path:
    """What ``commgate run --report-dir path`` leaves (an errored scenario's report.json), without a run."""
    _errored(path, DDP)
    (path / "plots").mkdir()
    (path / "plots" / "volume.png").write_bytes(b"")
    (path / "index.html").write_text("<html></html>")
    (path / "trace.json").write_text('{"traceEvents": []}')
    return path


def test_a_report_dir_is_read_as_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compare outA outB`` of two --report-dir folders read them as baseline directories:
    "outA/report.json: $: 'scenario' is a required property"."""
    a, b = _report_dir(tmp_path / "outA"), _report_dir(tmp_path / "outB")
    assert main(["compare", str(a), str(b)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "ddp-19m-dp4: not compared (error on both sides)"
    assert main(["compare", str(baseline_dir(tmp_path, "ran", "ddp.json")), str(b)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "ddp-19m-dp4: ran before, error after",
        "1 of 1 scenario(s) changed",
    ]


def test_a_directory_holding_two_kinds_of_side_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Runs' reports beside baseline files: the baseline files were ignored without a word."""
    mixed = baseline_dir(tmp_path, "mixed", "ddp.json")
    _errored(mixed / "1", DDP)
    assert main(["compare", str(mixed), str(mixed)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"{mixed}: holds runs' reports ({mixed / '1' / 'report.json'}) and baseline files "
        f"({mixed / 'gloo' / 'ddp-19m-dp4.json'}): compare one kind at a time; give the report.json, the folder of "
        "runs or the baseline folder alone (move the others out)"
    )
    _errored(mixed, DDP)
    assert main(["compare", str(mixed), str(mixed)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{mixed}: holds a run's report ({mixed / 'report.json'}) and runs' reports (")


def test_a_baseline_file_not_where_its_scenario_keeps_it_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gloo/ddp.json`` holding ddp-19m-dp4's baseline was compared as ddp-19m-dp4: a run never reads it."""
    a = baseline_dir(tmp_path, "a", "ddp.json")
    renamed = a / "gloo" / "ddp.json"
    (a / "gloo" / "ddp-19m-dp4.json").rename(renamed)
    assert main(["compare", str(a), str(a)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"{renamed}: $.scenario: 'ddp-19m-dp4', but the file is named ddp.json: rename it ddp-19m-dp4.json (where "
        "its scenario's runs read it), or delete it if it is another scenario's"
    )
    moved = a / "nccl" / "ddp-19m-dp4.json"
    moved.parent.mkdir()
    renamed.rename(moved)
    assert main(["compare", str(a), str(a)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"{moved}: $.backend: 'gloo', but the file is in nccl/: move it to {a / 'gloo' / 'ddp-19m-dp4.json'} (where "
        "its scenario's runs read it), or delete it if it is another scenario's"
    )
    assert main(["compare", str(a / "nccl"), str(a / "nccl")]) == 0  # a folder of one backend's files: any name


def test_a_truncated_baseline_says_what_writes_it_anew(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fix said was a pytest flag (``--commgate-update-baselines``), under ``commgate compare`` too, and
    no flag rewrites a baseline that cannot be read: the gate reads it first."""
    a = baseline_dir(tmp_path, "a", "truncated.json")
    assert main(["compare", str(a), str(a)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{a / 'gloo' / 'ddp-19m-dp4.json'}:")
    assert err.endswith("; delete it: the next gated run (pytest, commgate run --gate, commgate check) writes it anew")


def test_a_baseline_directory_of_two_backends_matches_one_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The repository's ``baselines/`` holds gloo's and the emulated runs' baselines, so it names each
    scenario with its backend; a report or a one-backend directory names it alone. Nothing matched: every
    scenario was "only in" one side, and ``commgate compare baselines out`` said all had changed (found by an
    adversarial pass)."""
    both, one = baseline_dir(tmp_path, "both", "ddp.json"), baseline_dir(tmp_path, "one", "ddp.json")
    emulated = next((Path(__file__).parents[1] / "baselines" / "emulated").glob("*.json"))
    (both / "emulated").mkdir()
    shutil.copy(emulated, both / "emulated" / emulated.name)
    assert main(["compare", str(both), str(one)]) == 1  # the emulated baseline is only in before
    out = capsys.readouterr().out
    assert "ddp-19m-dp4 (gloo): unchanged" in out and "ddp-19m-dp4: only in" not in out
    assert "1 of 2 scenario(s) changed (1 only in before)" in out
    assert main(["compare", str(one), str(both)]) == 1
    assert "ddp-19m-dp4 (gloo): unchanged" in capsys.readouterr().out
