"""The plots across a report's scenarios, PNG by matplotlib's Agg backend (the papers' figures they follow
in brackets): volume per collective per scenario [Anthony et al. Figs. 7-8]; paper vs model vs measured
volume and the communication fraction, predicted vs measured [Anthony et al. Figs. 10, 13; Qi et al.
table; APNet]; sweeps over sequence length [Anthony et al. Figs. 14-15] and scale [Qi et al.]; the APNet
model's iteration-time breakdown; and the communication fraction over links of different speeds [Qi et
al.]. Each is drawn from the report document alone (``commgate.report.htmlreport`` places them on the page).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commgate.core.fsutil import atomic_write_bytes
from commgate.core.units import human_bytes
from commgate.report.detail import OP_COLORS
from commgate.report.report import modelled


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, with the report's style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(fig: Any, path: Path) -> str:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    pyplot().close(fig)
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


WIDE = 20.0
"""Byte values spanning more than this factor are drawn on a log axis, as points (a bar's length on a log
axis starts at an arbitrary edge and misleads: 1.4 MiB against 2.8 MiB drew as 5 % against 100 %); others
as bars from zero on a linear axis."""


def _wide(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) > 1 and max(positive) / min(positive) > WIDE


def _byte_series(ax: Any, series: list[tuple[list[float], float, str, str, str]], y: list[int], h: float) -> None:
    """Draw byte values per row: each series (values, row offset, label, colour, marker) as bars from zero
    on a linear axis, or, where they span more than ``WIDE``, as points on a log axis padded to powers of
    two (ticks at both ends, even for one row)."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    every = [v for values, *_ in series for v in values]
    if _wide(every):
        for values, off, label, color, marker in series:
            shown = [(v, r + off) for v, r in zip(values, y, strict=True) if v > 0]
            ax.scatter([v for v, _ in shown], [r for _, r in shown], s=36, color=color, marker=marker, label=label,
                       zorder=3)  # fmt: skip
        positive = [v for v in every if v > 0]
        ax.set_xscale("log")
        ax.set_xlim(2 ** math.floor(math.log2(min(positive)) - 1), 2 ** math.ceil(math.log2(max(positive)) + 1))
        _bytes_axis(ax)
        ax.set_xlabel("bytes per step, all ranks (log)")
        return
    for values, off, label, color, _ in series:
        ax.barh([r + off for r in y], values, h, label=label, color=color)
    top = max(every, default=0.0) or 1.0
    step = 2 ** math.ceil(math.log2(top / 5))  # at most six ticks, at round binary sizes
    ax.set_xlim(0, math.ceil(top * 1.05 / step) * step)
    ax.xaxis.set_major_locator(MultipleLocator(step))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".00", "") if v > 0 else "0"))
    ax.set_xlabel("bytes per step, all ranks")


LABEL = 60
"""The longest scenario name a plot's axis shows whole; a longer one (a sweep's ids) keeps its two ends."""


def _label(name: str) -> str:
    """``name`` for an axis: whole up to ``LABEL`` characters, else its start and its end (where a sweep's
    ids differ) around an ellipsis."""
    return name if len(name) <= LABEL else f"{name[: LABEL // 2 - 1]}…{name[-(LABEL // 2 - 1) :]}"


def _tight(fig: Any) -> None:
    """``fig.tight_layout()``, without matplotlib's warning where labels leave it no room (the figure is
    saved as it is laid out; the warning named commgate's source lines on the console)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Tight layout not applied", category=UserWarning)
        fig.tight_layout()


def _legend_above(ax: Any, ncol: int, **kw: Any) -> None:
    """The legend in a row between the title and the plot, where it covers nothing."""
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol, fontsize=8, frameon=False, **kw)


def plot_volume(scenarios: list[dict[str, Any]], path: Path) -> str:
    """Measured bytes per step: the total (log) and each collective's share, per scenario."""
    plt = pyplot()
    names = [s["name"] for s in scenarios]
    ops = sorted({o["op"] for s in scenarios for o in s["collectives"]})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.38 * len(names) + 1.6), sharey=True)
    y = range(len(names))
    totals = [sum(o["measured_bytes"] for o in s["collectives"]) for s in scenarios]
    _byte_series(a1, [(totals, 0.0, "measured", "#4c72b0", "o")], list(y), 0.8)
    a1.set_yticks(list(y), [_label(n) for n in names])
    a1.invert_yaxis()
    a1.set_title("Communication volume per step (measured)", pad=22)
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
    _tight(fig)
    return _save(fig, path)


