"""Collective microbenchmarks (OMB / nccl-tests style) under pytest-benchmark.

Every op at message sizes 4 B ... 64 MiB, group sizes 2, 4, 8 inside worlds of 2, 4 and 8 ranks (all
groups of a size at once), over the plain gloo backend (``bare``) and through commgate's capture
(``harness``), interleaved. pytest-benchmark stores each point's statistics (``--benchmark-save``) and
``extra_info`` carries p50/p99, algbw and busbw (GB/s, nccl-tests' factors), so
``--benchmark-compare --benchmark-compare-fail=median:25%`` gates a later run against a saved one.

    .venv/bin/python -m pytest benchmarks/test_collectives.py --benchmark-save=gloo --commgate-curve-dir baselines
    .venv/bin/python -m pytest benchmarks/test_collectives.py --benchmark-compare --benchmark-compare-fail=median:25%

A quick sweep: ``--commgate-bench-worlds 2 --commgate-bench-max-bytes 65536``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
microbench = pytest.importorskip("commgate.report.microbench")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sizes(max_bytes: int) -> list[int]:
    out, n = [], 4
    while n <= max_bytes:
        out.append(n)
        n *= 16
    return out


def group_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0 and (g & (g - 1)) == 0]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cfg = metafunc.config
    worlds = _ints(cfg.getoption("--commgate-bench-worlds"))
    if "point" in metafunc.fixturenames:
        ops = [o for o in cfg.getoption("--commgate-bench-ops").split(",") if o]
        params = [
            pytest.param((w, g, op, n), id=f"w{w}-g{g}-{op}-{n}B")
            for w in worlds
            for g in group_sizes(w)
            for op in ops
            for n in sizes(cfg.getoption("--commgate-bench-max-bytes"))
        ]
        metafunc.parametrize("point", params)
    if "ab_point" in metafunc.fixturenames:
        ops = [o for o in cfg.getoption("--commgate-bench-ops").split(",") if o]
        small = [n for n in (4, 64 << 10, 4 << 20) if n <= cfg.getoption("--commgate-bench-max-bytes")]
        params = [pytest.param((w, op, n), id=f"w{w}-{op}-{n}B") for w in worlds for op in ops for n in small]
        metafunc.parametrize("ab_point", params)
    if "compute_world" in metafunc.fixturenames:
        metafunc.parametrize("compute_world", worlds, ids=[f"w{w}" for w in worlds])


_WORLD: dict[str, Any] = {}


def world_of(size: int, request: pytest.FixtureRequest) -> Any:
    """The running job of ``size`` ranks (one at a time: the previous one is closed first)."""
    current = _WORLD.get("world")
    if current is not None and current.world == size:
        return current
    if current is not None:
        current.close()
        _WORLD.clear()
    w = microbench.World(size, group_sizes(size), backend=request.config.getoption("--commgate-bench-backend"))
    _WORLD["world"] = w
    return w


@pytest.fixture(scope="session", autouse=True)
def _close_world() -> Iterator[None]:
    yield
    if "world" in _WORLD:
        _WORLD.pop("world").close()


def rounds_for(nbytes: int) -> tuple[int, int]:
    """(warm-up, measured) calls: many for small messages, a few for large ones."""
    if nbytes <= 64 << 10:
        return 10, 200
    if nbytes <= 1 << 20:
        return 3, 40
    if nbytes <= 16 << 20:
        return 2, 10
    return 1, 5


def _run(benchmark: Any, fn_for: Any, warmup: int, rounds: int) -> list[float]:
    if benchmark.disabled:  # --benchmark-disable calls the target once
        warmup, rounds = 0, 1
    fn = fn_for(warmup + rounds)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=1)
    return list(benchmark.stats.stats.data) if not benchmark.disabled else []


def quantile(data: list[float], q: float) -> float:
    data = sorted(data)
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


def test_collective(
    benchmark: Any, point: tuple[int, int, str, int], request: pytest.FixtureRequest, results: list[Any]
) -> None:
    """One point of the sweep on the bare backend: what the fitted curve and a saved run hold."""
    world, g, op, nbytes = point
    w = world_of(world, request)
    warmup, rounds = rounds_for(nbytes)
    data = _run(benchmark, lambda calls: w.prepare(op, nbytes, g, "bare", calls), warmup, rounds)
    if not data:
        return
    actual = microbench.elements_for(op, nbytes, g) * 4
    p50, p99 = quantile(data, 0.5), quantile(data, 0.99)
    alg, bus = microbench.bandwidths(op, actual, g, p50)
    info = {"op": op, "world": world, "group_size": g, "bytes": actual, "path": "bare", "backend": w.backend}
    info |= {"p50_s": p50, "p99_s": p99, "algbw_GBps": alg, "busbw_GBps": bus}
    benchmark.extra_info.update(info)
    results.append(info)
    assert p50 > 0 and bus > 0


def test_harness_overhead(
    benchmark: Any, ab_point: tuple[int, str, int], request: pytest.FixtureRequest, results: list[Any]
) -> None:
    """The same op through commgate's capture and on the bare backend, call for call alternated: the
    harness's cost (wall time of the call) and the capture's own latency against the bare loop."""
    world, op, nbytes = ab_point
    w = world_of(world, request)
    warmup, rounds = rounds_for(nbytes)
    if benchmark.disabled:
        warmup, rounds = 0, 1
    pair, times = w.prepare_pair(op, nbytes, world, warmup + rounds)
    benchmark.pedantic(pair, rounds=rounds, warmup_rounds=warmup, iterations=1)
    captured = w.captured_durations()
    assert len(captured) == warmup + rounds, "the capture must record every call it timed"
    bare, har, cap = (quantile(x[warmup:], 0.5) for x in (times["bare"], times["harness"], captured))
    info = {"op": op, "world": world, "group_size": world, "bytes": microbench.elements_for(op, nbytes, world) * 4}
    info |= {"bare_p50_s": bare, "harness_p50_s": har, "captured_p50_s": cap, "ratio": har / bare}
    benchmark.extra_info.update(info)
    results.append(info | {"path": "ab"})
    assert bare > 0 and har > 0


def test_compute(benchmark: Any, compute_world: int, request: pytest.FixtureRequest, results: list[Any]) -> None:
    """fp32 GEMM rate of one rank while every rank of the world computes (the time model's T_comp)."""
    w = world_of(compute_world, request)
    gemm, done = w.compute()
    try:
        benchmark.pedantic(gemm, rounds=1 if benchmark.disabled else 20, warmup_rounds=0 if benchmark.disabled else 2)
    finally:
        done()
    if benchmark.disabled:
        return
    data = list(benchmark.stats.stats.data)
    # Throughput (all GEMMs over all the time), not a median: a call that ran while the scheduler gave
    # this rank a core to itself is as real as one that waited, and only the mean weighs them right.
    flops = microbench.gemm_flops(sum(data) / len(data))
    info = {"op": "gemm", "world": compute_world, "n": microbench.GEMM_N, "flops": flops}
    benchmark.extra_info.update(info)
    results.append(info)
    assert flops > 0
