"""The HTML report, its plots and the Chrome trace, from a real `commgate run` (DDP and a pipeline
sequence-length sweep), and the time model's fields in report.json."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from commgate.cli import main
from commgate.report.report import validate

ROOT = Path(__file__).parents[1]
SCENARIOS = {
    "d.yaml": (
        "schema_version: 1\nname: d\nmodel: {preset: 19M-cpu, s: 64}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"
    ),
    "p.yaml": (
        "schema_version: 1\nname: p\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: pp, pp: 2, micro_batches: 2}\n"
        "steps: 2\nsweep: {model.s: [32, 64]}\n"
    ),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("html")
    for name, text in SCENARIOS.items():
        (tmp / name).write_text(text)
    argv = [sys.executable, "-m", "commgate", "run", *(str(tmp / f) for f in SCENARIOS)]
    argv += ["--report-dir", str(tmp / "out"), "--baseline-dir", str(ROOT / "baselines")]
    run = subprocess.run(argv, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "index.html" in run.stdout.splitlines()[-1]
    return tmp / "out"


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_page_shows_every_plot_it_wrote_and_every_scenario_in_detail(out: Path) -> None:
    page = (out / "index.html").read_text()
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    drawn = ["volume.png", "predicted_vs_measured.png", "time_model.png", "sequence_length.png", "sweeps.png"]
    assert sorted(pngs) == sorted(drawn)  # p's s-sweep: the sequence-length figure (Anthony et al., Figs. 14-15)
    assert "Volume against sequence length, per scheme" in page
    for name in pngs:
        assert f'src="plots/{name}"' in page
        assert is_png(out / "plots" / name), name
    for slug, name in (("d", "d"), ("p_s_32_", "p[s=32]"), ("p_s_64_", "p[s=64]")):
        block = page[page.index(f'<details id="d-{slug}">') :]
        block = block[: block.index("</details>")]
        assert f'<a href="#d-{slug}">{name}</a>' in page  # the table links every scenario to its figures
        assert f'aria-label="timeline of {name}"' in block and f'aria-label="message sizes of {name}"' in block
        assert block.count('<table class="tm">') == 3  # predicted, measured, difference
        assert "difference: 0 everywhere" in block
    assert "3 passed" in page and "every byte explained" in page
    assert not list(out.rglob(".*.tmp"))  # nothing half-written


def test_report_json_carries_the_time_model_next_to_the_measurement(out: Path) -> None:
    doc = json.loads((out / "report.json").read_text())
    validate(doc)
    for s in doc["scenarios"]:
        frac = s["comm_fraction"]
        assert 0 < frac["measured"] < 1 and 0 < frac["predicted"] < 1
        tm = s["time_model"]
        assert "bandwidth curve" in tm["note"]
        p = tm["predicted"]
        comm = p["t_tp_s"] + p["t_pp_s"] + p["t_dp_s"] + p["t_ep_s"]
        assert p["t_comm_s"] == pytest.approx(comm) and 0 <= p["t_exposed_s"] <= p["t_comm_s"]
        assert p["t_iter_s"] == pytest.approx(p["t_comp_s"] + p["t_exposed_s"] + p["t_bubble_s"])
        assert tm["comm_fraction_error"] == pytest.approx(frac["predicted"] - frac["measured"])
        assert tm["errors"]["comm_fraction"] == tm["comm_fraction_error"]
        m = tm["measured"]
        assert tm["errors"]["t_iter"] == pytest.approx((p["t_iter_s"] - m["t_iter_s"]) / m["t_iter_s"])
        assert m["steps"] == 2 and 0 <= m["t_exposed_s"] <= m["t_iter_s"] and m["t_comm_s"] <= m["t_iter_s"]
        windows = s["capture"]["step_windows"]
        assert sorted({(w["rank"], w["step"]) for w in windows}) == [(r, k) for r in range(2) for k in range(3)]
    pp = [s for s in doc["scenarios"] if s["scheme"] == "pp"]
    assert all(s["time_model"]["predicted"]["bubble_ratio"] > 0 for s in pp)  # (p-1)/(p-1+m) with p=2, m=2
    assert all(s["time_model"]["predicted"]["t_pp_s"] > 0 and s["time_model"]["predicted"]["t_dp_s"] == 0 for s in pp)


def test_the_trace_has_every_completed_call_and_step(out: Path) -> None:
    doc = json.loads((out / "report.json").read_text())
    events: list[dict[str, Any]] = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {s["name"] for s in doc["scenarios"]}
    calls = sum(1 for s in doc["scenarios"] for c in s["capture"]["calls"] if c["duration_ns"] is not None)
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] != "step") == calls
    steps = sum(len(s["capture"]["step_windows"]) for s in doc["scenarios"])
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] == "step") == steps
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")


def test_commgate_html_re_renders_a_saved_report(out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["html", str(out / "report.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "index.html").exists() and is_png(tmp_path / "again" / "plots" / "volume.png")
    # the report's directory, as compare takes it ("a directory, not a file" before: an adversarial pass)
    assert main(["html", str(out), "--out", str(tmp_path / "from-dir")]) == 0
    assert (tmp_path / "from-dir" / "index.html").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1}))
    capsys.readouterr()
    assert main(["html", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{bad}: $: ") and "required property" in err and "\n" not in err
    newer = tmp_path / "newer.json"  # "1 was expected" did not say a newer commgate wrote it (an adversarial pass),
    written = {"schema_version": 2, "a_field_it_added": 1}  # nor did the unknown field a newer one writes
    newer.write_text(json.dumps(json.loads((out / "report.json").read_text()) | written))
    assert main(["html", str(newer)]) == 2
    assert (
        capsys.readouterr().err
        == f"{newer}: $.schema_version: 2 is newer than this commgate reads (1); upgrade commgate\n"
    )


def test_commgate_html_keeps_out_of_another_report_s_directory(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` naming another run's report directory replaced its index.html with this report's, beside the
    report.json it no longer described (found by an adversarial pass); the report's own directory is fine."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "report.json").write_text("{}")
    (other / "index.html").write_text("<title>commgate report</title> the other run's page")
    assert main(["html", str(out / "report.json"), "--out", str(other)]) == 2
    assert "holds another report (report.json)" in capsys.readouterr().err
    assert (other / "index.html").read_text() == "<title>commgate report</title> the other run's page"
    assert main(["html", str(out / "report.json"), "--out", str(out)]) == 0
    assert main(["html", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("name", ["index.html", "trace.json"])
def test_a_page_commgate_did_not_write_is_never_replaced(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """``html --out site`` (and ``run --report-dir site``) replaced a site's own index.html and trace.json without
    a word (found by an adversarial pass); commgate's own, from an earlier run, it replaces."""
    site = tmp_path / "site"
    site.mkdir()
    (site / name).write_text("MY OWN SITE\n")
    assert main(["html", str(out / "report.json"), "--out", str(site)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{site / name}: not a page commgate wrote (") and err.endswith("give another --out\n")
    assert (site / name).read_text() == "MY OWN SITE\n" and not (site / "plots").exists()
    scenario = tmp_path / "g.yaml"
    scenario.write_text("schema_version: 1\nname: g\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    assert main(["run", str(scenario), "--report-dir", str(site)]) == 2  # before any rank starts
    assert f"{site / name}: not a page commgate wrote (" in capsys.readouterr().err
    assert main(["html", str(out / "report.json"), "--out", str(out)]) == 0  # its own, written before
    assert main(["html", str(out / "report.json"), "--out", str(out)]) == 0


def test_a_failing_scenario_shows_why_and_no_success_badge(out: Path) -> None:
    """The page never claims success when a scenario failed; each failure, error and skip shows its
    findings or reason, linked from the table."""
    from commgate.report.htmlreport import page

    doc = json.loads((out / "report.json").read_text())
    failed, skipped = doc["scenarios"][0], doc["scenarios"][1]
    failed["status"] = "failed"
    failed["findings"] = [
        {
            "kind": "baseline",
            "fail": True,
            "title": "communication differs from the baseline",
            "lines": ["calls [steps] all_reduce fp32 4 B forward group [0, 1]: obtained 4, expected 0 (+4)"],
            "hint": "if the change is intended, accept it with --commgate-update-baselines",
            "differences": [
                {
                    "what": "calls [steps] all_reduce fp32 4 B forward group [0, 1]",
                    "obtained": 4,
                    "expected": 0,
                    "unit": "",
                    "difference": 4,
                    "detail": "",
                }
            ],
        }
    ]
    skipped.update(status="skipped", reason="needs a GPU (NCCL/RCCL); skipped where none is present")
    doc["summary"] = {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    html = page(doc, {})
    assert "every byte explained" not in html and "1 scenario(s) did not pass: see Findings" in html
    # a stopped run's page says so (it said nothing), beside what did not pass
    stopped = page(doc | {"interrupted": "Ctrl-C during x, scenario 3 of 4; 2 scenario(s) had finished"}, {})
    assert "interrupted: Ctrl-C during x, scenario 3 of 4" in stopped and "1 scenario(s) did not pass" in stopped
    assert "interrupted" not in html
    anchor = "s-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in failed["name"])
    assert f'<a href="#{anchor}">failed</a>' in html and f'<h3 id="{anchor}" class="bad">' in html
    assert f'<details id="d{anchor[1:]}" open>' in html  # its figures are open; the passing ones closed
    assert "FAIL [baseline] communication differs from the baseline" in html
    assert "accept it with --commgate-update-baselines" in html
    assert "obtained 4, expected 0 (+4)" not in html  # the difference is shown once: in the table below
    assert "needs a GPU (NCCL/RCCL)" in html
    assert html.index(f'id="{anchor}"') < html.index("needs a GPU")  # failures first
    row = "<td>calls [steps] all_reduce fp32 4 B forward group [0, 1]</td><td>4</td><td>0</td><td>+4</td>"
    assert row in html  # the before/after/difference table


def test_a_findings_causes_are_in_words_and_its_differences_shown_once(out: Path) -> None:
    """A finding of this commgate (with ``causes`` and ``notes``): its causes in the text above, its notes
    too, and each difference in the table alone (the text says where they are)."""
    from commgate.judge.causes import CallKey, recognise
    from commgate.judge.finding import Difference, Finding
    from commgate.report.htmlreport import page

    def key(nbytes: int) -> CallKey:
        return ("steps", "all_reduce", (0, 1), "fp32", nbytes, "backward")

    parts = (528384, 533504)
    causes = recognise({key(b): 4 for b in parts}, {key(1061888): 4})
    diffs = tuple(Difference(f"calls {b} B", 4 if b in parts else 0, 0 if b in parts else 4) for b in (1061888, *parts))
    f = Finding(kind="baseline", fail=True, title="differs", causes=causes, differences=diffs, notes=("a note",))
    doc = json.loads((out / "report.json").read_text())
    doc["scenarios"][0].update(status="failed", findings=[f.to_json()])
    html = page(doc, {})
    words = (
        "all_reduce fp32 1,061,888 B (backward, group [0, 1]) became 2 calls of 528,384 B and 533,504 B: a bucket split"
    )
    assert html.count(words) == 1 and html.count("a note") == 1
    assert "3 difference(s): the table below" in html
    assert html.count("calls 528384 B") == 1 and "<td>calls 528384 B</td><td>4</td><td>0</td><td>+4</td>" in html


def test_report_json_is_its_document_with_each_scenario_encoded_once_on_a_line(out: Path, tmp_path: Path) -> None:
    from commgate.report.report import Report

    scenarios = json.loads((out / "report.json").read_text())["scenarios"]
    report = Report(tmp_path / "report.json")
    for i, s in enumerate(scenarios):
        report.scenarios.append(s)
        report.write()  # as a run does, after each scenario
        text = (tmp_path / "report.json").read_text()
        assert json.loads(text) == report.document()
        assert sum(1 for line in text.splitlines() if line.startswith('{"')) == i + 1
    first = report.scenarios[0]["name"]
    report.scenarios[0]["name"] = "changed after it was written"  # scenarios are encoded once: never re-read
    assert json.loads(report.text())["scenarios"][0]["name"] == first
    assert json.loads(Report(None).text())["scenarios"] == []


def test_commgate_calibrate_fits_u_host_times_and_the_lag_from_a_report(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report's two kinds (ddp, pp) each get a host time per layer pass; u and the lag are stored
    with the curve of this machine, the other machines' curves untouched."""
    import dataclasses

    from commgate.report import bandwidth

    path = tmp_path / "bandwidth-gloo.json"
    path.write_bytes((ROOT / "baselines" / "bandwidth-gloo.json").read_bytes())
    # calibrate needs this machine's curve: the repository's is another machine's wherever the tests run on
    # other hardware, so this machine's stands in for one a sweep would have stored (a copy of it)
    hardware = json.loads((out / "report.json").read_text())["scenarios"][0]["capture"]["stack"]["hardware"]
    stored = bandwidth.load_all(path)
    if hardware not in stored:
        shipped = next(iter(stored.values()))
        blank = dataclasses.replace(shipped, hardware=hardware, utilization=1.0, calibrated=None, lag={}, host_s={})
        bandwidth.store(path, blank)
    before = bandwidth.load_all(path)
    assert main(["calibrate", str(out / "report.json"), "--baseline-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "calibrated on: d, p[s=32], p[s=64]" in text and "host time per layer pass, ddp" in text
    after = bandwidth.load_all(tmp_path / "bandwidth-gloo.json")
    changed = [hw for hw in after if after[hw] != before[hw]]
    assert len(changed) == 1 and set(after[changed[0]].host_s) == {"ddp", "pp"}
    curve = after[changed[0]]
    assert 0 < curve.utilization <= 10 and set(curve.lag) <= {"ddp", "pp"} and all(v >= 0 for v in curve.lag.values())
    assert "fitted to 3 scenarios" in (curve.calibrated or "")


def test_calibrate_without_this_machines_curve_names_the_command_that_measures_it(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", str(out / "report.json"), "--baseline-dir", str(tmp_path)]) == 2
    said = capsys.readouterr()
    assert said.out == ""  # no fit said of a calibration that was not stored (an adversarial pass)
    err = said.err.strip()
    assert len(err.splitlines()) == 1 and "no bandwidth curve for" in err and "Traceback" not in err
    assert f"benchmarks/test_collectives.py -p no:cacheprovider --commgate-curve-dir {tmp_path.resolve()}`" in err


def test_the_paper_bar_is_drawn_over_the_ranks_measured_not_per_rank(out: Path) -> None:
    """The paper's equations give one rank's (Eq. 2) or one pipeline's (Eq. 4) bytes; the figure's axis is
    "all ranks". Drawn per rank, the paper bar looked dp times off (issue 29 item 9): it is now scaled to
    the ranks measured, so that DDP's paper, model and measured bars agree to within its named terms."""
    from commgate.report.plots import paper_all_ranks

    doc = json.loads((out / "report.json").read_text())
    ddp = next(s for s in doc["scenarios"] if s["name"] == "d")
    per_rank = sum(c["paper_bytes"] for c in ddp["prediction"]["paper_comparison"])
    measured = sum(o["measured_bytes"] for o in ddp["collectives"])
    assert paper_all_ranks(ddp) == 2 * per_rank
    assert abs(paper_all_ranks(ddp) / measured - 1) < 0.02 < abs(per_rank / measured - 1)
    pipe = next(s for s in doc["scenarios"] if s["name"].startswith("p["))
    (eq4,) = (c for c in pipe["prediction"]["paper_comparison"] if c["equation"] == "Eq. 4")
    assert eq4["paper_ranks"] == 2  # one pipeline of two stages: the world is one pipeline
    assert paper_all_ranks(pipe) == sum(
        c["paper_bytes"] * 2 / c["paper_ranks"] for c in pipe["prediction"]["paper_comparison"]
    )
    emulated = json.loads(json.dumps(ddp))
    emulated["world_size"], emulated["capture"]["ranks"] = 64, [0]  # rank 0 alone ran: its view
    assert paper_all_ranks(emulated) == per_rank
    old = json.loads(json.dumps(pipe))  # a report written before paper_ranks: Eq. 4 covers one pipeline
    for c in old["prediction"]["paper_comparison"]:
        del c["paper_ranks"]
    assert paper_all_ranks(old) == paper_all_ranks(pipe)


def test_a_trainer_jobs_page_says_what_the_trainer_decided(out: Path, tmp_path: Path) -> None:
    """The console and report.json show what Hugging Face's Trainer resolved ("auto" values, its DDP and
    logging choices); the page showed none of it (found by the Hugging Face campaign). Here a run's report
    carries the prediction document of ``scenarios/hf-zero2.yaml``'s job, as a run of it writes it."""
    from commgate.model.loader import load_file
    from commgate.model.predict import predict
    from commgate.model.trainers import derived
    from commgate.report.render import prediction_document

    (job,) = load_file(ROOT / "scenarios" / "hf-zero2.yaml")
    doc = json.loads((out / "report.json").read_text())
    s = next(s for s in doc["scenarios"] if s["name"] == "d")
    s["prediction"]["trainer"] = prediction_document(predict(job))["trainer"]
    (tmp_path / "report.json").write_text(json.dumps(doc))
    assert main(["html", str(tmp_path / "report.json")]) == 0
    page = (tmp_path / "index.html").read_text()
    lines = derived(job)
    assert any('"auto" -> ' in line for line in lines)
    assert '<p class="note">hf: what the trainer decided</p>' in page
    assert all(f"<li>{html.escape(line)}</li>" in page for line in lines)


def test_a_baseline_only_run_is_not_headed_every_byte_explained(out: Path, tmp_path: Path) -> None:
    """A baseline-only scenario (``expectations: {model: {check: false}}``) ran unjudged under a green
    "every byte explained" and an "unexplained 0 B" column (a newcomer's walkthrough): the model was shown,
    not asserted. report.json says which scenarios had their model checked."""
    doc = json.loads((out / "report.json").read_text())
    assert all(s["model_checked"] is True for s in doc["scenarios"])
    assert "every byte explained" in (out / "index.html").read_text()
    for s in doc["scenarios"]:
        s["model_checked"] = False
    validate(doc)
    (tmp_path / "report.json").write_text(json.dumps(doc))
    assert main(["html", str(tmp_path / "report.json")]) == 0
    page = (tmp_path / "index.html").read_text()
    assert "every byte explained" not in page and " (not checked)</td><td>-</td>" in page


def test_long_scenario_names_are_shortened_on_the_plots_without_a_warning(out: Path, tmp_path: Path) -> None:
    """Sweep ids of 150 characters (valid names) left matplotlib no room: "UserWarning: Tight layout not
    applied" with commgate's source lines on the console, three times (found by an adversarial pass). The axis
    shows each name's two ends; the console shows nothing of matplotlib's."""
    doc = json.loads((out / "report.json").read_text())
    for s in doc["scenarios"]:
        s["name"] = "n" * 140 + s["name"]
    (tmp_path / "long.json").write_text(json.dumps(doc))
    argv = [sys.executable, "-W", "always", "-m", "commgate", "html", str(tmp_path / "long.json")]
    done = subprocess.run([*argv, "--out", str(tmp_path / "page")], capture_output=True, text=True)
    assert done.returncode == 0 and "Warning" not in done.stderr + done.stdout, done.stderr
    assert is_png(tmp_path / "page" / "plots" / "volume.png")
    from commgate.report.plots import LABEL, _label

    name = "n" * 140 + "d-s64-tail"
    assert len(_label(name)) == LABEL - 1 and _label(name).endswith("d-s64-tail") and _label("d") == "d"
