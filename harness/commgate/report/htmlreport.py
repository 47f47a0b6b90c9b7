"""The report people look at: ``index.html`` with PNG plots, and ``trace.json`` for Perfetto / chrome://tracing,
written next to ``report.json`` from the report document alone (so any saved report can be re-rendered:
``commgate html out/report.json``).

Plots (the papers' figures they follow in brackets): volume per collective per scenario [Anthony et al.
Figs. 7-8]; paper vs model vs measured volume and the communication fraction, predicted vs measured
[Anthony et al. Figs. 10, 13; Qi et al. table; APNet]; message-size histograms [Anthony et al. Fig. 9];
sweeps over sequence length [Anthony et al. Figs. 14-15] and scale [Qi et al.]; traffic matrices,
predicted next to measured [APNet]; per-rank call timelines with cold-start spikes marked [Anthony et
al. Section V]; and the APNet model's iteration-time breakdown. matplotlib only,
Agg backend (no display).
"""

from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commgate.core.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text
from commgate.core.units import human_bytes
from commgate.judge.drift import ColdStart
from commgate.run.capture import Capture, CapturedCall

OP_COLORS = {
    "all_reduce": "#1f77b4",
    "all_gather": "#2ca02c",
    "reduce_scatter": "#ff7f0e",
    "all_to_all": "#9467bd",
    "broadcast": "#8c564b",
    "reduce": "#17becf",
    "send": "#d62728",
    "recv": "#e377c2",
    "gather": "#bcbd22",
    "scatter": "#7f7f7f",
    "barrier": "#444444",
}
MAX_DETAIL = 16
"""Per-scenario figures (matrices, timelines, histograms) are drawn for at most this many scenarios."""


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


def _measured_calls(s: dict[str, Any]) -> list[dict[str, Any]]:
    cap = s.get("capture") or {}
    first = cap.get("warmup_steps", 0)
    return [c for c in cap.get("calls", []) if c["step"] >= first]


