"""OMB/nccl-tests style collective microbenchmarks, run by pytest-benchmark (``benchmarks/test_collectives.py``).

The pytest process is rank 0 of a ``world``-rank job and times its own calls with pytest-benchmark; the
other ranks are follower processes that issue the same calls, told what to run through the job's
TCPStore. Every group of the benchmarked size runs at once (``new_subgroups``), as the TP or DP groups
of a training job do. Each op runs twice per point: over the plain backend (``bare``) and through
commgate's capturing backend (``harness``), so the harness's cost is measured in the same run.

Followers die with the pytest process (PDEATHSIG) and are killed on close; every collective has the
group timeout, so nothing hangs a CI job.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from commgate.report.bandwidth import algbw, busbw
from commgate.run import interpose
from commgate.run.launcher import loopback_env, loopback_store

PATHS = ("bare", "harness")
GEMM_N = 256
"""Matrix size of the compute-rate benchmark (fp32, one thread per rank as the CPU scenarios run)."""
GEMM_REPEAT = 64
"""GEMMs per timed call."""


def _on_gpu() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def elements_for(op: str, nbytes: int, group_size: int) -> int:
    """fp32 elements of the largest buffer for a ``nbytes`` message: a multiple of the group size where
    the op splits it (nccl-tests rounds the same way), at least one element per rank."""
    n = max(1, nbytes // 4)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        n = max(group_size, n - n % group_size)
    return n


def operation(op: str, nbytes: int, group: Any, group_ranks: Sequence[int]) -> Callable[[], None]:
    """One blocking call of ``op`` on ``group`` (the same on every rank of the group); on a GPU it returns
    when the device has finished it."""
    call = _operation(op, nbytes, group, group_ranks)
    if not _on_gpu():
        return call

    def synchronized() -> None:
        call()
        torch.cuda.synchronize()

    return synchronized


def _operation(op: str, nbytes: int, group: Any, group_ranks: Sequence[int]) -> Callable[[], None]:
    g = len(group_ranks)
    dev = torch.device("cuda", torch.cuda.current_device()) if _on_gpu() else torch.device("cpu")
    ones = functools.partial(torch.ones, device=dev)
    empty = functools.partial(torch.empty, device=dev)
    n = elements_for(op, nbytes, g)
    me = group_ranks.index(dist.get_rank())
    if op == "all_reduce":
        t = ones(n)
        return lambda: dist.all_reduce(t, group=group)
    # torch 2.13's names; before it, all_gather_into_tensor and reduce_scatter_tensor (deprecated in 2.13)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        small, big = ones(n // g), empty(n)
        return lambda: gather(big, small, group=group)
    if op == "reduce_scatter":
        small, big = empty(n // g), ones(n)
        return lambda: scatter(small, big, group=group)
    if op == "all_to_all":
        src, dst = ones(n), empty(n)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    if op == "broadcast":
        t = ones(n)
        return lambda: dist.broadcast(t, src=group_ranks[0], group=group)
    if op == "send_recv":  # a ring inside the group: send to the next rank, receive from the previous
        out, inp = ones(n), empty(n)
        nxt, prv = group_ranks[(me + 1) % g], group_ranks[(me - 1) % g]

        def send_recv() -> None:
            for w in (dist.isend(out, nxt, group=group), dist.irecv(inp, prv, group=group)):
                if w is not None:  # None only for a rank outside the group, which this never is
                    w.wait()

        return send_recv
    if op == "gemm":  # long enough (~30 ms alone) that time-sharing with the other ranks shows in each call
        a, b = torch.randn(GEMM_N, GEMM_N, device=dev), torch.randn(GEMM_N, GEMM_N, device=dev)

        def gemms() -> None:
            for _ in range(GEMM_REPEAT):
                torch.mm(a, b)

        return gemms
    raise ValueError(f"unknown microbenchmark op {op!r}")


def gemm_flops(seconds: float) -> float:
    return GEMM_REPEAT * 2 * GEMM_N**3 / seconds


class Groups:
    """Every rank's subgroups of each benchmarked size, over both paths (created in the same order on
    every rank, as ``new_subgroups`` requires)."""

    def __init__(self, world: int, sizes: Sequence[int], backend: str) -> None:
        self.by: dict[tuple[int, str], tuple[Any, tuple[int, ...]]] = {}
        for g in sizes:
            for path in PATHS:
                name = backend if path == "bare" else interpose.BACKEND_NAME
                mine, _ = dist.new_subgroups(group_size=g, backend=name)  # type: ignore[no-untyped-call]
                self.by[g, path] = (mine, tuple(dist.get_process_group_ranks(mine)))

    def op(self, command: dict[str, Any]) -> Callable[[], None]:
        """The call a command names; path ``pair`` is one bare and one harness call, the bare one first on
        even calls and second on odd ones (so that neither always pays for the other's stragglers)."""
        if command["path"] == "pair":
            bare, har = (self.op(command | {"path": p}) for p in PATHS)
            calls = itertools.count()

            def pair() -> None:
                first, second = (bare, har) if next(calls) % 2 == 0 else (har, bare)
                first()
                second()

            return pair
        grp, ranks = self.by[command["group_size"], command["path"]]
        return operation(command["op"], command["bytes"], grp, ranks)


def _join(rank: int, world: int, store: Any, sizes: Sequence[int], timeout_s: float, backend: str) -> Groups:
    """Join the job: gloo on the CPU (one thread per rank, as the CPU scenarios run) or NCCL/RCCL with one
    GPU per rank (``cuda:rank``; the benchmark runs within one node)."""
    if backend == "gloo":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
        torch.cuda.init()  # type: ignore[no-untyped-call]
    interpose.install(backend, rank)
    timeout = timedelta(seconds=timeout_s)
    saved = {k: os.environ.get(k) for k in loopback_env()}
    os.environ.update(loopback_env())  # the sockets of every group made here listen on loopback only
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return Groups(world, sizes, backend)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class World:
    """Rank 0 (this process) and ``world - 1`` follower processes, joined with subgroups of ``sizes``."""

    def __init__(self, world: int, sizes: Sequence[int], *, backend: str = "gloo", timeout_s: float = 120) -> None:
        self.world, self.sizes, self.backend, self._k = world, tuple(sizes), backend, 0
        self.store = loopback_store(world, timeout_s)
        argv = [sys.executable, "-m", "commgate.report.microbench", "--world", str(world)]
        argv += ["--port", str(self.store.port)]
        argv += ["--sizes", ",".join(map(str, sizes)), "--timeout", str(timeout_s), "--backend", backend]
        env = os.environ | loopback_env()
        self.followers = [subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(1, world)]
        try:
            self.groups = _join(0, world, self.store, sizes, timeout_s, backend)
        except BaseException:
            self._kill()
            raise

    def prepare(self, op: str, nbytes: int, group_size: int, path: str, calls: int) -> Callable[[], None]:
        """Tell the followers to make ``calls`` calls of this op; return rank 0's own call."""
        command = {"op": op, "bytes": nbytes, "group_size": group_size, "path": path, "calls": calls}
        for p in self.followers:
            if p.poll() is not None:
                raise RuntimeError(f"microbenchmark follower pid {p.pid} exited with {p.returncode}")
        self.store.set(f"cmd/{self._k}", json.dumps(command))
        self._k += 1
        return self.groups.op(command)

    def prepare_pair(
        self, op: str, nbytes: int, group_size: int, calls: int
    ) -> tuple[Callable[[], None], dict[str, list[float]]]:
        """Rank 0's bare call and harness call, alternated call for call and in alternating order (as the
        followers do), each timed into the returned lists: the A/B of the harness's cost, interleaved so
        that the machine's drift hits both alike."""
        self.prepare(op, nbytes, group_size, "pair", calls)
        fns = {p: self.groups.op({"op": op, "bytes": nbytes, "group_size": group_size, "path": p}) for p in PATHS}
        times: dict[str, list[float]] = {"bare": [], "harness": []}
        clock = time.perf_counter
        order = itertools.count()

        def pair() -> None:
            for path in PATHS if next(order) % 2 == 0 else PATHS[::-1]:
                t0 = clock()
                fns[path]()
                times[path].append(clock() - t0)

        return pair, times

    def compute(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """Rank 0's GEMM while every follower runs GEMMs until the returned ``done`` is called."""
        key = f"gemm-done/{self._k}"
        command = {"op": "gemm", "bytes": 4, "group_size": self.world, "path": "bare", "until": key}
        self.store.set(f"cmd/{self._k}", json.dumps(command))
        self._k += 1
        return self.groups.op(command), lambda: self.store.set(key, "1")

    def captured_durations(self) -> list[float]:
        """Seconds per call that the capture recorded since the last look (the harness's own timing)."""
        rec = interpose.RECORDER
        if rec is None:
            return []
        calls = rec.take()
        return [c.duration_ns / 1e9 for c in calls if c.duration_ns is not None and c.op != "send"]

    def close(self) -> None:
        self.store.set(f"cmd/{self._k}", json.dumps({"op": "exit"}))
        deadline = time.monotonic() + 30
        for p in self.followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()
        dist.destroy_process_group()
        interpose.release_backends()

    def _kill(self) -> None:
        for p in self.followers:
            if p.poll() is None:
                p.kill()
                p.wait()


def bandwidths(op: str, nbytes: int, group_size: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, as nccl-tests prints them."""
    return algbw(nbytes, seconds) / 1e9, busbw(op, group_size, nbytes, seconds) / 1e9


def follow(rank: int, world: int, port: int, sizes: Sequence[int], timeout_s: float, backend: str) -> None:
    from commgate.run.rank import _die_with_parent

    _die_with_parent()
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    groups = _join(rank, world, store, sizes, timeout_s, backend)
    k = 0
    while True:
        command = json.loads(store.get(f"cmd/{k}"))
        k += 1
        if command["op"] == "exit":
            break
        fn = groups.op(command)
        if "until" in command:  # keep computing while rank 0 measures (every rank busy, as in training)
            while not store.check([command["until"]]):
                for _ in range(4):
                    fn()
            continue
        for _ in range(command["calls"]):
            fn()
        if interpose.RECORDER is not None:
            interpose.RECORDER.take()
    dist.destroy_process_group()
    interpose.release_backends()


def main(argv: Sequence[str] | None = None) -> None:
    a = argparse.ArgumentParser(description="a follower rank of the microbenchmarks (started by World)")
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--sizes", required=True)
    a.add_argument("--timeout", type=float, default=120)
    a.add_argument("--backend", default="gloo")
    ns = a.parse_args(argv)
    follow(ns.rank, ns.world, ns.port, [int(x) for x in ns.sizes.split(",")], ns.timeout, ns.backend)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
