"""The report people look at: ``index.html`` with PNG plots, and ``trace.json`` for Perfetto / chrome://tracing,
written next to ``report.json`` from the report document alone (so any saved report can be re-rendered:
``commgate html out/report.json``).

Plots across scenarios (the papers' figures they follow in brackets), PNG by matplotlib's Agg backend:
volume per collective per scenario [Anthony et al. Figs. 7-8]; paper vs model vs measured volume and the
communication fraction, predicted vs measured [Anthony et al. Figs. 10, 13; Qi et al. table; APNet];
sweeps over sequence length [Anthony et al. Figs. 14-15] and scale [Qi et al.]; and the APNet model's
iteration-time breakdown. Every scenario's own figures (traffic matrices, timeline, message sizes) are
drawn inline by ``commgate.report.detail``.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commgate.core.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text
from commgate.core.units import human_bytes, shown, signed
from commgate.report import detail, timemodel
from commgate.report.detail import OP_COLORS


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(fig: Any, path: Path) -> str:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    _plt().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return f"{path.parent.name}/{path.name}"


def _bytes_axis(ax: Any, axis: str = "x") -> None:
    """A log axis in bytes (call after plotting) with ticks at powers of 4 (1 KiB, 4 KiB, ...), or of 2 on a
    narrow range, labelled as such."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    base = 2 if lo > 0 and hi / lo < 64 else 4  # enough ticks on a narrow range, few on a wide one
    a.set_major_locator(LogLocator(base=base, numticks=12))
    a.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".00", "") if v > 0 else "0"))
    a.set_minor_formatter(NullFormatter())


def _legend_above(ax: Any, ncol: int, **kw: Any) -> None:
    """The legend in a row between the title and the plot, where it covers nothing."""
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol, fontsize=8, frameon=False, **kw)


def _modelled(op_row: dict[str, Any]) -> float:
    """The model's bytes per step for one op of a report: its steady rows plus the named once-per-run
    terms the reconciliation attributes to the measured steps (e.g. DDP's bucket-rebuild broadcast)."""
    return float(op_row["predicted_bytes"]) + sum(float(r["bytes"]) for r in op_row["residuals"])


def _ran(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in doc["scenarios"] if "collectives" in s]


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def plot_volume(scenarios: list[dict[str, Any]], path: Path) -> str:
    """Measured bytes per step: the total (log) and each collective's share, per scenario."""
    plt = _plt()
    names = [s["name"] for s in scenarios]
    ops = sorted({o["op"] for s in scenarios for o in s["collectives"]})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.38 * len(names) + 1.6), sharey=True)
    y = range(len(names))
    totals = [sum(o["measured_bytes"] for o in s["collectives"]) for s in scenarios]
    a1.barh(y, totals, color="#4c72b0")
    a1.set_xscale("log")
    a1.set_yticks(list(y), names)
    a1.invert_yaxis()
    a1.set_xlabel("bytes per step, all ranks (log)")
    a1.set_title("Communication volume per step (measured)", pad=22)
    _bytes_axis(a1)
    left = [0.0] * len(names)
    for op in ops:
        share = []
        for s, tot in zip(scenarios, totals, strict=True):
            b = sum(o["measured_bytes"] for o in s["collectives"] if o["op"] == op)
            share.append(100 * b / tot if tot else 0)
        a2.barh(y, share, left=left, color=OP_COLORS.get(op, "#999999"), label=op)
        left = [a + b for a, b in zip(left, share, strict=True)]
    a2.set_xlim(0, 100)
    a2.set_xlabel("share of the step's bytes (%)")
    a2.set_title("Volume by collective", pad=22 if len(ops) <= 6 else 34)
    _legend_above(a2, ncol=min(6, len(ops)))
    fig.tight_layout()
    return _save(fig, path)


