"""Every scenario's own figures, drawn inline (commgate.report.detail): bounded in size however many calls
or ranks a run has, and faithful to the numbers they draw."""

from __future__ import annotations

import re
from typing import Any

from commgate.report import detail


def call(rank: int, op: str, start_ms: float, dur_ms: float, nbytes: int = 1024, step: int = 1) -> dict[str, Any]:
    return {
        "rank": rank,
        "op": op,
        "start_ns": int(start_ms * 1e6),
        "duration_ns": int(dur_ms * 1e6),
        "bytes": nbytes,
        "step": step,
    }


def scenario(calls: list[dict[str, Any]], world: int = 2, traffic: Any = None) -> dict[str, Any]:
    return {
        "name": "s",
        "world_size": world,
        "capture": {"world_size": world, "warmup_steps": 1, "calls": calls, "step_windows": []},
        "traffic_matrix": traffic or {"predicted": [], "measured": []},
    }


def rects(svg: str) -> list[tuple[float, float]]:
    return [(float(x), float(w)) for x, w in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)]


def test_a_timeline_merges_calls_within_a_pixel_and_keeps_gaps() -> None:
    calls = [call(0, "all_reduce", 0, 1), call(0, "all_reduce", 500, 1), call(0, "all_reduce", 500.2, 1)]
    calls.append(call(1, "broadcast", 999, 1))
    svg = detail.timeline(scenario(calls), [])
    assert len(rects(svg)) == 3  # the two calls 0.2 ms apart (0.19 px at 1000 ms) are one bar
    assert "rank 0" in svg and "rank 1" in svg


def test_a_timeline_of_a_hundred_thousand_calls_stays_small() -> None:
    calls = [call(r, op, i * 0.01, 0.004) for r in range(4) for i in range(25_000) for op in ("all_reduce",)]
    svg = detail.timeline(scenario(calls, world=4), [])
    assert len(svg) < 60_000  # one bar per rank and op where calls are denser than pixels
    assert len(rects(svg)) == 4


def test_the_gates_cold_starts_are_circled_and_named_in_the_margin_beside_the_bars() -> None:
    """At 16 ranks the labels sat on the bars of the next calls, red on red, and overlapped (issue 29 item 9):
    each is now a line in the margin right of the drawing, on its rank's row, all of them (8 here)."""
    world = 16
    calls = [call(r, "recv", 0, 400, step=0) for r in range(world)] + [call(r, "recv", 450, 2) for r in range(world)]
    spikes = [{"rank": r, "op": "recv", "bytes": 1024, "first_ms": 400.0 + r, "steady_ms": 2.0} for r in range(8)]
    svg = detail.timeline(scenario(calls, world=world), spikes)
    assert svg.count("<circle") == 8
    labels = re.findall(r'<text x="([\d.]+)" y="([\d.]+)" fill="red">([^<]*)<title>', svg)
    assert [t for _, _, t in labels] == [f"cold recv: {400 + r} ms ({(400 + r) / 2:.0f}x)" for r in range(8)]
    right = max(x + w for x, w in rects(svg))
    assert all(float(x) > right for x, _, _ in labels)  # in the margin, past every bar
    assert len({y for _, y, _ in labels}) == 8  # one row each
    width = float(re.search(r'<svg [^>]*width="(\d+)"', svg).group(1))
    assert width > max(float(x) for x, _, _ in labels) + 150  # and the margin holds them
    assert "<circle" not in detail.timeline(scenario(calls, world=world), [])


def test_a_slow_first_step_does_not_squeeze_the_steady_ones() -> None:
    """A 950 ms warm-up step and 20 ms steady steps: on one linear axis the steady steps' calls took 5 % of the
    width (seen at 2 ranks, issue 29 item 9). Each step is a panel of its own, its length written under it."""
    cap_calls = [call(0, "broadcast", 940, 5, step=0)] + [
        call(0, "all_reduce", 935 + 20 * k, 10, step=k) for k in (1, 2)
    ]
    windows = [{"rank": 0, "step": 0, "start_ns": 0, "end_ns": int(950e6)}]
    windows += [
        {"rank": 0, "step": k, "start_ns": int((950 + 20 * (k - 1)) * 1e6), "end_ns": int((950 + 20 * k) * 1e6)}
        for k in (1, 2)
    ]
    s = scenario(cap_calls, world=1)
    s["capture"]["step_windows"] = windows
    svg = detail.timeline(s, [])
    bars = sorted(rects(svg))[-2:]  # the two all-reduces: half of their steps' panels each
    assert all(w > 100 for _, w in bars), bars
    for text in ("step 0 (warm-up)", "950 ms", "step 1", "20 ms", "step 2"):
        assert f">{text}</text>" in svg


