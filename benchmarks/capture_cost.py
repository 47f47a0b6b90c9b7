"""The capture's cost per call: host time it adds on the calling thread, by op and message size.

    .venv/bin/python benchmarks/capture_cost.py [--calls 3000] [--backend gloo] [--no-p2p] [--gap-us 200]

One process (world size 1; the cost is the calling thread's, not the wire's), the same op on a bare
process group and on commgate's capturing group, alternated call for call. The capture stamps gloo's
collectives in C++ (``commgate.run.stamps``, what a run uses); ``COMMGATE_STAMPS=0`` measures its other form,
every completion left to the recorder's poller thread (as NCCL's calls are): one form per process, so that
one's poller thread does not disturb the other's figures. A call's host time is its issue (``async_op=True``
returning a work) plus its ``wait()``, ``--gap-us`` after the issue for every op alike, or later, once the
work has completed (the test spins on the backend's own ``is_completed``), so the op's own duration and the
wake-up of a sleeping thread, which dominate and scatter a blocking call's wall time on a loaded machine, are
out of it. The gap matters: the capture's issue path costs more when calls come far apart (``--gap-us 5000``,
as between a training step's calls) than back to back. Prints the medians, their difference and ratio (goal:
<= x1.1), and the wall time of the blocking form, bare and captured, for comparison. Then, on gloo, send and
recv: two processes (rank 0 sends, rank 1 receives), each call waited on at once, bare and captured
alternated; their host time holds the transfer (gloo completes them only in their wait), so the ratio is
against the whole call.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from commgate.run import interpose, stamps

SIZES = (4, 64 << 10, 4 << 20)


def _ops(t: torch.Tensor) -> dict[str, Callable[[Any, bool], Any]]:
    out = torch.empty_like(t)
    return {
        "all_reduce": lambda g, a: dist.all_reduce(t, group=g, async_op=a),
        "broadcast": lambda g, a: dist.broadcast(t, 0, group=g, async_op=a),
        "all_gather_into_tensor": lambda g, a: dist.all_gather_into_tensor(out, t, group=g, async_op=a),
        "reduce_scatter_tensor": lambda g, a: dist.reduce_scatter_tensor(out, t, group=g, async_op=a),
        "all_to_all_single": lambda g, a: dist.all_to_all_single(out, t, group=g, async_op=a),
    }


SLOW_NS = 5_000_000
"""The most a call's wait is put off for a work that has not said it completed at the gap."""


def host_ns(op: Callable[[Any, bool], Any], group: Any, gap_ns: int, silent: set[str], name: str) -> int:
    """The calling thread's time in one call: its issue, and its ``wait()`` ``gap_ns`` after it (the same gap for
    every op, bare or captured: the time between two calls decides how much of the capture's issue path is still
    in the caches), or once the work says it completed if that is later (at most ``SLOW_NS``). A work that does
    not say it completed even once waited on (gloo's reduce-scatter: its op runs in the issue) is put in
    ``silent`` by its op's ``name`` on its first call, and waited on at the gap from then on."""
    t0 = time.perf_counter_ns()
    work = op(group, True)
    t1 = time.perf_counter_ns()
    inner = getattr(work, "_inner", work)
    until, limit = t1 + gap_ns, t1 + max(gap_ns, SLOW_NS)
    while time.perf_counter_ns() < until:
        pass
    if name not in silent:
        while not inner.is_completed() and time.perf_counter_ns() < limit:
            pass
    t2 = time.perf_counter_ns()
    work.wait()
    t3 = time.perf_counter_ns()
    if not inner.is_completed():
        silent.add(name)
    return t1 - t0 + t3 - t2


def wall_ns(op: Callable[[Any, bool], Any], group: Any) -> int:
    t0 = time.perf_counter_ns()
    op(group, False)
    return time.perf_counter_ns() - t0


