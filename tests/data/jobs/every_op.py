"""Each collective a job can call, once asynchronously and once synchronously, on the backend named by
``--backend`` (nccl: the GPU of its local rank), launched by torchrun; nothing of commgate in it.
``tests/test_capture_nccl.py`` captures it and checks that each call is recorded once, ended, with its bytes."""

import argparse
import os

import torch
import torch.distributed as dist

N = 64
"""Elements of every tensor (float32: 256 bytes)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    a = p.parse_args()
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    world = dist.get_world_size()
    t, out = torch.ones(N, device=device), torch.empty(N * world, device=device)
    shard = torch.empty(N // world, device=device)
    ops = {
        "all_reduce": lambda s: dist.all_reduce(t, async_op=s),
        "broadcast": lambda s: dist.broadcast(t, 0, async_op=s),
        "reduce": lambda s: dist.reduce(t, 0, async_op=s),
        "all_gather": lambda s: dist.all_gather(list(out.chunk(world)), t, async_op=s),
        "all_gather_into_tensor": lambda s: dist.all_gather_into_tensor(out, t, async_op=s),
        "reduce_scatter_tensor": lambda s: dist.reduce_scatter_tensor(shard, t, async_op=s),
        "all_to_all_single": lambda s: dist.all_to_all_single(torch.empty_like(t), t, async_op=s),
        "barrier": lambda s: dist.barrier(async_op=s),
    }
    for op in ops.values():
        for asynchronous in (True, False):
            work = op(asynchronous)
            if work is not None:
                work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: {len(ops)} ops, each async and sync", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
