"""The ``commgate`` command line, run as a user runs it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commgate.core.units import human_bytes
from commgate.model.schemes import SCHEMES

ROOT = Path(__file__).resolve().parents[1]


def commgate(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commgate", *args], capture_output=True, text=True, cwd=cwd)


def test_the_docs_predict_examples_are_the_real_output() -> None:
    """Every ``$ commgate predict ...`` block in the docs is what that command prints now."""
    import re
    import shlex

    found = 0
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for command, shown in re.findall(r"```text\n\$ (commgate predict [^\n]*)\n(.*?)```", doc.read_text(), re.S):
            proc = commgate(*shlex.split(command)[1:])
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout == shown, f"{doc.name}: `{command}` prints something else now"
            found += 1
    assert found


def test_predict_summarises_13b_zero3_on_16_ranks_in_about_30_lines() -> None:
    summary = commgate("predict", "--model", "13B", "--scheme", "zero3", "--dp", "16")
    detail = commgate("predict", "--model", "13B", "--scheme", "zero3", "--dp", "16", "--detail")
    assert summary.returncode == detail.returncode == 0
    assert len(summary.stdout.splitlines()) <= 32 < 1000 < len(detail.stdout.splitlines())
    assert "1029 rows of the model summed; --detail lists them with their source" in summary.stdout
    assert "per step, rank 0 (from step 1 on): " in summary.stdout and "Eq. 3 (per rank)" in summary.stdout


def test_predict_reads_as_the_scheme_is_for_torch_native_schemes() -> None:
    """No ZeRO stage in the heading of a scheme DeepSpeed does not train; the eq column names the equation a
    row's calls count toward, "(part)" where some count toward none (not "-,Eq. 5")."""
    fsdp_tp = commgate("predict", "--model", "19M-cpu", "--scheme", "fsdp", "--dp", "2", "--tp", "2")
    zero3 = commgate("predict", "--model", "19M-cpu", "--scheme", "zero3", "--dp", "2")
    assert fsdp_tp.returncode == zero3.returncode == 0
    assert "zero stage" not in fsdp_tp.stdout.splitlines()[0] and "zero stage 3" in zero3.stdout.splitlines()[0]
    assert "Eq. 5 (part)" in fsdp_tp.stdout and "-,Eq" not in fsdp_tp.stdout
    # scheme pp is DeepSpeed's engine by default; torch's schedules (and Megatron's) run no ZeRO
    torch_pp = commgate("predict", str(ROOT / "scenarios" / "pp-torch-interleaved.yaml"))
    deepspeed_pp = commgate("predict", str(ROOT / "scenarios" / "pp.yaml"))
    assert "zero stage" not in torch_pp.stdout.splitlines()[0]
    assert "zero stage 0" in deepspeed_pp.stdout.splitlines()[0]


def test_predict_13b_ddp_json_reproduces_eqs_1_and_2() -> None:
    proc = commgate("predict", "--model", "13B", "--scheme", "ddp", "--dp", "16", "--json", "--detail")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["param_count_eq1"] == 13_110_159_360
    assert doc["paper_volume_elements"] == 24_581_548_800
    assert (doc["scheme"], doc["world_size"], doc["status"]) == ("ddp", 16, "predicted")
    assert all(c["unexplained_bytes"] == 0 for c in doc["paper_comparison"])
    buckets = [c for c in doc["collectives"] if c["when"] == "steps >= 1"]
    assert {(c["op"], c["group_size"]) for c in buckets} == {("all_reduce", 16)}
    assert sum(c["bytes_per_call"] for c in buckets) == 26_222_366_720


def test_predict_json_is_the_summary_unless_detail_is_asked_for() -> None:
    """`--json` makes the same choice as the tables: one row per phase, op and axis (13B ZeRO-3 on 16
    ranks: 12 rows, 7 KB, where the per-bucket rows are 1,029 and 0.7 MB); the rows sum to the detail."""
    argv = ["predict", "--model", "13B", "--scheme", "zero3", "--dp", "16", "--json"]
    short, full = commgate(*argv).stdout, commgate(*argv, "--detail").stdout
    doc, detail = json.loads(short), json.loads(full)
    assert "collectives" not in doc and len(detail["collectives"]) > 1000 and len(short) < 20_000 < len(full) // 10
    assert doc["summary"] == detail["summary"] and doc["totals"] == detail["totals"]
    for key in ("calls_per_step", "bytes_per_step", "wire_bytes_per_step"):
        assert sum(r[key] for r in doc["summary"]) == pytest.approx(sum(c[key] for c in detail["collectives"]))
    assert sum(r["rows"] for r in doc["summary"]) == len(detail["collectives"])
    text = commgate(*argv[:-1]).stdout  # the table's rank-0 line is the JSON's rank-0 total
    rank0 = human_bytes(doc["totals"]["rank0_bytes_per_step"])
    assert f"per step, rank 0 (from step 1 on): {rank0} in messages" in text


