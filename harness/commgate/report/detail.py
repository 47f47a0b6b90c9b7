"""Each scenario's own figures, drawn straight into the page as HTML and inline SVG (no matplotlib), so
that every scenario gets them at a few milliseconds each: its traffic matrices, predicted next to
measured with their difference [APNet]; its per-rank call timeline (a panel per step) with the
cold-start spikes the gate flags circled [Anthony et al. Section V]; and its message-size histogram
[Anthony et al. Fig. 9].

Sizes stay bounded whatever the run: a timeline merges the calls of one op that fall within the same
pixel, and a matrix of more than ``MAX_CELLS`` ranks a side is drawn in blocks of ranks."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from commgate.core.units import human_bytes

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
OTHER = "#999999"
MAX_CELLS = 32
"""A traffic matrix is drawn with at most this many rows and columns (blocks of ranks beyond)."""
SPAN = 1024.0
"""A traffic matrix's colour scale spans at least this factor below its largest cell (a log scale)."""
WIDTH = 960
"""The timeline's drawing width in pixels (calls closer than half a pixel are merged)."""
_VIRIDIS = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725")

CSS = """
.legend span{display:inline-block;margin-right:10px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
.matrices{display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start;margin:6px 0}
table.tm{border-collapse:collapse;width:auto;font-size:10px} table.tm td,table.tm th{border:1px solid #fff;
  padding:0;width:18px;height:18px;text-align:center;background:none;position:static}
table.tm caption{font-size:12px;font-weight:600;text-align:left;padding-bottom:2px}
svg text{font:10px system-ui,sans-serif}
"""


def _hex(c: str) -> tuple[int, int, int]:
    return int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)


def _mix(a: str, b: str, t: float) -> str:
    ra, rb = _hex(a), _hex(b)
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ra, rb, strict=True))


def _viridis(t: float) -> str:
    """A colour of the viridis map at ``t`` in [0, 1]."""
    t = min(1.0, max(0.0, t)) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    return _mix(_VIRIDIS[i], _VIRIDIS[i + 1], t - i)


def _diverging(v: float, worst: float) -> str:
    """Blue below zero, white at zero, red above, saturating at ``worst``."""
    t = min(1.0, abs(v) / worst) if worst else 0.0
    return _mix("#ffffff", "#b2182b" if v > 0 else "#2166ac", t)


def legend(ops: Sequence[str]) -> str:
    swatch = '<span><i style="background:{}"></i>{}</span>'
    items = "".join(swatch.format(OP_COLORS.get(op, OTHER), html.escape(op)) for op in ops)
    return f'<div class="legend">{items}</div>'