def plot_predicted_measured(scenarios: list[dict[str, Any]], path: Path) -> str:
    """Paper (idealised) vs model vs measured bytes per step, and the communication fraction."""
    plt = pyplot()
    names = [s["name"] for s in scenarios]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.42 * len(names) + 1.8), sharey=True)
    y = list(range(len(names)))
    h = 0.27
    measured = [sum(o["measured_bytes"] for o in s["collectives"]) for s in scenarios]
    model = [sum(modelled(o) for o in s["collectives"]) for s in scenarios]
    paper = [paper_all_ranks(s) for s in scenarios]
    _byte_series(
        a1,
        [
            (paper, -h, "paper Eqs. 2-5 (idealised, every rank alike)", "#999999", "o"),
            (model, 0.0, "commgate model", "#4c72b0", "s"),
            (measured, h, "measured", "#dd8452", "D"),
        ],
        y,
        h,
    )
    a1.set_yticks(y, [_label(n) for n in names])
    a1.invert_yaxis()
    a1.set_title("Volume: paper vs model vs measured", pad=22)
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
    _tight(fig)
    return _save(fig, path)


def paper_all_ranks(s: dict[str, Any]) -> float:
    """The paper's bytes per step over the ranks whose bytes the run measured (every rank, or those an
    emulated run started), as the paper sees them: each equation gives one rank's volume (Eqs. 2, 3, 5) or
    one pipeline's (Eq. 4), and every rank or pipeline sends alike. A report written before
    ``paper_ranks`` was recorded: a term not per rank covers one pipeline."""
    measured = len(s["capture"]["ranks"]) if (s.get("capture") or {}).get("ranks") is not None else s["world_size"]
    pp = s["prediction"]["parallelism"].get("pp", 1)
    total = 0.0
    for c in s["prediction"]["paper_comparison"]:
        ranks = c.get("paper_ranks") or (1 if c["equation"] != "Eq. 4" else pp)
        total += float(c["paper_bytes"]) * measured / ranks
    return total


def _frac(s: dict[str, Any], side: str) -> float | None:
    value = (s.get("comm_fraction") or {}).get(side)
    return float(value) if value is not None else None