def test_predict_13b_zero3_json_reproduces_eq_3() -> None:
    doc = json.loads(commgate("predict", "--model", "13B", "--scheme", "zero3", "--dp", "16", "--json").stdout)
    assert doc["paper_volume_elements"] == 36_872_323_200


def test_predict_does_not_import_torch_or_deepspeed() -> None:
    code = (
        "import sys; from commgate.cli import main; "
        "rc = main(['predict', '--model', '19M-cpu', '--scheme', '3d', '--dp', '2', '--tp', '2', '--pp', '2']); "
        "assert rc == 0; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_predict_default_suite_writes_a_report(tmp_path: Path) -> None:
    proc = commgate("predict", "--report-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "scenario(s) predicted" in proc.stdout and "Eq. 2" in proc.stdout
    doc = json.loads((tmp_path / "out" / "predictions.json").read_text())
    assert doc["schema_version"] == 1
    assert {p["scheme"] for p in doc["predictions"]} == set(SCHEMES)
    assert not list((tmp_path / "out").glob(".*tmp"))


def test_predict_matrix_in_json() -> None:
    doc = json.loads(
        commgate("predict", "--model", "19M-cpu", "--scheme", "pp", "--pp", "2", "--json", "--matrix").stdout
    )
    assert {(e["src"], e["dst"]) for e in doc["traffic_matrix"]} == {(0, 1), (1, 0)}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["predict", "--model", "13B"], "--model needs --scheme"),
        (["predict", "--scheme", "ddp"], "--scheme needs --model"),
        (["predict", "scenarios", "--model", "13B", "--scheme", "ddp"], "not both"),
        (["predict", "scenarios/ddp.yaml", "--dp", "8", "--checkpointing"], "(--dp, --checkpointing), not both"),
        (["predict", "--dp", "8"], "a scenario by flags needs --model PRESET"),
        # a flag given at its default value was taken as not given, and silently ignored (an adversarial pass)
        (["predict", "scenarios/ddp.yaml", "--dp", "1"], "(--dp), not both"),
        (["predict", "scenarios/ddp.yaml", "--micro-batches", "1"], "(--micro-batches), not both"),
        (["predict", "--model", "19M", "--scheme", "zero3", "--dp", "2", "--ep", "4"], "--ep needs --experts N"),
        (["predict", "--report-dir", ""], "argument --report-dir: an empty path (an unset variable?)"),
        (["run", "scenarios/ddp.yaml", "--report-dir", ""], "argument --report-dir: an empty path"),
        (["run", "scenarios/ddp.yaml", "--deadline", "nan"], "--deadline nan: expected a positive, finite number"),
        (["html", "README.md", "--out", ""], "argument --out: an empty path"),
        (["capture", "-o", "", "--", "true"], "argument -o/--out: an empty path"),
        (["capture", "-o", "scenarios", "--", "true"], "capture: scenarios is a directory that is not empty"),
        (
            ["capture", "-o", "README.md/cap", "--", "true"],
            "README.md/cap: cannot write the capture there: README.md is not a directory; give another -o",
        ),  # a traceback (an adversarial pass)
        (["init", "--preset", "19M-cpu", "--schemes", ","], "--schemes ',': name one scheme or more"),
        (["init", "--preset", "13b"], "--preset '13b': not a model preset; did you mean '13B'?"),
        (["import", "--neox", "tests/data/neox/13B.yml", "-o", "tests/data/neox/13B.yml"], "is the --neox input"),
        (["import", "--neox", "tests/data/neox/13B.yml", "-o", "scenarios/ddp.yaml"], "exists: give --force"),
        # a file the gate never reads (found by an adversarial pass)
        (["import", "--neox", "tests/data/neox/13B.yml", "-o", "x.json"], "-o x.json: not a .yaml or .yml file"),
        (["import", "--neox", "tests/data/neox/13B.yml", "-o", "noext"], "never read as a scenario; give noext.yaml"),
        # an empty argument (an unset variable) was the working directory, or the default name
        (["validate", ""], "argument paths: an empty path (an unset variable?)"),
        (["compare", "a", "b", "--latency-factor", "-1"], "--latency-factor -1: give a factor above 1"),
        # the flag the user typed, not a JSON path or another flag (found by an adversarial pass)
        (["predict", "--model", "", "--scheme", "ddp"], "argument --model: empty (an unset variable?)"),
        (
            ["predict", "--model", "19M-cpu", "--scheme", "ddp", "--dp", "2", "--reshard-after-forward", "true"],
            "--param-dtype/--reduce-dtype/--reshard-after-forward: FSDP2 options need scheme 'fsdp'",
        ),
        (["compare", "a", "b", "--min-runs", "0"], "--min-runs 0: give 1 to 100 runs"),
        (["run", "", "-k", "x"], "argument paths: an empty path (an unset variable?)"),
        (["check", "tests", "--name", ""], "argument --name: empty (an unset variable?)"),
        (["import", "--neox", "tests/data/neox/13B.yml", "--name", ""], "argument --name: empty"),
        (["predict", "--model", "13B", "--scheme", "tp", "--tp", "3"], "heads a=40 are not divisible by tp"),
        (["predict", "--model", "7B", "--scheme", "ddp", "--dp", "2"], '"7B" is not one of'),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(args: list[str], message: str) -> None:
    proc = commgate(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_an_imported_scenario_refused_for_its_ranks_names_the_dp_flag(tmp_path: Path) -> None:
    """``import`` with ``--dp`` left at its default (1) or given out of range: the refusal named
    ``$.parallelism.dp``, not the flag that sets it (found by an adversarial pass)."""
    proc = commgate(
        "import", "--neox", str(ROOT / "tests/data/neox/13B.yml"), "--dp", "-2", "-o", "a.yaml", cwd=tmp_path
    )
    assert proc.returncode == 2 and not (tmp_path / "a.yaml").exists()
    last = proc.stderr.strip().splitlines()[-1]  # after the notes on what the config sets
    assert last.startswith(
        "commgate: error: a.yaml not written: the imported scenario is refused: --dp ($.parallelism.dp): -2"
    )


def test_predict_without_scenarios_here_explains(tmp_path: Path) -> None:
    proc = commgate("predict", cwd=tmp_path)
    assert proc.returncode == 2 and "no scenarios here: ./scenarios not found" in proc.stderr
    assert "(or --model/--scheme)" in proc.stderr


def test_validate_and_presets() -> None:
    proc = commgate("validate")
    assert proc.returncode == 0 and "scenario(s) valid" in proc.stdout
    proc = commgate("presets")
    assert proc.returncode == 0 and "13,111,183,360" in proc.stdout and "19M-cpu" in proc.stdout
    # a column a row: each value ends where its header does (llama3.2-1B pushed its row off by one)
    head, *rows = proc.stdout.splitlines()
    ends = [head.index(name) + len(name) for name in (" L", " h", " a", " V", " s", "parameters")]
    for row in rows:
        assert all(row[end - 1] != " " and (end == len(row) or row[end] == " ") for end in ends), row


SMALL = "schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu}}\nparallelism: {{scheme: ddp, dp: 2}}\nsteps: 2\n"


@pytest.mark.parametrize("where", ["file", "file/sub", "dangling"])
@pytest.mark.parametrize("flag", ["--report-dir", "--baseline-dir"])
def test_run_refuses_a_directory_it_cannot_write_before_any_rank_starts(tmp_path: Path, flag: str, where: str) -> None:
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    proc = commgate("run", "g.yaml", "--gate", flag, where, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""  # no scenario started
    if (flag, where) == ("--baseline-dir", "file"):  # refused with every entry point's options, as a file
        assert proc.stderr == "commgate: error: --baseline-dir file: not a directory; give a directory of baselines\n"
    else:
        assert proc.stderr.startswith(f"{where}: cannot write ") and proc.stderr.endswith(f"; give another {flag}\n")
    assert len(proc.stderr.splitlines()) == 1


def test_a_file_where_the_backend_s_baseline_folder_goes_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    """``baselines/gloo`` a file: the ranks ran, and the scenario's error came after (found by an adversarial
    pass); the probe before any rank starts now looks at the folder of each backend the scenarios run on."""
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "gloo").write_text("x\n")
    proc = commgate("run", "g.yaml", "--gate", "--baseline-dir", "b", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout  # no scenario started
    assert proc.stderr == (
        "b/gloo: not a directory, where commgate keeps the gloo baselines; remove it, or give another baseline "
        "directory\n"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only working directory: nothing to refuse")
def test_gate_in_a_read_only_working_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    tmp_path.chmod(0o500)
    try:
        proc = commgate("run", "g.yaml", "--gate", cwd=tmp_path)
    finally:
        tmp_path.chmod(0o700)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "baselines: cannot write baselines there (Permission denied); give another --baseline-dir\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_a_run_stopped_by_sigterm_keeps_a_report_marked_interrupted(tmp_path: Path, signum: int) -> None:
    """The first scenario finishes (skipped here: it needs a GPU), the second never ends by itself (rank 1
    wedged); SIGTERM once it has begun: report.json holds the first and says the run was interrupted. So does
    SIGHUP (a closed terminal, a dropped ssh), which killed the run outright, its report saying "passed"
    (found by an adversarial pass)."""
    (tmp_path / "a.yaml").write_text(SMALL.format(name="a") + "markers: [gpu]\n")
    wedged = "workload: commgate.run.workloads.faults:wedge\ndeadline_s: 600\n"
    (tmp_path / "b.yaml").write_text(SMALL.format(name="b") + wedged)
    argv = [sys.executable, "-m", "commgate", "run", "a.yaml", "b.yaml", "--report-dir", "out"]
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[2/2] b:"):
                break
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and err.endswith("commgate: interrupted\n")
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["a"]
    assert doc["interrupted"] == f"{signal.Signals(signum).name} during b, scenario 2 of 2; 1 scenario(s) had finished"
    assert (
        f"interrupted ({signal.Signals(signum).name} during b, scenario 2 of 2; 1 scenario(s) had finished): 0 passed"
        in out
    )


def test_ctrl_c_twice_still_leaves_this_run_s_report_marked_interrupted(tmp_path: Path) -> None:
    """A second SIGINT while the first unwound (Ctrl-C pressed twice, or a wrapper forwarding the terminal's) broke
    off the clean-up: the previous run's report.json stayed, unmarked, a traceback from the at-exit hook followed,
    and the forkserver outlived the command (found by an adversarial pass). Later signals wait for it now."""
    wedged = "workload: commgate.run.workloads.faults:wedge\ndeadline_s: 600\n"
    (tmp_path / "b.yaml").write_text(SMALL.format(name="b") + wedged)
    (tmp_path / "out").mkdir()
    stale = '{"scenarios": [], "summary": {"passed": 7}}\n'
    (tmp_path / "out" / "report.json").write_text(stale)  # an earlier run's, with its page and trace
    (tmp_path / "out" / "index.html").write_text("<title>commgate report</title> the earlier run: 7 passed")
    (tmp_path / "out" / "trace.json").write_text('{"otherData": {"source": "commgate"}}')
    argv = [sys.executable, "-m", "commgate", "run", "b.yaml", "--report-dir", "out"]
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[1/1] b:"):
                break
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.02)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "commgate: interrupted" in err.splitlines(), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["interrupted"] == "Ctrl-C during b, scenario 1 of 1; 0 scenario(s) had finished", doc
    assert "interrupted (Ctrl-C during b, scenario 1 of 1; 0 scenario(s) had finished)" in out
    page = (tmp_path / "out" / "index.html").read_text()  # this run's, saying so, not the earlier run's
    assert "the earlier run" not in page and "interrupted: Ctrl-C during b, scenario 1 of 1" in page
    assert json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"] == []


@pytest.mark.skipif(any(Path("/dev").glob("nvidia[0-9]*")), reason="ranks on GPUs take DeepSpeed's GPU accelerators")
def test_a_bad_deepspeed_accelerator_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    env = os.environ | {"DS_ACCELERATOR": "garbage"}
    proc = subprocess.run([sys.executable, "-m", "commgate", "run", "g.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert (
        "g: DS_ACCELERATOR 'garbage': local ranks on this machine (no GPU) run DeepSpeed on its CPU accelerator; "
        "unset it or set it to cpu" in proc.stdout
    )


def test_a_bad_torchrun_variable_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    torchrun = {"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = subprocess.run([sys.executable, "-m", "commgate", "run", "g.yaml"], cwd=tmp_path, env=os.environ | torchrun,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr == "commgate: error: environment variable RANK 'x': expected a whole number (torchrun sets it "
        "for each rank); unset it or set it right\n"
    )


def test_an_empty_or_bad_html_out_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """``html --out FILE`` was a traceback (NotADirectoryError) (found by an adversarial pass)."""
    target = tmp_path / "page.html"
    target.write_text("mine")
    proc = commgate("html", str(ROOT / "README.md"), "--out", str(target))  # the out directory is checked first
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{target}: cannot write the HTML page there: {target} is not a directory; give another --out" in proc.stderr
    assert target.read_text() == "mine"


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("COMMGATE_FORKSERVER_START_S", "abc", "'abc' is not a number of seconds"),
        ("COMMGATE_FORKSERVER_START_S", "nan", "nan: expected a positive, finite number of seconds"),
        ("COMMGATE_STAMPS", "maybe", "expected one of 1, true, yes, on, 0, false, no, off"),
    ],
)
def test_a_bad_environment_variable_is_one_line_before_anything_runs(name: str, value: str, says: str) -> None:
    """``COMMGATE_FORKSERVER_START_S=abc`` was a traceback after the run had started; ``COMMGATE_STAMPS=false``
    left the stamps on (only "0" turned them off) (found by an adversarial pass)."""
    env = {**os.environ, name: value}
    proc = subprocess.run(
        [sys.executable, "-m", "commgate", "run", "scenarios/ddp.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    from commgate.core.env import VARIABLES

    means = next(v.means for v in VARIABLES if v.name == name)
    assert (
        proc.stderr.strip() == f"commgate: error: environment variable {name}={value!r}: {says}; {means}, or unset it"
    )


def test_a_switch_reads_every_spelling_of_off() -> None:
    from commgate.core import env

    for word, on in [("0", False), ("false", False), ("No", False), ("off", False), ("1", True), ("TRUE", True)]:
        os.environ["COMMGATE_STAMPS"] = word
        try:
            assert env.switch("COMMGATE_STAMPS", True) is on, word
        finally:
            del os.environ["COMMGATE_STAMPS"]
    assert env.switch("COMMGATE_STAMPS", True) is True


def test_capture_leaves_no_directory_for_a_command_that_never_started(tmp_path: Path) -> None:
    proc = commgate("capture", "-o", str(tmp_path / "cap"), "--", str(tmp_path / "no-such-command"))
    assert proc.returncode != 0
    assert not (tmp_path / "cap").exists()


def test_import_replaces_an_existing_scenario_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "s.yaml"
    out.write_text("mine\n")
    neox = str(ROOT / "tests" / "data" / "neox" / "13B.yml")
    assert commgate("import", "--neox", neox, "--dp", "8", "-o", str(out)).returncode == 2
    assert out.read_text() == "mine\n"
    done = commgate("import", "--neox", neox, "--dp", "8", "-o", str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("# written by commgate import")


def test_init_from_a_config_json_says_what_its_import_left_out(tmp_path: Path) -> None:
    """``init --hf`` dropped the import's notes: a key ignored or defaulted went unsaid (found by a review)."""
    config = ROOT / "tests" / "data" / "hf" / "tinyllama-1.1b.json"
    done = commgate("init", "--hf", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"note: {config}: rope_theta ignored" in done.stdout.splitlines()


def test_a_traffic_matrix_too_wide_to_draw_lists_its_heaviest_pairs() -> None:
    """The text matrix grew with dp squared (42 MB of text at dp 2048; no end at dp 1048576): beyond 32 ranks
    its heaviest pairs are listed instead (found by an adversarial pass)."""
    drawn = commgate("predict", "--model", "19M-cpu", "--scheme", "ddp", "--dp", "32", "--matrix")
    listed = commgate("predict", "--model", "19M-cpu", "--scheme", "ddp", "--dp", "4096", "--matrix")
    assert drawn.returncode == listed.returncode == 0, listed.stderr
    assert "src\\dst" in drawn.stdout and "more than 32 to draw" not in drawn.stdout
    assert "4,096 ranks, more than 32 to draw; 4,096 rank pairs exchange bytes, the 20 heaviest" in listed.stdout
    assert "0 -> 1: " in listed.stdout and len(listed.stdout.splitlines()) < len(drawn.stdout.splitlines()) + 40


@pytest.mark.parametrize(("name", "kind"), [("plots", "file"), ("index.html", "dir"), ("plots/traffic.png", "dir")])
def test_an_output_of_the_wrong_kind_in_the_report_folder_is_one_line_before_anything_runs(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A file named ``plots`` in the report folder was a traceback (FileExistsError) after the scenarios had
    run, ``index.html`` a directory an error after trace.json and the figures were written (found by an
    adversarial pass): the folder is writable, what commgate writes into it is not."""
    from commgate.report.plots import PLOTS

    name = name if name != "plots/traffic.png" else f"plots/{PLOTS[0][2]}"
    out = tmp_path / "out"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        (out / name).write_text("mine")
    else:
        (out / name).mkdir()
    (tmp_path / "g.yaml").write_text(SMALL.format(name="g"))
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    ran = commgate("run", "g.yaml", "--report-dir", str(out), cwd=tmp_path)
    what = "not a directory, and commgate writes into a directory there" if kind == "file" else "a directory where"
    assert ran.returncode == 2 and ran.stdout == "" and "Traceback" not in ran.stderr, ran.stdout + ran.stderr
    assert f"{out / name}: {what}" in ran.stderr and "give another --report-dir" in ran.stderr
    page = commgate("html", str(ROOT / "README.md"), "--out", str(out))  # the folder is checked first
    assert page.returncode == 2 and "Traceback" not in page.stderr, page.stderr
    assert f"{out / name}: {what}" in page.stderr and "give another --out" in page.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("-k", ""), "-k '': an empty selection matches every scenario"),
        (("-k", "ddp", "-k", " "), "-k '': an empty selection matches every scenario"),
        (("--link", ""), "--link '': give a rate (e.g. 10gbit), or no --link"),
        (("--emulate", "--link", "10gbit"), "--emulate with --link 10gbit: a shaped link joins two halves"),
    ],
)
def test_run_arguments_that_cannot_mean_what_they_say_are_refused(args: tuple[str, ...], says: str) -> None:
    """``-k ""`` (an unset $SEL) started the whole suite; ``--emulate --link 10gbit`` skipped every scenario and
    exited 0 (found by an adversarial pass)."""
    proc = commgate("run", "scenarios/ddp.yaml", *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_stale_torchrun_variables_say_what_the_run_waits_for_and_a_sigterm_stops_it() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT left over from another job made ``commgate
    run`` wait 300 s in silence for ranks that never come, deaf to SIGTERM and Ctrl-C (the wait was in
    C++; found by an adversarial pass): it says what it waits for and why, and stops when told."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stale = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = [sys.executable, "-m", "commgate", "run", "scenarios/ddp.yaml"]
    with subprocess.Popen(argv, cwd=ROOT, env=os.environ | stale, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()  # the wait's line, 15 s into it
            assert f"commgate: waiting for the job's 4 ranks at 127.0.0.1:{port}" in line and "unset them" in line
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=200)  # deaf to it, it would wait out the store's 300 s
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted (SIGTERM during ddp-19m-dp4" in out, out + err


def test_two_runs_into_one_report_directory_are_refused(tmp_path: Path) -> None:
    """Two ``commgate run --report-dir out`` at once: the directory's report said "1 passed" while the other
    run had failed (found by an adversarial pass). The second is refused while the first runs."""
    (tmp_path / "b.yaml").write_text(SMALL.format(name="b") + "workload: commgate.run.workloads.faults:wedge\n")
    argv = [sys.executable, "-m", "commgate", "run", "b.yaml", "--report-dir", "out", "--deadline", "600"]
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as first:  # fmt: skip
        try:
            assert first.stdout is not None
            assert first.stdout.readline().startswith("[1/1] b:")  # it holds the directory now
            second = commgate("run", "b.yaml", "--report-dir", "out", cwd=tmp_path)
        finally:
            os.killpg(first.pid, signal.SIGTERM)
            first.communicate(timeout=300)
    assert second.returncode == 2 and second.stdout == "", second.stdout + second.stderr
    assert f"--report-dir out: another commgate run (pid {first.pid}) is writing its report there" in second.stderr


def test_a_reader_that_goes_away_leaves_the_run_whole_and_its_status_true(tmp_path: Path) -> None:
    """``commgate run a.yaml b.yaml --report-dir out | head -1``: the broken pipe at the second line ended the
    run there, with exit 0, b never run and the report missing or saying "1 passed" (found by an adversarial
    pass). The run goes on to its end; only its output is dropped."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(SMALL.format(name=name))
    argv = [sys.executable, "-m", "commgate", "run", "a.yaml", "b.yaml", "--report-dir", "out"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith(b"[1/2] a:")
        proc.stdout.close()  # as head does after its line
        err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["a", "b"] and doc["summary"]["passed"] == 2
    assert (tmp_path / "out" / "index.html").exists()


@pytest.mark.parametrize("where", ["a pipe its reader closed", "/dev/full", "a closed descriptor"])
def test_output_that_cannot_be_written_is_one_line_and_the_status_says_so(where: str) -> None:
    """``commgate presets | true`` (buffered output: the write fails at exit) was exit 120 with "Exception
    ignored ... BrokenPipeError"; ``> /dev/full`` a traceback, exit 1; ``>&-`` exit 0 with the output lost in
    silence. A reader that left wanted no more: exit 0, nothing said. Otherwise one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [sys.executable, "-m", "commgate", "presets"]
    if where == "a pipe its reader closed":
        read, write = os.pipe()
        os.close(read)
        try:
            proc = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        finally:
            os.close(write)
        assert (proc.returncode, proc.stderr) == (0, "")
        return
    if where == "/dev/full":
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full on this system")
        with open("/dev/full", "w") as full:
            proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        says = "commgate: cannot write to standard output (No space left on device); the output was lost"
    else:
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                              preexec_fn=lambda: os.close(1))  # fmt: skip
        says = "commgate: standard output is closed; the output was lost"
    assert proc.returncode == 2 and proc.stderr.startswith(says), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_run_with_stdout_or_stderr_closed_runs_its_scenarios(tmp_path: Path, closed: int) -> None:
    """``commgate run ... >&-``: the forkserver and the ranks took the closed descriptor's number for a file or a
    socket, and every scenario was an error (advice: wait longer for the forkserver); ``2>&-``: exit 1 in
    silence, no report (found by an adversarial pass). The run is whole; a closed stdout is still said."""
    (tmp_path / "a.yaml").write_text(SMALL.format(name="a"))
    argv = [sys.executable, "-m", "commgate", "run", "a.yaml", "--report-dir", "out"]
    with open(tmp_path / "said.txt", "w") as said:
        proc = subprocess.run(argv, cwd=tmp_path, stdout=said if closed == 2 else subprocess.DEVNULL,
                              stderr=said if closed == 1 else subprocess.DEVNULL, timeout=600,
                              preexec_fn=lambda: os.close(closed))  # fmt: skip
    text = (tmp_path / "said.txt").read_text()
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in doc["scenarios"]] == [("a", "passed")], doc["scenarios"]
    if closed == 1:
        assert proc.returncode == 2
        assert text == "commgate: standard output is closed; the output was lost from there on\n"
    else:
        assert proc.returncode == 0 and "PASSED  a" in text, text


def test_a_path_the_output_s_encoding_cannot_show_is_escaped_not_a_traceback(tmp_path: Path) -> None:
    """``PYTHONIOENCODING=ascii commgate validate 'dir/ü'``: a UnicodeEncodeError traceback, exit 1 (a passing run
    too, at its last line; found by an adversarial pass). Escaped, as Python's stderr escapes it."""
    (tmp_path / "ü").mkdir()
    (tmp_path / "ü" / "a.yaml").write_text(SMALL.format(name="a"))
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    proc = subprocess.run([sys.executable, "-m", "commgate", "validate", "ü"], cwd=tmp_path, env=env,
                          capture_output=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    assert b"\\xfc/a.yaml" in proc.stdout, proc.stdout


def test_a_working_directory_that_was_removed_is_one_line(tmp_path: Path) -> None:
    """``validate`` with no argument, run from a directory deleted meanwhile: a FileNotFoundError traceback."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (
        f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        "from commgate.cli import main; sys.exit(main(['validate']))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert (
        proc.returncode == 2
        and proc.stderr == "commgate: error: the working directory no longer exists; cd into one that does\n"
    )


def test_a_dumb_terminal_gets_no_line_rewritten_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """On ``TERM=dumb`` (Emacs' shell, some CI consoles) the live line's ``\\r\\033[K`` showed as garbage."""
    import io

    from commgate.report.liveline import LiveLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("TERM", "dumb")
    out = Terminal()
    LiveLine(out)("step 1 of 3")
    assert "\033" not in out.getvalue() and "\r" not in out.getvalue()
    monkeypatch.setenv("TERM", "xterm")
    LiveLine(out)("step 1 of 3")
    assert "\r\033[K" in out.getvalue()


def test_a_forkserver_that_raises_at_its_start_is_named_by_what_it_raised(tmp_path: Path) -> None:
    """A cache directory the forkserver cannot create (``~/.cache/commgate`` a file; a read-only HOME;
    ``PYTHONWARNINGS=error``) said "set COMMGATE_FORKSERVER_START_S to wait longer", the real cause only in
    its log (found by an adversarial pass). The error names what it raised."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "commgate").write_text("a file where commgate keeps its cache\n")
    (tmp_path / "a.yaml").write_text(SMALL.format(name="a"))
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR")}
    env["HOME"] = str(home)  # the environment's build directory under it: ~/.cache/commgate/torch_extensions
    proc = subprocess.run([sys.executable, "-m", "commgate", "run", "a.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the ranks' forkserver exited while starting" in proc.stdout
    assert "it raised NotADirectoryError" in proc.stdout and "wait longer" not in proc.stdout, proc.stdout


def test_predict_at_the_largest_world_lists_each_row_s_group_in_brief_and_sums_rows_per_group() -> None:
    """13B ZeRO-3 at the schema's largest dp, 1,048,576: ``predict --json`` took 59 s and 8.5 GB for a 7.6 KB
    document, each of its thousand rows listing a million ranks (found by an adversarial pass); a row's
    ``first_group`` lists at most 64 ranks now, its ``group_size`` saying how many. The traffic matrix sums the
    rows of one op and group before spreading them over the pairs: the same matrix, pair for pair, as the rows
    spread one by one."""
    from fractions import Fraction

    from commgate.model.collectives import add_traffic
    from commgate.model.loader import load_document
    from commgate.model.predict import predict
    from commgate.report.render import FIRST_GROUP_RANKS, prediction_document

    doc = {
        "schema_version": 1,
        "name": "big",
        "model": {"preset": "13B"},
        "parallelism": {"scheme": "zero3", "dp": 4096},
    }
    (s,) = load_document(doc, file="<test>")
    p = predict(s)
    rows = prediction_document(p)["collectives"]
    assert rows and all(len(r["first_group"]) == min(r["group_size"], FIRST_GROUP_RANKS) for r in rows)
    assert any(r["group_size"] == 4096 for r in rows)
    one_by_one: dict[tuple[int, int], Fraction] = {}
    for c in p.steady:
        for g in c.groups if c.wire_bytes_per_step else ():
            add_traffic(c.op, g, c.wire_bytes_per_step, one_by_one)
    assert p.traffic_matrix() == one_by_one and list(p.traffic_matrix()) == list(one_by_one)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--scheme", "zero3", "--dp", "1"], "--dp: 1: scheme 'zero3' needs dp >= 2"),
        (["--scheme", "zero3", "--dp", "8", "--seq", "0"], "--seq: 0 is out of range, expected a value >= 1"),
        (["--scheme", "ddp", "--dp", "2", "--hpz", "2"], "--hpz/--qwz/--qgz: ZeRO++ options (hpz, qwz, qgz) need"),
        (["--scheme", "fsdp", "--dp", "2", "--micro-batch", "0"], "--micro-batch: 0 is out of range"),
    ],
    ids=["dp", "seq", "zero++", "micro-batch"],
)
def test_a_scenario_by_flags_is_refused_naming_the_flag(
    flags: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It named the document made of the flags ("<command line>: $.parallelism.dp: 1: ..."), a path the
    user never wrote (found by an adversarial pass): one line naming the flag."""
    from commgate.cli import main

    assert main(["predict", "--model", "13B", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"commgate: error: {line}" + err.split(line, 1)[1] and err.count("\n") == 1 and "$." not in err, err


def test_a_baseline_dir_that_is_a_file_is_refused_by_every_entry_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run --baseline-dir FILE`` without ``--gate`` was accepted in silence, and the report then named the file
    as the place for bandwidth curves (found by an adversarial pass); pytest's option refused it. Refused where
    every entry point's options are checked, before any rank starts."""
    from commgate.cli import main

    scenario = tmp_path / "s.yaml"
    scenario.write_text("schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    for gate in ([], ["--gate"]):
        assert main(["run", str(scenario), "--baseline-dir", str(scenario), *gate]) == 2
        err = capsys.readouterr().err
        assert err == f"commgate: error: --baseline-dir {scenario}: not a directory; give a directory of baselines\n"
    assert not (tmp_path / "out").exists()