def _grid(entries: list[dict[str, Any]], n: int, size: int) -> list[list[float]]:
    """Bytes per step between blocks of ``ceil(n / size)`` ranks (one rank a block when ``n <= size``)."""
    per = math.ceil(n / size)
    g = [[0.0] * size for _ in range(size)]
    for e in entries:
        g[e["src"] // per][e["dst"] // per] += float(e["bytes_per_step"])
    return g


def _labels(n: int, size: int) -> list[str]:
    per = math.ceil(n / size)
    return [str(i * per) if per == 1 else f"{i * per}-{min(n, (i + 1) * per) - 1}" for i in range(size)]


def _matrix_table(caption: str, grid: list[list[float]], labels: list[str], color: Any) -> str:
    head = "".join(f"<th>{html.escape(x)}</th>" for x in labels)
    rows = []
    for src, row in zip(labels, grid, strict=True):
        cells = "".join(
            f'<td style="background:{color(v)}" title="{src} &#8594; {dst}: {html.escape(human_bytes(v))}"></td>'
            for dst, v in zip(labels, row, strict=True)
        )
        rows.append(f"<tr><th>{html.escape(src)}</th>{cells}</tr>")
    return (
        f'<table class="tm"><caption>{html.escape(caption)}</caption>'
        f"<tr><th>src\\dst</th>{head}</tr>{''.join(rows)}</table>"
    )


def matrices(s: dict[str, Any]) -> str:
    """Predicted and measured rank x rank bytes per step (one shared log colour scale) and their difference
    (measured - predicted; white where they agree), as tables whose cells give the bytes on hover."""
    n = s["world_size"]
    size = min(n, MAX_CELLS)
    tm = s["traffic_matrix"]
    pred, meas = _grid(tm["predicted"], n, size), _grid(tm["measured"], n, size)
    positive = [v for g in (pred, meas) for row in g for v in row if v > 0]
    hi = math.log(max(positive)) if positive else 0.0
    # the dark end at least SPAN below the largest: cells 714.50 KiB and 714.59 KiB were drawn as opposite ends
    lo = min(math.log(min(positive)), hi - math.log(SPAN)) if positive else 0.0

    def shade(v: float) -> str:
        if v <= 0:
            return "#f2f2f2"
        return _viridis((math.log(v) - lo) / (hi - lo) if hi > lo else 1.0)

    diff = [[m - p for p, m in zip(pr, mr, strict=True)] for pr, mr in zip(pred, meas, strict=True)]
    worst = max((abs(v) for row in diff for v in row), default=0.0)
    labels = _labels(n, size)
    ranks = "ranks" if size == n else f"blocks of {math.ceil(n / size)} ranks"
    scale = "no traffic"
    if positive:
        scale = f"{human_bytes(math.exp(lo))} (dark) to {human_bytes(max(positive))} (yellow)"
    agree = "0 everywhere" if not worst else f"largest {human_bytes(worst)} (red: more measured, blue: less)"
    return (
        '<div class="matrices">'
        + _matrix_table("predicted (model)", pred, labels, shade)
        + _matrix_table("measured", meas, labels, shade)
        + _matrix_table("measured - predicted", diff, labels, lambda v: _diverging(v, worst))
        + f'</div><p class="note">Traffic matrix, bytes per step between {ranks} (source row, destination '
        f"column; hover a cell for its bytes); colour: log scale from {scale}; difference: {agree}.</p>"
    )


def _panels(cap: dict[str, Any], calls: list[dict[str, Any]]) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """Where each rank's step begins on its own clock, and each step's length on its slowest rank: from the
    step windows, stretched over any call of the step that began before or ended after its window (a rank
    without windows: its calls alone)."""
    start: dict[tuple[int, int], int] = {}
    end: dict[tuple[int, int], int] = {}
    for w in cap.get("step_windows", []):
        start[w["rank"], w["step"]] = w["start_ns"]
        end[w["rank"], w["step"]] = w["end_ns"]
    for c in calls:
        key = (c["rank"], c["step"])
        start[key] = min(start.get(key, c["start_ns"]), c["start_ns"])
        end[key] = max(end.get(key, 0), c["start_ns"] + c["duration_ns"])
    length: dict[int, int] = defaultdict(int)
    for key, a in start.items():
        length[key[1]] = max(length[key[1]], end[key] - a, 1)
    return start, dict(sorted(length.items()))


def _ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:,.0f} ms"