def plot_time_model(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """The APNet model's T_iter breakdown for rank 0 next to the measured step time."""
    rows = [s for s in scenarios if (s.get("time_model") or {}).get("predicted")]
    if not rows:
        return None
    plt = pyplot()
    names = [s["name"] for s in rows]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(names) + 1.8))
    y = list(range(len(names)))
    parts = [("t_comp_s", "T_comp", "#8da0cb"), ("t_tp_s", "T_TP", "#66c2a5"), ("t_pp_s", "T_PP", "#e78ac3")]
    parts += [("t_dp_s", "T_DP", "#e7c94b"), ("t_ep_s", "T_EP", "#a6d854"), ("t_bubble_s", "T_bubble", "#cccccc")]
    left = [0.0] * len(rows)
    for key, label, color in parts:
        vals = [1e3 * s["time_model"]["predicted"][key] for s in rows]
        ax.barh([v - 0.18 for v in y], vals, 0.34, left=left, color=color, label=f"{label} (model)")
        left = [a + b for a, b in zip(left, vals, strict=True)]
    meas = [1e3 * ((s["time_model"].get("measured") or {}).get("t_iter_s") or 0) for s in rows]
    comm = [1e3 * ((s["time_model"].get("measured") or {}).get("t_comm_s") or 0) for s in rows]
    ax.barh([v + 0.18 for v in y], meas, 0.34, color="#dddddd", edgecolor="#555555", label="measured step")
    ax.barh([v + 0.18 for v in y], comm, 0.34, color="#dd8452", label="measured: a call in flight")
    ax.set_yticks(y, [_label(n) for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step, rank 0")
    ax.set_title("Iteration time: APNet model (upper bar) vs measured (lower bar)", pad=34)
    _legend_above(ax, ncol=4)
    _tight(fig)
    return _save(fig, path)


def link_of(s: dict[str, Any]) -> str | None:
    """The shaped link a scenario ran over (``commgate run --link``), or None."""
    return ((s.get("capture") or {}).get("stack") or {}).get("link")


def _link_order(s: dict[str, Any]) -> float:
    from commgate.run.links import Link

    link = link_of(s)
    return -Link.parse(link, source=f"{s.get('name')}: capture.stack.link").rate_mbit if link else -float("inf")


def plot_links(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """Qi et al.'s interconnect study: each workload's communication fraction against its iteration time,
    over every link it ran on (filled: measured; hollow: the model with that link's curve). Drawn when
    some scenario ran over a shaped link."""
    rows = [s for s in scenarios if (s.get("time_model") or {}).get("measured")]
    if not any(link_of(s) for s in rows):
        return None
    plt = pyplot()
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
    _tight(fig)
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
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, members) in enumerate(sorted(fams.items())):
        color = colors[i % len(colors)]
        xs = [_x(m, "model", "s") for m in members]
        pred = [sum(modelled(o) for o in m["collectives"]) for m in members]
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
    _tight(fig)
    return _save(fig, path)


def plot_sweeps(scenarios: list[dict[str, Any]], path: Path) -> str | None:
    """Per family: bytes per step per collective against the swept field (model lines, measured circles),
    and the share of rank 0's step with a call in flight (the APNet model and the run)."""
    fams = sweeps(scenarios)
    if not fams:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(fams), 2, figsize=(12.5, 3.7 * len(fams)), squeeze=False)
    for (a1, a2), (name, (key, label, members)) in zip(axes, sorted(fams.items()), strict=True):
        where = "model" if key == "s" else "parallelism"
        xs = [_x(m, where, key) for m in members]
        for op in sorted({o["op"] for m in members for o in m["collectives"]}):
            color = OP_COLORS.get(op, "#999999")
            pred = [sum(modelled(o) for o in m["collectives"] if o["op"] == op) for m in members]
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
    _tight(fig)
    return _save(fig, path)


PLOTS: tuple[tuple[str, Callable[[list[dict[str, Any]], Path], str | None], str], ...] = (
    ("volume", plot_volume, "volume.png"),
    ("predicted", plot_predicted_measured, "predicted_vs_measured.png"),
    ("time", plot_time_model, "time_model.png"),
    ("seqlen", plot_sequence_length, "sequence_length.png"),
    ("sweeps", plot_sweeps, "sweeps.png"),
    ("links", plot_links, "links.png"),
)
"""Every figure: its key on the page, how it is drawn, its file."""


def draw(
    scenarios: list[dict[str, Any]], folder: Path, *, progress: Callable[[str], None] | None = None
) -> dict[str, str | None]:
    """Every figure of the scenarios that ran into ``folder``: key -> its path relative to the page (None:
    nothing to draw, e.g. no sweep)."""
    folder.mkdir(parents=True, exist_ok=True)
    figures: dict[str, str | None] = {}
    if not scenarios:
        return figures
    for i, (key, plot, name) in enumerate(PLOTS):
        if progress:
            progress(f"report: {name} ({i + 1}/{len(PLOTS)})")
        figures[key] = plot(scenarios, folder / name)
    return figures