def plot_predicted_measured(scenarios: list[dict[str, Any]], path: Path) -> str:
    """Paper (idealised) vs model vs measured bytes per step, and the communication fraction."""
    plt = _plt()
    names = [s["name"] for s in scenarios]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.42 * len(names) + 1.8), sharey=True)
    y = list(range(len(names)))
    h = 0.27
    measured = [sum(o["measured_bytes"] for o in s["collectives"]) for s in scenarios]
    model = [sum(_modelled(o) for o in s["collectives"]) for s in scenarios]
    paper = [sum(c["paper_bytes"] for c in s["prediction"]["paper_comparison"]) for s in scenarios]
    a1.barh([v - h for v in y], paper, h, label="paper Eqs. 2-5 (idealised)", color="#bbbbbb")
    a1.barh(y, model, h, label="commgate model", color="#4c72b0")
    a1.barh([v + h for v in y], measured, h, label="measured", color="#dd8452")
    a1.set_xscale("log")
    a1.set_yticks(y, names)
    a1.invert_yaxis()
    a1.set_xlabel("bytes per step, all ranks (log)")
    a1.set_title("Volume: paper vs model vs measured", pad=22)
    _bytes_axis(a1)
    _legend_above(a1, ncol=3)
    pf = [_frac(s, "predicted") for s in scenarios]
    mf = [_frac(s, "measured") for s in scenarios]
    a2.barh([v - h / 2 for v in y], [100 * (v or 0) for v in pf], h, label="APNet model (in flight)", color="#4c72b0")
    a2.barh([v + h / 2 for v in y], [100 * (v or 0) for v in mf], h, label="measured", color="#dd8452")
    for v, p in zip(y, pf, strict=True):
        if p is None:
            a2.text(1, v - h / 2, "no curve", va="center", fontsize=7, color="#666666")
    a2.set_xlim(0, 100)
    a2.set_xlabel("communication fraction of the step, rank 0 (%)")
    a2.set_title("Share of the step with a call in flight", pad=22)
    _legend_above(a2, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def _frac(s: dict[str, Any], side: str) -> float | None:
    value = (s.get("comm_fraction") or {}).get(side)
    return float(value) if value is not None else None


def plot_time_model(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """The APNet model's T_iter breakdown for rank 0 next to the measured step time."""
    rows = [s for s in scenarios if (s.get("time_model") or {}).get("predicted")]
    if not rows:
        return None
    plt = _plt()
    names = [s["name"] for s in rows]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(names) + 1.8))
    y = list(range(len(names)))
    parts = [("t_comp_s", "T_comp", "#8da0cb"), ("t_tp_s", "T_TP", "#66c2a5"), ("t_pp_s", "T_PP", "#e78ac3")]
    parts += [("t_dp_s", "T_DP", "#fc8d62"), ("t_ep_s", "T_EP", "#a6d854"), ("t_bubble_s", "T_bubble", "#cccccc")]
    left = [0.0] * len(rows)
    for key, label, color in parts:
        vals = [1e3 * s["time_model"]["predicted"][key] for s in rows]
        ax.barh([v - 0.18 for v in y], vals, 0.34, left=left, color=color, label=f"{label} (model)")
        left = [a + b for a, b in zip(left, vals, strict=True)]
    meas = [1e3 * ((s["time_model"].get("measured") or {}).get("t_iter_s") or 0) for s in rows]
    comm = [1e3 * ((s["time_model"].get("measured") or {}).get("t_comm_s") or 0) for s in rows]
    ax.barh([v + 0.18 for v in y], meas, 0.34, color="#dddddd", edgecolor="#555555", label="measured step")
    ax.barh([v + 0.18 for v in y], comm, 0.34, color="#dd8452", label="measured: a call in flight")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step, rank 0")
    ax.set_title("Iteration time: APNet model (upper bar) vs measured (lower bar)", pad=34)
    _legend_above(ax, ncol=4)
    fig.tight_layout()
    return _save(fig, path)


def link_of(s: dict[str, Any]) -> str | None:
    """The shaped link a scenario ran over (``commgate run --link``), or None."""
    return ((s.get("capture") or {}).get("stack") or {}).get("link")


def _link_order(s: dict[str, Any]) -> float:
    from commgate.run.links import Link

    link = link_of(s)
    return -Link.parse(link).rate_mbit if link else -float("inf")