def timeline(s: dict[str, Any], spikes: Sequence[dict[str, Any]]) -> str:
    """Every rank's calls, one panel per step and one colour per op: within a panel, time since the step
    began on the rank's own clock, on a scale common to all ranks (the step's length on its slowest rank,
    written under it), so that a 900 ms first step does not squeeze the steady ones into a few pixels;
    calls of one op within half a pixel merged; warm-up steps shaded; ``spikes`` (the gate's cold starts)
    circled at the end of their first call and named in the margin, one line per rank."""
    cap = s["capture"]
    n = cap["world_size"]
    calls = [c for c in cap["calls"] if c["duration_ns"] is not None and c["step"] >= 0]
    start, length = _panels(cap, calls)
    steps = list(length)
    left, row, top, gap, margin = 56, 16, 6, 6, 230
    pw = (WIDTH - gap * (len(steps) - 1)) / max(len(steps), 1)
    base = {k: i * (pw + gap) for i, k in enumerate(steps)}

    def x(rank: int, step: int, t_ns: float) -> float:
        frac = (t_ns - start.get((rank, step), t_ns)) / length[step]
        return base[step] + min(max(frac, 0.0), 1.0) * pw

    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for c in calls:
        r, k, t = c["rank"], c["step"], c["start_ns"]
        x0 = x(r, k, t)
        spans[(r, c["op"])].append((x0, max(x(r, k, t + c["duration_ns"]), x0 + 0.6)))
    warm = cap.get("warmup_steps", 0)
    bottom = top + n * row
    parts = [
        f'<rect x="{left + base[k]:.1f}" y="{top}" width="{pw:.1f}" height="{n * row}" fill="#f3f3f3"/>'
        for k in steps
        if k < warm
    ]
    for (rank, op), xs in sorted(spans.items()):
        xs.sort()
        merged = [list(xs[0])]
        for a, b in xs[1:]:
            if a <= merged[-1][1] + 0.5:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        y = top + rank * row + 2
        rects = "".join(f'<rect x="{left + a:.1f}" y="{y}" width="{b - a:.1f}" height="{row - 4}"/>' for a, b in merged)
        parts.append(f'<g fill="{OP_COLORS.get(op, OTHER)}">{rects}</g>')
    firsts: dict[tuple[int, str, int], dict[str, Any]] = {}
    for c in calls:
        if c["step"] == 0:
            firsts.setdefault((c["rank"], c["op"], c["bytes"]), c)
    named: dict[int, list[str]] = defaultdict(list)
    for k in spikes:
        first = firsts.get((k["rank"], k["op"], k["bytes"]))
        if first is None:
            continue
        cx, cy = left + x(k["rank"], 0, first["start_ns"] + first["duration_ns"]), top + k["rank"] * row + row / 2
        ratio = k["first_ms"] / k["steady_ms"] if k["steady_ms"] > 0 else math.inf
        label = f"cold {k['op']}: {k['first_ms']:.0f} ms ({ratio:.0f}x)"
        parts.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="none" stroke="red" stroke-width="1.6">'
            f"<title>{html.escape(label)}</title></circle>"
        )
        named[k["rank"]].append(label)
    for rank, labels in named.items():  # in the margin, where no bar is drawn
        text = labels[0] + (f" (+{len(labels) - 1} more)" if len(labels) > 1 else "")
        parts.append(
            f'<text x="{left + WIDTH + 8}" y="{top + rank * row + row - 4}" fill="red">{html.escape(text)}'
            f"<title>{html.escape('; '.join(labels))}</title></text>"
        )
    height = bottom + 40
    axis = [f'<text x="{left - 4}" y="{top + r * row + row - 4}" text-anchor="end">rank {r}</text>' for r in range(n)]
    every = max(1, math.ceil(80 / pw))  # a label under every panel it fits under
    for i, k in enumerate(steps):
        x0 = left + base[k]
        axis.append(f'<line x1="{x0:.1f}" x2="{x0 + pw:.1f}" y1="{bottom}" y2="{bottom}" stroke="#999"/>')
        if i % every == 0:
            name = f"step {k}" + (" (warm-up)" if k < warm else "")
            axis.append(
                f'<text x="{x0 + pw / 2:.1f}" y="{bottom + 12}" text-anchor="middle">{name}</text>'
                f'<text x="{x0 + pw / 2:.1f}" y="{bottom + 23}" text-anchor="middle">{_ms(length[k])}</text>'
            )
    axis.append(
        f'<text x="{left + WIDTH}" y="{height - 1}" text-anchor="end">each step on its own scale: time since it '
        "began on the rank's clock, up to its length on the slowest rank</text>"
    )
    width = left + WIDTH + (margin if named else 10)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="timeline of {html.escape(s["name"])}">{"".join(axis)}{"".join(parts)}</svg>'
    )


def histogram(s: dict[str, Any]) -> str:
    """Calls per message-size bucket (log2) in the measured steps, all ranks, stacked by op."""
    cap = s["capture"]
    first = cap.get("warmup_steps", 0)
    by_op: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for c in cap["calls"]:
        if c["step"] >= first:
            by_op[c["op"]][max(0, math.floor(math.log2(max(1, c["bytes"]))))] += 1
    buckets = sorted({b for d in by_op.values() for b in d})
    if not buckets:
        return ""
    xs = list(range(buckets[0], buckets[-1] + 1))
    totals = [sum(d.get(x, 0) for d in by_op.values()) for x in xs]
    peak = max(totals)
    left, bar, height, base = 44, 26, 110, 120
    parts = []
    for i, x in enumerate(xs):
        y = float(base)
        for op in sorted(by_op):
            v = by_op[op].get(x, 0)
            if v:
                h = height * v / peak
                y -= h
                tip = f"{op}: {v} calls of {human_bytes(2**x)} to {human_bytes(2 ** (x + 1))}"
                parts.append(
                    f'<rect x="{left + i * bar + 2}" y="{y:.1f}" width="{bar - 4}" height="{h:.1f}" '
                    f'fill="{OP_COLORS.get(op, OTHER)}"><title>{html.escape(tip)}</title></rect>'
                )
        if i % max(1, len(xs) // 8) == 0:
            label = human_bytes(2**x).replace(".00", "")
            parts.append(f'<text x="{left + i * bar + bar / 2}" y="{base + 13}" text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{left - 4}" y="{base - height + 8}" text-anchor="end">{peak}</text>')
    parts.append(f'<text x="{left - 4}" y="{base}" text-anchor="end">0</text>')
    width = left + len(xs) * bar + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base + 20}" role="img" '
        f'aria-label="message sizes of {html.escape(s["name"])}">{"".join(parts)}</svg>'
        '<p class="note">Calls per message-size bucket (log2, all ranks) in the measured steps; the scale at '
        "the left runs from 0 to the tallest bar's number of calls (hover a bar for its op, calls and sizes).</p>"
    )