def test_a_histogram_counts_the_measured_steps_calls_per_size_bucket() -> None:
    calls = [call(0, "all_reduce", i, 1, nbytes=1000) for i in range(3)] + [call(1, "all_gather", 0, 1, 5000)]
    calls.append(call(0, "all_reduce", 0, 1, nbytes=1000, step=0))  # a warm-up step: not counted
    svg = detail.histogram(scenario(calls))
    assert "all_reduce: 3 calls of 512 B to 1.00 KiB" in svg and "all_gather: 1 calls of 4.00 KiB to 8.00 KiB" in svg


def test_a_large_world_is_drawn_in_blocks_of_ranks_with_their_bytes_summed() -> None:
    n = 1024
    ring = [{"src": r, "dst": (r + 1) % n, "bytes_per_step": 10} for r in range(n)]
    html = detail.matrices(scenario([], world=n, traffic={"predicted": ring, "measured": ring}))
    assert html.count("<td") == 3 * 32 * 32 and "blocks of 32 ranks" in html
    assert 'title="0-31 &#8594; 0-31: 310 B"' in html  # 31 of the ring's hops stay inside the first block
    assert 'title="0-31 &#8594; 32-63: 10 B"' in html
    assert "difference: 0 everywhere" in html


def test_a_difference_names_its_largest_cell() -> None:
    pred = [{"src": 0, "dst": 1, "bytes_per_step": 100}]
    meas = [{"src": 0, "dst": 1, "bytes_per_step": 116}, {"src": 1, "dst": 0, "bytes_per_step": 4}]
    html = detail.matrices(scenario([], traffic={"predicted": pred, "measured": meas}))
    assert "difference: largest 16 B" in html and 'title="1 &#8594; 0: 4 B"' in html


def test_cells_nearly_equal_are_coloured_alike_and_the_scale_spans_three_decades() -> None:
    """Two cells of 714.50 KiB and 714.59 KiB were the darkest and the brightest colour of the scale (found by
    a newcomer's walkthrough): the scale now reaches at least 1024x below its largest cell."""
    cells = [{"src": 0, "dst": 1, "bytes_per_step": 731_648}, {"src": 1, "dst": 0, "bytes_per_step": 731_740}]
    html = detail.matrices(scenario([], traffic={"predicted": cells, "measured": cells}))
    predicted = html.split("<table")[1]  # (the difference table is white where they agree)
    shades = set(re.findall(r'background:(#[0-9a-f]{6})" title="(?:0 &#8594; 1|1 &#8594; 0)', predicted))
    assert len(shades) == 1, shades  # (to the 8-bit colour)
    assert "colour: log scale from 714.50 KiB" not in html and "(dark) to 714.59 KiB (yellow)" in html


def test_byte_figures_draw_bars_from_zero_or_points_on_a_log_axis() -> None:
    """A log axis under bars drew 1.4 MiB against 2.8 MiB as 5 % against 100 % (a newcomer's walkthrough): a
    narrow span is bars from zero on a linear axis; a wide one, points on a log axis with ticks at both ends."""
    from commgate.report import plots

    plt = plots.pyplot()
    narrow, wide = [1.4 * 2**20, 2.8 * 2**20], [64 * 2**10, 16 * 2**20]
    fig, (a, b) = plt.subplots(1, 2)
    plots._byte_series(a, [(narrow, 0.0, "measured", "#000000", "o")], [0, 1], 0.8)
    plots._byte_series(b, [(wide, 0.0, "measured", "#000000", "o")], [0, 1], 0.8)
    assert a.get_xscale() == "linear" and a.get_xlim()[0] == 0 and len(a.patches) == 2
    widths = sorted(p.get_width() for p in a.patches)
    assert widths[1] / widths[0] == 2.0  # lengths in proportion
    assert b.get_xscale() == "log" and not b.patches and len(b.collections) == 1
    lo, hi = b.get_xlim()
    assert lo < wide[0] and hi > wide[1]  # padded: both points inside, not on the edge
    plt.close(fig)