def plot_links(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """Qi et al.'s interconnect study: each workload's communication fraction against its iteration time,
    over every link it ran on (filled: measured; hollow: the model with that link's curve). Drawn when
    some scenario ran over a shaped link."""
    rows = [s for s in scenarios if (s.get("time_model") or {}).get("measured")]
    if not any(link_of(s) for s in rows):
        return None
    plt = _plt()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_work: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in rows:
        by_work[s["name"].split("@")[0]].append(s)
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    for i, (work, members) in enumerate(sorted(by_work.items())):
        color = colors[i % len(colors)]
        members.sort(key=_link_order)  # the fastest link first, as the link slows
        xs = [1e3 * s["time_model"]["measured"]["t_iter_s"] for s in members]
        ys = [s["time_model"]["measured"]["comm_fraction"] for s in members]
        ax.plot(xs, ys, "o-", color=color, label=work)
        for s, x, y in zip(members, xs, ys, strict=True):
            ax.annotate(link_of(s) or "loopback", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if p := s["time_model"].get("predicted"):
                ax.plot([1e3 * p["t_iter_s"]], [p["in_flight_fraction"]], "o", mfc="none", color=color)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("iteration time, ms (rank 0; log)")
    ax.set_ylabel("communication fraction (a call in flight)")
    ax.set_title("Communication fraction against iteration time, per link (filled: measured, hollow: model)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


SWEEP_AXES: tuple[tuple[str, str, str], ...] = (
    ("model", "s", "sequence length s (tokens)"),
    ("parallelism", "dp", "data-parallel ranks d"),
    ("parallelism", "tp", "tensor-parallel ranks t"),
    ("parallelism", "pp", "pipeline stages p"),
    ("parallelism", "micro_batches", "micro-batches m"),
)


def _x(s: dict[str, Any], where: str, key: str) -> Any:
    return s["prediction"][where][key]


def sweeps(scenarios: list[dict[str, Any]]) -> dict[str, tuple[str, str, list[dict[str, Any]]]]:
    """Scenario families (one name, 2+ variants) -> (field, axis label, members in order of the field):
    the first of sequence length, dp, tp, pp, micro-batches that varies across the family."""
    fam: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in scenarios:
        fam[s["prediction"]["scenario"]].append(s)
    out = {}
    for name, members in fam.items():
        for where, key, label in SWEEP_AXES:
            values = [_x(m, where, key) for m in members]
            if len(members) > 1 and len(set(values)) == len(members):
                order = sorted(range(len(members)), key=values.__getitem__)
                out[name] = (key, label, [members[i] for i in order])
                break
    return out


def plot_sequence_length(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """Every family swept over the sequence length on one log-log plot: bytes per step over all ranks,
    the model's line and the measured circles, labelled with the family's scheme."""
    fams = {name: members for name, (key, _, members) in sweeps(scenarios).items() if key == "s"}
    if not fams:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, members) in enumerate(sorted(fams.items())):
        color = colors[i % len(colors)]
        xs = [_x(m, "model", "s") for m in members]
        pred = [sum(_modelled(o) for o in m["collectives"]) for m in members]
        meas = [sum(o["measured_bytes"] for o in m["collectives"]) for m in members]
        scheme = members[0]["prediction"]["parallelism"]["scheme"]
        ax.plot(xs, pred, "-", color=color, label=f"{name} ({scheme})")
        ax.plot(xs, meas, "o", color=color, mfc="none", ms=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted({_x(m, "model", "s") for members in fams.values() for m in members})
    ax.set_xticks(xs, [str(v) for v in xs])
    ax.set_xlabel("sequence length s (tokens)")
    _bytes_axis(ax, "y")
    ax.set_ylabel("bytes per step, all ranks (log)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweeps(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """Per family: bytes per step per collective against the swept field (model lines, measured circles),
    and the share of rank 0's step with a call in flight (the APNet model and the run)."""
    fams = sweeps(scenarios)
    if not fams:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(fams), 2, figsize=(12.5, 3.7 * len(fams)), squeeze=False)
    for (a1, a2), (name, (key, label, members)) in zip(axes, sorted(fams.items()), strict=True):
        where = "model" if key == "s" else "parallelism"
        xs = [_x(m, where, key) for m in members]
        for op in sorted({o["op"] for m in members for o in m["collectives"]}):
            color = OP_COLORS.get(op, "#999999")
            pred = [sum(_modelled(o) for o in m["collectives"] if o["op"] == op) for m in members]
            meas = [sum(o["measured_bytes"] for o in m["collectives"] if o["op"] == op) for m in members]
            a1.plot(xs, pred, "-", color=color, label=f"{op} (model)")
            a1.plot(xs, meas, "o", color=color, mfc="none", ms=7, label=f"{op} (measured)")
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(v) for v in xs])
            ax.set_xlabel(label)
        a1.set_yscale("log")
        _bytes_axis(a1, "y")
        a1.set_ylabel("bytes per step, all ranks (log)")
        a1.set_title(f"{name}: volume")
        a1.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        pf, mf = [_frac(m, "predicted") for m in members], [_frac(m, "measured") for m in members]
        if any(v is not None for v in pf):
            a2.plot(xs, [100 * v if v is not None else float("nan") for v in pf], "-s", color="#4c72b0", label="model")
        a2.plot(xs, [100 * v if v is not None else float("nan") for v in mf], "-o", color="#dd8452", label="measured")
        a2.set_ylim(0, 100)
        a2.set_ylabel("% of rank 0's step with a call in flight")
        a2.set_title(f"{name}: communication fraction")
        a2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def trace(doc: dict[str, Any]) -> dict[str, Any]:
    """Chrome trace events (Perfetto, chrome://tracing): one process per scenario, one thread per rank;
    every captured call a complete event, every step a span on its own row. Times: each rank's clock from
    its first call, in microseconds, scenarios laid one after another."""
    events: list[dict[str, Any]] = []
    offset = 0.0
    for pid, s in enumerate(_ran(doc), 1):
        cap = s.get("capture")
        if not cap:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": s["name"]}})
        end = 0.0
        for r in range(cap["world_size"]):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1000 + r, "args": {"name": f"rank {r} steps"}}
            )
        for c in cap["calls"]:
            if c["duration_ns"] is None:
                continue
            ts, dur = offset + c["start_ns"] / 1e3, c["duration_ns"] / 1e3
            end = max(end, ts + dur)
            args = {k: c[k] for k in ("bytes", "dtype", "group", "peer", "root", "step", "phase", "tensors")}
            events.append(
                {
                    "ph": "X",
                    "name": c["op"],
                    "cat": c["phase"],
                    "pid": pid,
                    "tid": c["rank"],
                    "ts": ts,
                    "dur": dur,
                    "args": args,
                }
            )
        for w in cap.get("step_windows", []):
            ts = offset + w["start_ns"] / 1e3
            dur = (w["end_ns"] - w["start_ns"]) / 1e3
            end = max(end, ts + dur)
            events.append(
                {
                    "ph": "X",
                    "name": f"step {w['step']}",
                    "cat": "step",
                    "pid": pid,
                    "tid": 1000 + w["rank"],
                    "ts": ts,
                    "dur": dur,
                }
            )
        offset = end + 1e5  # 100 ms between scenarios
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "commgate", "created": doc.get("created")},
    }


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
    rank = {"failed": 0, "error": 1, "passed": 2, "skipped": 3}
    shown = sorted((s for s in doc["scenarios"] if _has_findings(s)), key=lambda s: rank.get(s["status"], 4))
    if not shown:
        return ""
    parts = ["<h2>Findings</h2>"]
    for s in shown:
        lines = []
        if s["status"] in ("error", "skipped") and s.get("reason"):
            lines.append(s["reason"])
        for f in s.get("findings", []):
            verdict = "FAIL" if f["fail"] else "warn"
            lines.append(f"{verdict} [{f['kind']}] {f['title']}")
            lines += [f"    {line}" for line in f["lines"]]
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


