"""A workload that goes through every path the capture must see, for the capture's own tests:
torch.distributed calls from Python (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast,
send/recv, batched isend/irecv) and DTensor's functional collectives (distribute, redistribute)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from commgate.model.scenario import Scenario


class _Paths:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, dist.get_world_size(), device
        self.mesh = init_device_mesh(device.type, (self.world,))

    def step(self, k: int) -> float:
        w, dev = self.world, self.device
        dist.all_reduce(torch.ones(16, device=dev))
        dist.all_gather_into_tensor(torch.empty(8 * w, device=dev), torch.ones(8, device=dev))
        dist.reduce_scatter_tensor(torch.empty(4, device=dev), torch.ones(4 * w, device=dev))
        dist.all_to_all_single(torch.empty(2 * w, device=dev), torch.ones(2 * w, device=dev))
        dist.broadcast(torch.ones(3, device=dev), src=0)
        peer = (self.rank + 1) % w, (self.rank - 1) % w
        ops = [
            dist.P2POp(dist.isend, torch.ones(5, device=dev), peer[0]),
            dist.P2POp(dist.irecv, torch.empty(5, device=dev), peer[1]),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if self.rank == 0:
            dist.send(torch.ones(7, device=dev), 1)
        elif self.rank == 1:
            dist.recv(torch.empty(7, device=dev), 0)
        t = distribute_tensor(torch.ones(4 * w, 4, device=dev), self.mesh, [Shard(0)])
        return float(t.redistribute(self.mesh, [Replicate()]).to_local().sum())


def paths(scenario: Scenario, *, rank: int, device: torch.device) -> _Paths:
    return _Paths(scenario, rank=rank, device=device)


SWEEP_SIZES = (4, 64, 1 << 10, 16 << 10, 256 << 10, 4 << 20)
"""Message sizes of ``sweep`` (bytes; the microbenchmarks' x16 steps, up to 4 MiB)."""


class _Sweep:
    """The microbenchmarks' ops and sizes over the whole world, as a workload: on a run whose ranks
    cannot host the microbenchmarks' followers (ranks in network namespaces, ``commgate.run.links``), the
    captured durations give the bandwidth curve (``commgate.report.bandwidth.samples``). Each step:
    every op at every size, a few calls each; send_recv is a pair of batched isend/irecv with the other
    rank (two ranks) or around the ring."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, dist.get_world_size(), device

    def step(self, k: int) -> float:
        w, dev = self.world, self.device
        for nbytes in SWEEP_SIZES:
            n = max(w, nbytes // 4 // w * w)  # fp32 elements, a multiple of the world size
            calls = 8 if nbytes <= 64 << 10 else 3
            for _ in range(calls):
                dist.all_reduce(torch.ones(n, device=dev))
                dist.all_gather_into_tensor(torch.empty(n, device=dev), torch.ones(n // w, device=dev))
                dist.reduce_scatter_tensor(torch.empty(n // w, device=dev), torch.ones(n, device=dev))
                dist.all_to_all_single(torch.empty(n, device=dev), torch.ones(n, device=dev))
                dist.broadcast(torch.ones(n, device=dev), src=0)
                ops = [
                    dist.P2POp(dist.isend, torch.ones(n, device=dev), (self.rank + 1) % w),
                    dist.P2POp(dist.irecv, torch.empty(n, device=dev), (self.rank - 1) % w),
                ]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return 0.0


def sweep(scenario: Scenario, *, rank: int, device: torch.device) -> _Sweep:
    return _Sweep(scenario, rank=rank, device=device)
