"""A DDP script as PyTorch's tutorial writes it (nothing of commgate in it): ``torch.multiprocessing.spawn``
starts the workers, each given its rank as an argument and naming it to ``init_process_group`` (no ``RANK``
in its environment); a small model, 2 steps, one all_reduce of 8 floats each besides DDP's. ``spawn_train.py
PORT [READY]``: with a directory READY, each worker then touches ``READY/ready<rank>`` and waits to be ended,
taking 2 s to end (a job's own shutdown) once it is told to."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def worker(rank: int, world: int, port: str, ready: str | None) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(8))
        opt.step()
        opt.zero_grad()
    if ready:

        def shutdown(signum: int, frame: object) -> None:
            time.sleep(2)
            sys.exit(0)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, shutdown)
        (Path(ready) / f"ready{rank}").touch()
        time.sleep(300)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None), nprocs=2)