def plot_histograms(scenarios: list[dict[str, Any]], path: Path) -> str:
    """Calls per message size (log2 buckets) in the measured steps, stacked by collective, per scenario."""
    plt = _plt()
    n = len(scenarios)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.7 * rows), squeeze=False)
    for ax, s in zip(axes.flat, scenarios, strict=False):
        by_op: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for c in _measured_calls(s):
            by_op[c["op"]][max(0, math.floor(math.log2(max(1, c["bytes"]))))] += 1
        buckets = sorted({b for d in by_op.values() for b in d})
        if not buckets:
            ax.set_axis_off()
            continue
        xs = list(range(buckets[0], buckets[-1] + 1))
        bottom = [0] * len(xs)
        for op in sorted(by_op):
            vals = [by_op[op].get(x, 0) for x in xs]
            ax.bar(xs, vals, bottom=bottom, color=OP_COLORS.get(op, "#999999"), label=op, width=0.85)
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        step = max(1, len(xs) // 5)
        ax.set_xticks(xs[::step], [human_bytes(2**x).replace(".00", "") for x in xs[::step]], fontsize=7)
        ax.set_title(s["name"], fontsize=9)
        ax.set_ylabel("calls (all ranks)")
        ax.margins(y=0.12)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.suptitle("Message-size histograms, measured steps (x: message size, log2 buckets)", y=1.0)
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


def _grid(entries: list[dict[str, Any]], n: int) -> list[list[float]]:
    g = [[0.0] * n for _ in range(n)]
    for e in entries:
        g[e["src"]][e["dst"]] = float(e["bytes_per_step"])
    return g


def plot_matrix(s: dict[str, Any], path: Path) -> str:
    """Predicted and measured rank x rank bytes per step on one shared log colour scale, and their
    difference (measured - predicted; white where they agree)."""
    plt = _plt()
    from matplotlib.colors import LogNorm, TwoSlopeNorm

    n = s["world_size"]
    tm = s["traffic_matrix"]
    grids = [_grid(tm["predicted"], n), _grid(tm["measured"], n)]
    positive = [v for g in grids for row in g for v in row if v > 0]
    fig, axes = plt.subplots(1, 3, figsize=(12.6, 3.9))
    norm = LogNorm(vmin=min(positive), vmax=max(positive)) if positive else None
    im = None
    diff = [[m - p for p, m in zip(pr, mr, strict=True)] for pr, mr in zip(grids[0], grids[1], strict=True)]
    worst = max((abs(v) for row in diff for v in row), default=0.0)
    for ax, g, title in zip(axes[:2], grids, ("predicted (model)", "measured"), strict=True):
        masked = [[v if v > 0 else float("nan") for v in row] for row in g]
        im = ax.imshow(masked, cmap="viridis", norm=norm)
        ax.set_title(title)
    dn = TwoSlopeNorm(vcenter=0.0, vmin=-worst, vmax=worst) if worst else None
    dim = axes[2].imshow(diff, cmap="RdBu_r", norm=dn) if worst else axes[2].imshow(diff, cmap="Greys", vmin=0, vmax=1)
    axes[2].set_title("measured - predicted" if worst else "measured - predicted: 0 everywhere")
    for ax in axes:
        ax.set_xlabel("destination rank")
        ax.set_ylabel("source rank")
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.grid(False)
    if im is not None and positive:
        cb = fig.colorbar(im, ax=list(axes[:2]), shrink=0.85)
        cb.set_label("bytes per step")
    if worst:
        fig.colorbar(dim, ax=axes[2], shrink=0.85).set_label("bytes per step")
    fig.suptitle(f"{s['name']}: traffic matrix")
    return _save(fig, path)


def plot_timeline(s: dict[str, Any], path: Path) -> str:
    """Every rank's calls over its clock, coloured by collective; step boundaries dashed; cold-start
    spikes (first call of a kind in step 0 far above its steady median) circled and labelled."""
    plt = _plt()
    cap = Capture.from_json(s["capture"])
    n = cap.world_size
    fig, ax = plt.subplots(figsize=(12, 0.45 * n + 1.6))
    by_op: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for c in cap.calls:
        if c.duration_ns is not None and c.step >= 0:
            by_op[c.op][c.rank].append((c.start_ns / 1e6, max(c.duration_ns / 1e6, 0.02)))
    for op, ranks in sorted(by_op.items()):
        for r, spans in ranks.items():
            ax.broken_barh(
                spans, (r - 0.38, 0.76), color=OP_COLORS.get(op, "#999999"), label=op if r == min(ranks) else None
            )
    for w in cap.step_windows:
        ax.plot([w.start_ns / 1e6] * 2, [w.rank - 0.45, w.rank + 0.45], "--", color="#333333", lw=0.7)
    spikes = [ColdStart(**c) for c in s.get("cold_starts", [])]  # by the scenario's rule, as the gate flags them
    firsts: dict[tuple[int, str, int], CapturedCall] = {}
    for c in cap.calls:
        if c.step == 0 and c.duration_ns is not None:
            firsts.setdefault((c.rank, c.op, c.bytes), c)
    for k in spikes[:6]:
        first = firsts.get((k.rank, k.op, k.bytes))
        if first is None or first.duration_ns is None:
            continue
        x = (first.start_ns + first.duration_ns) / 1e6
        ax.plot([x], [first.rank], "o", ms=12, mfc="none", mec="red", mew=1.6)
        label = f"cold {k.op}: {k.first_ms:.0f} ms ({k.ratio:.0f}x)"
        box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}
        ax.annotate(
            label, (x, first.rank), xytext=(8, -3), textcoords="offset points", color="red", fontsize=7, bbox=box
        )
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the rank's first call (each rank's own clock; dashed: step starts)")
    ax.set_title(f"{s['name']}: calls per rank (red circles: cold-start spikes by the scenario's rule)", pad=22)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(
        uniq.values(), uniq.keys(), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=8, fontsize=7, frameon=False
    )
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
    return "s-" + _slug(s["name"])


def _has_findings(s: dict[str, Any]) -> bool:
    return bool(s.get("reason") or s.get("findings"))


def _name_cell(s: dict[str, Any]) -> str:
    """The scenario's name, linked to its findings when it has any (HTML-escaped)."""
    name = html.escape(s["name"])
    return f'<a href="#{_anchor(s)}">{name}</a>' if _has_findings(s) else name


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
        parts.append(
            f'<h3 id="{_anchor(s)}" class="{cls}">{html.escape(s["name"])}: {html.escape(s["status"])}</h3>'
            f"<pre>{html.escape(chr(10).join(lines))}</pre>"
        )
        parts.append(_diff_table(s))
    return "\n".join(parts)


_DIFF = re.compile(r"^(?P<what>.+): obtained (?P<now>\S+), expected (?P<then>\S+?)(?: B/step)? \((?P<delta>[^)]*)\)$")