def _p2p_rank(rank: int, store: str, sizes: list[int], calls: int, out: Any) -> None:
    """One rank of the send/recv pair: rank 0 sends, rank 1 receives, each call waited on at once (gloo's
    point-to-point works complete only in their wait, so the host time holds the transfer, bare or
    captured); bare and captured alternated call for call. Puts (rank, [(bytes, bare us, captured us)])."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rec = interpose.install("gloo", rank)
    dist.init_process_group(interpose.BACKEND_NAME, init_method=f"file://{store}", rank=rank, world_size=2)
    bare = dist.new_group([0, 1], backend="gloo")
    rows = []
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // 4, 1))
        host: dict[str, list[int]] = {"bare": [], "capture": []}
        for k in range(calls if nbytes <= 64 << 10 else calls // 10):
            pair = (("bare", bare), ("capture", dist.group.WORLD))
            for path, g in pair if k % 2 else pair[::-1]:
                t0 = time.perf_counter_ns()
                work = dist.isend(t, 1, group=g) if rank == 0 else dist.irecv(t, 0, group=g)
                work.wait()  # type: ignore[union-attr]
                host[path].append(time.perf_counter_ns() - t0)
            rec.take()
        rows.append((nbytes, statistics.median(host["bare"]) / 1e3, statistics.median(host["capture"]) / 1e3))
    out.put((rank, rows))
    dist.destroy_process_group()
    interpose.release_backends()


def p2p(sizes: list[int], calls: int) -> None:
    """Send and recv on gloo, two processes (world size 2): printed as the collectives are."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:  # the store's file: gloo's FileStore removes it at the end
        procs = [ctx.Process(target=_p2p_rank, args=(r, f"{d}/store", sizes, calls, out)) for r in (0, 1)]
        for proc in procs:
            proc.start()
        try:
            got = dict(out.get(timeout=600) for _ in procs)  # a rank that failed said why on stderr
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    for rank, name in ((0, "send"), (1, "recv")):
        for nbytes, b, c in got[rank]:
            print(f"{name:<24} {nbytes:>8} {b:7.1f} {c:8.1f} {c - b:6.1f} {c / b:7.2f}  (two ranks, waited at once)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes, comma-separated")
    ap.add_argument("--no-p2p", action="store_true", help="leave out send and recv (two processes, gloo only)")
    ap.add_argument(
        "--gap-us", type=int, default=200, help="from each call's issue to its wait, every op alike (5000: calls apart)"
    )
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    device = torch.device("cuda" if a.backend == "nccl" else "cpu")
    if a.backend == "gloo":
        stamps.build()  # None (said) with COMMGATE_STAMPS=0 or where it cannot be built
    rec = interpose.install(a.backend, 0)
    form = "stamped in C++" if rec._stamps is not None and a.backend == "gloo" else "poller"
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group(interpose.BACKEND_NAME, init_method=f"file://{f.name}", rank=0, world_size=1)
        bare = dist.new_group([0], backend=a.backend)
        captured = dist.group.WORLD
        print(f"capture: {form} (COMMGATE_STAMPS=0 for the poller's form); wait {a.gap_us} us after the issue")
        silent: set[str] = set()
        print(
            f"{'op':<24} {'bytes':>8} {'bare':>7} {'capture':>8} {'cost':>6} {'x bare':>7}"
            f"  {'wall bare':>9} {'wall cap':>8}  (medians, us)"
        )
        for nbytes in (int(x) for x in a.sizes.split(",")):
            t = torch.zeros(nbytes // 4, device=device)
            for name, op in _ops(t).items():
                calls = a.calls if nbytes <= 64 << 10 else a.calls // 10
                host: dict[str, list[int]] = {"bare": [], "capture": []}
                wall: dict[str, list[int]] = {"bare": [], "capture": []}
                for k in range(calls):
                    pair = (("bare", bare), ("capture", captured))
                    for path, g in pair if k % 2 else pair[::-1]:
                        host[path].append(host_ns(op, g, a.gap_us * 1000, silent, name))
                        wall[path].append(wall_ns(op, g))
                    rec.take()
                h = {p: statistics.median(v) / 1e3 for p, v in host.items()}
                w = {p: statistics.median(v) / 1e3 for p, v in wall.items()}
                print(
                    f"{name:<24} {nbytes:>8} {h['bare']:7.1f} {h['capture']:8.1f} {h['capture'] - h['bare']:6.1f}"
                    f" {h['capture'] / h['bare']:7.2f}  {w['bare']:9.1f} {w['capture']:8.1f}",
                    flush=True,
                )
        dist.destroy_process_group()
    interpose.release_backends()
    if a.backend == "gloo" and not a.no_p2p:
        p2p([int(x) for x in a.sizes.split(",")], a.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
