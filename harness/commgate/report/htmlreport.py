"""The report people look at: ``index.html``, beside its plots (``commgate.report.plots``) and ``trace.json``
for Perfetto (``commgate.report.trace``), written next to ``report.json`` from the report document alone (so
any saved report can be re-rendered: ``commgate html out/report.json``).

The page: the counts, one row per scenario, the findings (what they mean in words, their ``causes``,
then their differences once, as an obtained / expected / difference table drawn from the findings'
``differences``), the time model's accuracy, the
plots across scenarios, and every scenario's own figures (traffic matrices, timeline, message sizes),
drawn inline by ``commgate.report.detail``.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commgate.core import fsutil
from commgate.core.errors import WriteError
from commgate.core.fsutil import atomic_write_json, atomic_write_text
from commgate.core.units import human_bytes, shown, signed
from commgate.report import detail, plots, timemodel
from commgate.report.report import modelled, ran
from commgate.report.trace import trace


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "-"


def _ms(v: float | None) -> str:
    return f"{1e3 * v:.1f} ms" if v is not None else "-"


def _anchor(s: dict[str, Any]) -> str:
    """Where the scenario's findings are."""
    return "s-" + _slug(s["name"])


def _detail_anchor(s: dict[str, Any]) -> str:
    """Where the scenario's own figures are."""
    return "d-" + _slug(s["name"])


def _has_findings(s: dict[str, Any]) -> bool:
    return bool(s.get("reason") or s.get("findings"))


def _name_cell(s: dict[str, Any]) -> str:
    """The scenario's name, linked to its figures (HTML-escaped)."""
    return f'<a href="#{_detail_anchor(s)}">{html.escape(s["name"])}</a>'


def _status_cell(s: dict[str, Any]) -> str:
    """The scenario's status, linked to its findings when it has any (HTML-escaped)."""
    status = html.escape(s["status"])
    return f'<a href="#{_anchor(s)}">{status}</a>' if _has_findings(s) else status


def _findings(doc: dict[str, Any]) -> str:
    """Why each scenario failed, errored or was skipped, and its warnings: the lines pytest shows, one
    block per scenario (failed and errored first), each with an anchor the table links to."""
    rank = {"failed": 0, "error": 1, "unjudged": 2, "passed": 3, "skipped": 4}
    shown = sorted((s for s in doc["scenarios"] if _has_findings(s)), key=lambda s: rank.get(s["status"], 5))
    if not shown:
        return ""
    parts = ["<h2>Findings</h2>"]
    for s in shown:
        lines = []
        if s["status"] in ("error", "skipped", "unjudged") and s.get("reason"):
            lines.append(s["reason"])
        for f in s.get("findings", []):
            verdict = "FAIL" if f["fail"] else "warn"
            lines.append(f"{verdict} [{f['kind']}] {f['title']}")
            lines += [f"    {line}" for line in _words(f)]
            if n := len(f.get("differences", [])):
                lines.append(f"    {n} difference(s): the table below")
            if f.get("hint"):
                lines.append(f"    {f['hint']}")
        cls = "bad" if s["status"] in ("failed", "error") else ""
        figures = f' <a href="#{_detail_anchor(s)}">(its figures)</a>' if "capture" in s else ""
        parts.append(
            f'<h3 id="{_anchor(s)}" class="{cls}">{html.escape(s["name"])}: {html.escape(s["status"])}{figures}</h3>'
            f"<pre>{html.escape(chr(10).join(lines))}</pre>"
        )
        parts.append(_diff_table(s))
    return "\n".join(parts)


def _words(f: dict[str, Any]) -> list[str]:
    """A finding's lines that are not a difference (those are the table's, shown once): its causes, then its
    notes. A report written before findings carried ``differences`` has only its ``lines``; one written
    before ``causes`` and ``notes``, its differences' lines first."""
    if "differences" not in f:
        return list(f["lines"])
    if "notes" not in f:
        return list(f["lines"][len(f["differences"]) :])
    return [c["text"] for c in f.get("causes", [])] + list(f["notes"])


