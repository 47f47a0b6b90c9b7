"""Each collective a job can call, once asynchronously and once synchronously, on the backend named by
``--backend`` (nccl: the GPU of its local rank), launched by torchrun; nothing of commgate in it. With
``--cpu-tensors`` (a ``cpu:gloo,cuda:nccl`` group's), each again on CPU tensors. ``tests/test_capture_job.py``
and ``tests/test_capture_nccl.py`` capture it and check that each call is recorded once, ended, with its
bytes."""

import argparse
import os

import torch
import torch.distributed as dist

N = 64
"""Elements of every tensor (float32: 256 bytes)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo", help="'' for none: torch's default for each device")
    p.add_argument("--cpu-tensors", action="store_true", help="each op again on CPU tensors")
    a = p.parse_args()
    devices = [torch.device("cpu")]
    if "nccl" in a.backend or (not a.backend and torch.cuda.is_available()):  # none named: torch's defaults
        devices = [torch.device("cuda", int(os.environ["LOCAL_RANK"])), *devices[: a.cpu_tensors]]
        torch.cuda.set_device(devices[0])
    dist.init_process_group(a.backend or None)
    for device in devices:
        every_op(device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: 10 ops, each async and sync, on {', '.join(map(str, devices))}", flush=True)
    dist.destroy_process_group()


def every_op(device: torch.device) -> None:
    world, root = dist.get_world_size(), dist.get_rank() == 0
    t, out = torch.ones(N, device=device), torch.empty(N * world, device=device)
    shard = torch.empty(N // world, device=device)
    pieces = list(torch.empty(N * world, device=device).chunk(world))  # gather's output, scatter's input (root)
    ops = {
        "all_reduce": lambda s: dist.all_reduce(t, async_op=s),
        "broadcast": lambda s: dist.broadcast(t, 0, async_op=s),
        "reduce": lambda s: dist.reduce(t, 0, async_op=s),
        "all_gather": lambda s: dist.all_gather(list(out.chunk(world)), t, async_op=s),
        "all_gather_into_tensor": lambda s: dist.all_gather_into_tensor(out, t, async_op=s),
        "reduce_scatter_tensor": lambda s: dist.reduce_scatter_tensor(shard, t, async_op=s),
        "all_to_all_single": lambda s: dist.all_to_all_single(torch.empty_like(t), t, async_op=s),
        "gather": lambda s: dist.gather(t, pieces if root else None, dst=0, async_op=s),
        "scatter": lambda s: dist.scatter(t, pieces if root else None, src=0, async_op=s),
        "barrier": lambda s: dist.barrier(async_op=s),
    }
    for op in ops.values():
        for asynchronous in (True, False):
            work = op(asynchronous)
            if work is not None:
                work.wait()


if __name__ == "__main__":
    main()