def _diff_table(s: dict[str, Any]) -> str:
    """The failing findings' obtained / expected / difference lines (against the baseline or the model)
    as a table: what, now, expected, difference."""
    rows = []
    for f in s.get("findings", []):
        if not f["fail"]:
            continue
        for line in f["lines"]:
            if m := _DIFF.match(line):
                cells = [f["kind"], m["what"], m["now"], m["then"], m["delta"]]
                rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("against", "what", "now", "expected", "difference"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _table(doc: dict[str, Any]) -> str:
    head = ["scenario", "scheme", "ranks", "status", "bytes measured / step", "model", "unexplained"]
    head += ["in flight measured", "model", "error", "step measured", "model"]
    rows = []
    for s in doc["scenarios"]:
        cells = [s["name"], s["scheme"], str(s["world_size"]), s["status"]]
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
        name, rest = cells[0], cells[1:]
        rows.append(f"<tr{cls}><td>{name}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in rest) + "</tr>")
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
    ("histograms", "Message sizes", "Calls per message-size bucket in the measured steps (Anthony et al., Fig. 9)."),
    ("sweeps", "Sweeps", "Sequence-length sweeps (Anthony et al., Figs. 14-15) and strong/weak scaling (Qi et al.): "
     "volume per collective (model lines, measured circles) and the communication fraction, model and measured."),
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


def page(doc: dict[str, Any], figures: dict[str, str | None], details: dict[str, dict[str, str]]) -> str:
    env = doc.get("environment", {})
    meta = ", ".join(f"{k} {env[k]}" for k in ("commgate", "torch", "deepspeed", "python", "platform") if env.get(k))
    links = '<a href="report.json">report.json</a> &middot; <a href="trace.json">trace.json</a> (ui.perfetto.dev)'
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<title>commgate report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>commgate report</h1>",
        f'<div class="meta">{html.escape(doc.get("created", ""))} &middot; {html.escape(meta)} &middot; {links}</div>',
        _counts(doc),
        "<h2>Scenarios</h2>",
        _table(doc),
        _findings(doc),
    ]
    for key, title, note in FIGURES:
        if src := figures.get(key):
            parts.append(f'<h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>{_img(src, title)}')
    ran = _ran(doc)
    if len(ran) > len(details):
        left = ", ".join(s["name"] for s in ran if s["name"] not in details)
        parts.append(
            f'<p class="note">Traffic matrices and timelines are drawn for {len(details)} of {len(ran)} scenarios '
            f"(failing ones first); left out: {html.escape(left)}. report.json and trace.json hold them all.</p>"
        )
    for title, key in (("Traffic matrices", "matrix"), ("Timelines", "timeline")):
        items = [(name, d[key]) for name, d in details.items() if key in d]
        if items:
            parts.append(f"<h2>{title}</h2>")
            for i, (name, src) in enumerate(items):
                opened = " open" if i == 0 else ""
                body = _img(src, f"{title}: {name}")
                parts.append(f"<details{opened}><summary>{html.escape(name)}</summary>{body}</details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(out: Path, doc: dict[str, Any], *, progress: Callable[[str], None] | None = None) -> Path:
    """Render ``doc`` (a report document) into ``out``: plots/*.png, trace.json, then index.html last."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    ran = _ran(doc)
    figures: dict[str, str | None] = {}
    details: dict[str, dict[str, str]] = {}
    if ran:
        figures["volume"] = plot_volume(ran, plots / "volume.png")
        figures["predicted"] = plot_predicted_measured(ran, plots / "predicted_vs_measured.png")
        figures["time"] = plot_time_model(ran, plots / "time_model.png")
        figures["histograms"] = plot_histograms(ran[: MAX_DETAIL * 2], plots / "message_sizes.png")
        figures["sweeps"] = plot_sweeps(ran, plots / "sweeps.png")
        failing_first = sorted(ran, key=lambda s: s["status"] == "passed")
        for i, s in enumerate(failing_first[:MAX_DETAIL]):
            if progress:
                progress(f"report: plots for {s['name']} ({i + 1}/{min(len(ran), MAX_DETAIL)})")
            slug = _slug(s["name"])
            d = details.setdefault(s["name"], {})
            d["matrix"] = plot_matrix(s, plots / f"matrix-{slug}.png")
            if s.get("capture"):
                d["timeline"] = plot_timeline(s, plots / f"timeline-{slug}.png")
    atomic_write_json(out / "trace.json", trace(doc))
    return atomic_write_text(out / "index.html", page(doc, figures, details))


__all__: Sequence[str] = ("trace", "write")