def _diff_table(s: dict[str, Any]) -> str:
    """The findings' differences (against the baseline, the model or the time model's allowance) as one
    table, the only place the page shows them: against, what, now, expected, and the difference (or what the
    finding says in its place)."""
    rows = []
    for f in s.get("findings", []):
        for d in f.get("differences", []):  # reports written before findings carried them have none
            cells = [
                f["kind"] if f["fail"] else f"{f['kind']} (warning)",
                d["what"],
                shown(d["obtained"]),
                shown(d["expected"]),
                d["detail"] or signed(d["difference"]),
            ]
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("against", "what", "now", "expected", "difference"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _accuracy(doc: dict[str, Any]) -> str:
    """The iteration-time model against every run: T_iter, T_comm (in flight), exposed T_comm and the comm
    fraction, predicted / measured / error, then the report's median and worst errors."""
    timed = [(s, s["time_model"]) for s in doc["scenarios"] if (s.get("time_model") or {}).get("predicted")]
    timed = [(s, tm) for s, tm in timed if tm.get("measured")]
    if not timed:
        return ""
    head = ["scenario", "T_iter", "T_comm in flight", "exposed T_comm", "comm fraction", "domain"]
    rows = []
    for s, tm in timed:
        p, m, e = tm["predicted"], tm["measured"], tm.get("errors") or {}

        def cell(key: str, pk: str, mk: str, p: dict[str, Any] = p, m: dict[str, Any] = m, e: Any = e) -> str:
            err = e.get(key)
            shown = f" ({100 * err:+.0f}%)" if err is not None else ""
            return f"{_ms(p.get(pk))} / {_ms(m.get(mk))}{shown}"

        frac = e.get("comm_fraction")
        cells = [
            cell("t_iter", "t_iter_s", "t_iter_s"),
            cell("t_comm", "t_comm_s", "t_comm_s"),
            cell("t_exposed", "t_exposed_s", "t_exposed_s"),
            f"{_pct(p.get('in_flight_fraction'))} / {_pct(m.get('comm_fraction'))}"
            + (f" ({100 * frac:+.0f} pp)" if frac is not None else ""),
            tm.get("domain") or "inside",
        ]
        rows.append(f"<tr><td>{_name_cell(s)}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    acc = timemodel.accuracy([tm for _, tm in timed])
    lines = []
    for scope, label in timemodel.SCOPES:
        parts = []
        kinds = (("comm_fraction", "comm fraction"), ("t_iter", "T_iter"), ("t_exposed", "exposed T_comm"))
        for key, what in kinds:
            if (a := acc[scope][key]) is not None:
                med, worst = (f"{a[k]:.2f}" if key == "comm_fraction" else f"{a[k]:.0%}" for k in ("median", "worst"))
                parts.append(f"{what} median {med}, worst {worst}")
        if parts:
            lines.append(f"<li>{label}: {html.escape('; '.join(parts))}</li>")
    ths = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    note = (
        "Predicted / measured (error) for rank 0, medians over the measured steps. In flight: the time a call "
        "was in flight; exposed: the time the training thread was blocked waiting. A run with more local ranks "
        "than cores is outside the model's domain: reported, not judged (expectations.time.max_error)."
    )
    return (
        f'<h2>Accuracy of the iteration-time model</h2><p class="note">{html.escape(note)}</p>'
        f"<ul>{''.join(lines)}</ul><table><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _table(doc: dict[str, Any]) -> str:
    head = ["scenario", "scheme", "ranks", "status", "bytes measured / step", "model", "unexplained"]
    head += ["in flight measured", "model", "error", "step measured", "model"]
    rows = []
    for s in doc["scenarios"]:
        started = (s.get("capture") or {}).get("ranks")  # an emulated run: the ranks it started
        ranks = f"{s['world_size']} (emulated: {len(started)} run)" if started is not None else str(s["world_size"])
        cells = [s["name"], s["scheme"], ranks, s["status"]]
        cells[0] = _name_cell(s)
        if "collectives" in s:
            meas = sum(o["measured_bytes"] for o in s["collectives"])
            pred = sum(modelled(o) for o in s["collectives"])
            unexp = sum(o["unexplained_bytes"] for o in s["collectives"])
            checked = s.get("model_checked", True)  # baseline-only: the model is shown, not asserted
            cells += [human_bytes(meas), human_bytes(pred) + ("" if checked else " (not checked)")]
            cells.append(f"{unexp:g} B" if checked else "-")
        else:
            cells += ["", "", ""]
        tm = s.get("time_model") or {}
        p, m = tm.get("predicted") or {}, tm.get("measured") or {}
        err = tm.get("comm_fraction_error")
        cells += [_pct(m.get("comm_fraction")), _pct(p.get("in_flight_fraction"))]
        cells.append(f"{100 * err:+.0f} pp" if err is not None else "-")
        cells += [_ms(m.get("t_iter_s")), _ms(p.get("t_iter_s"))]
        cls = f' class="{html.escape(s["status"])}"'
        rest = "".join(f"<td>{html.escape(c)}</td>" for c in cells[4:])
        linked = f"<td>{cells[0]}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:3])
        rows.append(f"<tr{cls}>{linked}<td>{_status_cell(s)}</td>{rest}</tr>")
    ths = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1280px;
  color:#222;padding:0 16px}
h1{margin-bottom:4px} .meta{color:#666;font-size:13px;margin-bottom:18px}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{padding:4px 8px;border-bottom:1px solid #e3e3e3;text-align:left}
th{background:#f5f5f5;position:sticky;top:0} tr.failed td,tr.error td{background:#fdecea} tr.skipped td{color:#888}
img{max-width:100%;border:1px solid #eee;margin:6px 0 18px} details{margin:4px 0}
summary{cursor:pointer;font-weight:600}
.counts span{display:inline-block;margin-right:14px;font-weight:600} .passed{color:#1a7f37} .bad{color:#c62828}
p.note{color:#555;font-size:13px;max-width:900px}
pre{background:#f7f7f7;padding:8px;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere} h3.bad{color:#c62828}
"""
ORDER = ("passed", "failed", "error", "skipped", "unjudged")
FIGURES = (
    ("volume", "Volume per collective", "Measured bytes per step summed over ranks, and each collective's share "
     "(Anthony et al., Figs. 7-8)."),
    ("predicted", "Predicted vs measured", "Left: the paper's idealised equations (each "
     "rank or pipeline as the equation's, times the ranks measured), commgate's per-collective model and the "
     "capture, all over the ranks measured. Right: the share of rank 0's step with a call in flight, the APNet "
     "model against the run."),
    ("time", "Iteration-time model", "APNet: T_iter = T_comp + T_TP + T_PP + T_DP + T_bubble for rank 0, from "
     "the bandwidth curve C and the measured GEMM rate; lower bar: the measured step and the time a call was in "
     "flight."),
    ("seqlen", "Volume against sequence length, per scheme", "Anthony et al., Figs. 14-15, with context "
     "parallelism, which they do not study: every family swept over s, its bytes per step over all ranks (model "
     "lines, measured circles). Tensor, pipeline and context parallelism move activations and grow linearly in s; "
     "data parallelism moves parameters and stays flat (but for a learned position table of s rows)."),
    ("sweeps", "Sweeps", "Sequence-length sweeps (Anthony et al., Figs. 14-15) and strong/weak scaling (Qi et al.): "
     "volume per collective (model lines, measured circles) and the communication fraction, model and measured."),
    ("links", "Links of different speeds", "Qi et al.'s interconnect study on one machine: the ranks' two halves in "
     "network namespaces joined by a veth link shaped with tc (commgate run --link; benchmarks/interconnect.py). "
     "As the link slows, each workload's iteration time grows and communication takes a larger share of it; the "
     "hollow markers are the model with the bandwidth curve measured over the same link."),
)  # fmt: skip


def _counts(doc: dict[str, Any]) -> str:
    counts = doc.get("summary", {})
    spans = []
    for k in ORDER:
        v = counts.get(k, 0)
        cls = "bad" if k in ("failed", "error") and v else "passed" if k == "passed" else ""
        spans.append(f'<span class="{cls}">{v} {k}</span>')
    done = ran(doc)
    broken = counts.get("failed", 0) + counts.get("error", 0)
    if stopped := doc.get("interrupted"):  # the page of a stopped run said nothing of it, like a whole run's
        spans.append(f'<span class="bad">interrupted: {html.escape(str(stopped))}</span>')
    if broken:
        spans.append(f'<span class="bad">{broken} scenario(s) did not pass: see Findings</span>')
    elif (
        not stopped
        and done
        and all(s.get("model_checked", True) for s in done)  # a baseline-only run explained nothing
        and all(o.get("unexplained_bytes", 0) == 0 for s in done for o in s["collectives"])
    ):
        spans.append('<span class="passed">every byte explained</span>')
    return '<div class="counts">' + "".join(spans) + "</div>"


def _img(src: str, alt: str) -> str:
    return f'<img src="{html.escape(src)}" alt="{html.escape(alt)}">'


def _details(doc: dict[str, Any]) -> str:
    """Every scenario that ran, failing ones first and open: what its trainer decided (a trainer other than
    commgate's), its traffic matrices, timeline and message sizes."""
    done = sorted(ran(doc), key=lambda s: s["status"] == "passed")
    if not done:
        return ""
    parts = [
        "<h2>Scenarios in detail</h2>",
        '<p class="note">Per scenario: the traffic matrix predicted and measured [APNet], every rank\'s calls, one '
        "panel per step (time since the step began on the rank's own clock), with the cold-start spikes the gate "
        "flags circled and named on the right (Anthony et al., Section V), and the "
        "measured steps' message sizes (Anthony et al., Fig. 9).</p>",
    ]
    for s in done:
        opened = " open" if s["status"] != "passed" else ""
        body = []
        if trainer := (s.get("prediction") or {}).get("trainer"):  # what it resolved: "auto" values and all
            lines = "".join(f"<li>{html.escape(line)}</li>" for line in trainer["derived"])
            body.append(f'<p class="note">{html.escape(trainer["name"])}: what the trainer decided</p><ul>{lines}</ul>')
        if s.get("capture"):
            ops = sorted({c["op"] for c in s["capture"]["calls"] if c["step"] >= 0})  # what the figures draw
            body += [detail.legend(ops), detail.timeline(s, s.get("cold_starts", [])), detail.histogram(s)]
        body.append(detail.matrices(s))
        parts.append(
            f'<details id="{_detail_anchor(s)}"{opened}><summary>{html.escape(s["name"])} '
            f"({html.escape(s['status'])})</summary>{''.join(body)}</details>"
        )
    return "\n".join(parts)


TITLE = "commgate report"


def page(doc: dict[str, Any], figures: dict[str, str | None]) -> str:
    env = doc.get("environment", {})
    meta = ", ".join(f"{k} {env[k]}" for k in ("commgate", "torch", "deepspeed", "python", "platform") if env.get(k))
    links = '<a href="report.json">report.json</a> &middot; <a href="trace.json">trace.json</a> (ui.perfetto.dev)'
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>{TITLE}</title>",
        f"<style>{CSS}{detail.CSS}</style></head><body>",
        "<h1>commgate report</h1>",
        f'<div class="meta">{html.escape(doc.get("created", ""))} &middot; {html.escape(meta)} &middot; {links}</div>',
        _counts(doc),
        "<h2>Scenarios</h2>",
        _table(doc),
        _findings(doc),
        _accuracy(doc),
    ]
    for key, title, note in FIGURES:
        if src := figures.get(key):
            parts.append(f'<h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>{_img(src, title)}')
    parts += [_details(doc), "</body></html>"]
    return "\n".join(parts)


def check_outputs(out: Path, *, fix: str) -> None:
    """What ``write`` (and a run's report.json) writes into ``out`` can be written there: a one-line
    ``WriteError`` before anything is written otherwise (``fsutil.check_outputs``)."""
    figures = tuple(f"plots/{name}" for _, _, name in plots.PLOTS)
    files = ("report.json", "trace.json", "index.html", *figures)
    fsutil.check_outputs(out, files=files, dirs=("plots",), fix=fix)
    for name, mark in MARKS.items():  # a site's own page was replaced without a word (found by an adversarial pass)
        head = fsutil.text_head(out / name, 4096)
        if head is not None and mark not in head:
            raise WriteError(
                f"{out / name}: not a page commgate wrote (no {mark!r} in it), and commgate would replace it; move "
                f"it, or {fix}"
            )


MARKS = {"index.html": f"<title>{TITLE}</title>", "trace.json": '"source": "commgate"'}
"""What every page and trace commgate writes holds near its start (``page``, ``commgate.report.trace``)."""


def write(out: Path, doc: dict[str, Any], *, progress: Callable[[str], None] | None = None) -> Path:
    """Render ``doc`` (a report document) into ``out``: plots/*.png, trace.json, then index.html last."""
    figures = plots.draw(ran(doc), out / "plots", progress=progress)
    atomic_write_json(out / "trace.json", trace(doc))
    return atomic_write_text(out / "index.html", page(doc, figures))