def _diff_table(s: dict[str, Any]) -> str:
    """The failing findings' differences (against the baseline, the model or the time model's allowance) as
    a table: against, what, now, expected, and the difference (or what the finding says in its place)."""
    rows = []
    for f in s.get("findings", []):
        if not f["fail"]:
            continue
        for d in f.get("differences", []):  # reports written before findings carried them have none
            cells = [
                f["kind"],
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
            pred = sum(_modelled(o) for o in s["collectives"])
            unexp = sum(o["unexplained_bytes"] for o in s["collectives"])
            cells += [human_bytes(meas), human_bytes(pred), f"{unexp:g} B"]
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
pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto} h3.bad{color:#c62828}
"""
ORDER = ("passed", "failed", "error", "skipped")
FIGURES = (
    ("volume", "Volume per collective", "Measured bytes per step summed over ranks, and each collective's share "
     "(Anthony et al., Figs. 7-8)."),
    ("predicted", "Predicted vs measured", "Left: the paper's idealised equations, commgate's per-collective model "
     "and the capture. Right: the share of rank 0's step with a call in flight, the APNet model against the run."),
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
    ran = _ran(doc)
    broken = counts.get("failed", 0) + counts.get("error", 0)
    if broken:
        spans.append(f'<span class="bad">{broken} scenario(s) did not pass: see Findings</span>')
    elif ran and all(o.get("unexplained_bytes", 0) == 0 for s in ran for o in s["collectives"]):
        spans.append('<span class="passed">every byte explained</span>')
    return '<div class="counts">' + "".join(spans) + "</div>"


def _img(src: str, alt: str) -> str:
    return f'<img src="{html.escape(src)}" alt="{html.escape(alt)}">'


def _details(doc: dict[str, Any]) -> str:
    """Every scenario that ran, failing ones first and open: its traffic matrices, timeline and message sizes."""
    ran = sorted(_ran(doc), key=lambda s: s["status"] == "passed")
    if not ran:
        return ""
    parts = [
        "<h2>Scenarios in detail</h2>",
        '<p class="note">Per scenario: the traffic matrix predicted and measured [APNet], every rank\'s calls over '
        "its own clock with the cold-start spikes the gate flags circled (Anthony et al., Section V), and the "
        "measured steps' message sizes (Anthony et al., Fig. 9).</p>",
    ]
    for s in ran:
        opened = " open" if s["status"] != "passed" else ""
        body = []
        if s.get("capture"):
            ops = sorted({c["op"] for c in s["capture"]["calls"] if c["step"] >= 0})  # what the figures draw
            body += [detail.legend(ops), detail.timeline(s, s.get("cold_starts", [])), detail.histogram(s)]
        body.append(detail.matrices(s))
        parts.append(
            f'<details id="{_detail_anchor(s)}"{opened}><summary>{html.escape(s["name"])} '
            f"({html.escape(s['status'])})</summary>{''.join(body)}</details>"
        )
    return "\n".join(parts)


def page(doc: dict[str, Any], figures: dict[str, str | None]) -> str:
    env = doc.get("environment", {})
    meta = ", ".join(f"{k} {env[k]}" for k in ("commgate", "torch", "deepspeed", "python", "platform") if env.get(k))
    links = '<a href="report.json">report.json</a> &middot; <a href="trace.json">trace.json</a> (ui.perfetto.dev)'
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<title>commgate report</title>",
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


def write(out: Path, doc: dict[str, Any], *, progress: Callable[[str], None] | None = None) -> Path:
    """Render ``doc`` (a report document) into ``out``: plots/*.png, trace.json, then index.html last."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    ran = _ran(doc)
    figures: dict[str, str | None] = {}
    if ran:
        drawn = (
            ("volume", plot_volume, "volume.png"),
            ("predicted", plot_predicted_measured, "predicted_vs_measured.png"),
            ("time", plot_time_model, "time_model.png"),
            ("seqlen", plot_sequence_length, "sequence_length.png"),
            ("sweeps", plot_sweeps, "sweeps.png"),
            ("links", plot_links, "links.png"),
        )
        for i, (key, plot, name) in enumerate(drawn):
            if progress:
                progress(f"report: {name} ({i + 1}/{len(drawn)})")
            figures[key] = plot(ran, plots / name)
    atomic_write_json(out / "trace.json", trace(doc))
    return atomic_write_text(out / "index.html", page(doc, figures))


__all__: Sequence[str] = ("trace", "write")
