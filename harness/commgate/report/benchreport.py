"""What the collective microbenchmarks found, from their result rows (torch-free; used by
``benchmarks/conftest.py`` and its tests): the harness path against the bare loop of the same run, and the
samples the effective-bandwidth curve is fitted from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from commgate.report.bandwidth import Sample


def harness_vs_bare(rows: Iterable[Mapping[str, Any]]) -> tuple[list[str], float | None]:
    """One line per interleaved A/B point (bare p50, harness p50, the capture's own p50 and the ratios
    harness/bare and captured/bare) and the largest harness/bare ratio."""
    ab = sorted((r for r in rows if r.get("path") == "ab"), key=lambda r: (r["world"], r["op"], r["bytes"]))
    if not ab:
        return [], None
    head = f"{'world':>5} {'op':<15} {'bytes':>10} {'bare':>10} {'harness':>10} {'captured':>10} {'h/b':>6} {'c/b':>6}"
    lines = [head]
    for r in ab:
        bare, har, cap = r["bare_p50_s"], r["harness_p50_s"], r["captured_p50_s"]
        lines.append(
            f"{r['world']:>5} {r['op']:<15} {r['bytes']:>10} {bare * 1e3:>8.3f}ms {har * 1e3:>8.3f}ms "
            f"{cap * 1e3:>8.3f}ms {har / bare:>6.3f} {cap / bare:>6.3f}"
        )
    return lines, max(r["harness_p50_s"] / r["bare_p50_s"] for r in ab)


def samples(rows: Iterable[Mapping[str, Any]]) -> list[Sample]:
    """The bare path's points (what the framework's calls cost without commgate)."""
    return [
        Sample(
            op=r["op"],
            world=r["world"],
            group_size=r["group_size"],
            nbytes=r["bytes"],
            median_s=r["p50_s"],
            p99_s=r["p99_s"],
        )
        for r in rows
        if r.get("path") == "bare"
    ]
