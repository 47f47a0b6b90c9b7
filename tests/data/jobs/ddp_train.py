"""A plain torch DDP training script, as a user writes it (nothing of commgate in it): a small MLP, SGD,
``--steps`` steps on gloo (or the backend named by ``--backend``; with ``nccl``, on the GPU of its local rank),
launched by torchrun.

* ``--bucket-cap-mb`` and ``--extra-all-reduce``: the planted changes the gate must catch;
* ``--fail-at K``: rank 1 raises at step K (a failing job must still leave a readable capture);
* ``--mark-steps``: each step marked with ``commgate.capture.step()``, as a job whose steps the optimizer
  does not mark would;
* ``--dump-fr``: the Flight Recorder (``TORCH_FR_BUFFER_SIZE``) dumped at the end, as a job asked for its
  dump does, to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (pickle) and ``<rank>.json`` (on NCCL, NCCL's recorder);
* ``--reduce-scatter``: a reduce_scatter_tensor of the gradients' first layer after each step, as a sharded
  optimizer would (gloo runs, and its Flight Recorder records, it as an all_reduce);
* ``--gather-scatter``: a gather of 16 floats a rank to rank 0 and a scatter of as many from it, each step;
* ``--hang-at-end``: rank 0 issues one more all_reduce than rank 1, and the job hangs in it: rank 0 dumps
  its Flight Recorder from a thread once the stuck call is recorded (as the watchdog dumps a stuck NCCL job;
  gloo has none), rank 1 dumps and waits for rank 0's dump, then the job is ended (exit status 3);
* ``--own-sigterm DIR``: after the steps each rank installs a SIGTERM handler of its own that takes 3 s, then
  touches ``DIR/graceful<rank>`` and exits 0; it touches ``DIR/ready<rank>`` and waits for the signal;
* ``--deadlock DIR``: after the steps each rank touches ``DIR/ready<rank>`` and blocks inside gloo for good
  (rank 0 all-reduces on a group of both ranks, rank 1 on the default group);
* ``--linger DIR``: after the steps each rank touches ``DIR/ready<rank>`` and waits for a signal (a job
  interrupted mid-run); ``--os-exit``: each rank ends by ``os._exit(0)``; ``--no-init``: the script ends
  before ``init_process_group`` (a job that never sets up a group);
* ``--spawn-child FILE``: rank 1 starts a Python process that outlives it and writes its pid to FILE as it ends;
  ``--chdir DIR``: the ranks change their working directory after ``init_process_group``;
  ``--monitored-barrier``: gloo's ``monitored_barrier`` after ``init_process_group``, and the backend's name said;
  ``--part``: after the steps rank 0 issues an all_reduce rank 1 never does (rank 1 ends; rank 0's call fails);
  ``--reinit``: after the steps the job destroys its group, sets up another (on a store of its own: torch's
  rendezvous keys of the first group would be read again) and all-reduces 3 floats in it;
  ``--exit-after N``: rank 0 exits with status N once everything else is done (a crash after the last call).
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class MLP(torch.nn.Module):
    """Two linear layers; the forward returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--extra-all-reduce", action="store_true")
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--dump-fr", action="store_true", help="dump the Flight Recorder at the end, as on request")
    p.add_argument("--mark-steps", action="store_true", help="mark each step with commgate.capture.step()")
    p.add_argument("--reduce-scatter", action="store_true", help="a reduce_scatter_tensor after each step")
    p.add_argument("--gather-scatter", action="store_true", help="a gather to rank 0, a scatter from it, each step")
    p.add_argument("--hang-at-end", action="store_true", help="rank 0 issues an all_reduce rank 1 never does")
    p.add_argument("--own-sigterm", type=Path, help="after the steps, a SIGTERM handler of its own (3 s), then wait")
    p.add_argument("--deadlock", type=Path, help="after the steps, touch DIR/ready<rank> and block in gloo for good")
    p.add_argument(
        "--linger", type=Path, help="after the steps, touch DIR/ready<rank> and wait (<= 300 s) for a signal"
    )
    p.add_argument("--os-exit", action="store_true", help="end each rank with os._exit(0) after the steps")
    p.add_argument("--no-init", action="store_true", help="end before init_process_group")
    p.add_argument("--no-optimizer", action="store_true", help="forward and backward only: no optimizer step")
    p.add_argument("--spawn-child", type=Path, help="rank 1 starts a Python process that outlives it, writing its pid")
    p.add_argument("--chdir", type=Path, help="change the working directory to DIR after init_process_group")
    p.add_argument("--monitored-barrier", action="store_true", help="gloo's monitored_barrier after init; say backend")
    p.add_argument("--part", action="store_true", help="after the steps rank 0 all-reduces alone; rank 1 just ends")
    p.add_argument("--reinit", action="store_true", help="destroy the group after the steps; all-reduce in a new one")
    p.add_argument("--exit-after", type=int, default=None, help="rank 0 exits with this status after everything")
    a = p.parse_args()
    if a.no_init:
        return
    device = torch.device("cpu")
    kw: dict = {} if a.bucket_cap_mb is None else {"bucket_cap_mb": a.bucket_cap_mb}
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        kw["device_ids"] = [device.index]
    dist.init_process_group(a.backend)
    rank = dist.get_rank()
    if a.chdir:
        os.chdir(a.chdir)
    if a.monitored_barrier:  # gloo's alone: torch refuses it on any other backend, by the backend's name
        import datetime

        dist.monitored_barrier(timeout=datetime.timedelta(seconds=300))
        print(f"rank {rank}: backend {dist.get_backend()}", flush=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP().to(device), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for k in range(a.steps):
        if a.mark_steps:
            import commgate.capture

            commgate.capture.step()
        if a.fail_at == k and rank == 1:
            raise RuntimeError(f"planted failure at step {k}")
        x = torch.randn(4, 64).to(device)
        loss = model(x)
        loss.backward()
        if a.extra_all_reduce:
            dist.all_reduce(loss.detach().clone())
        if a.reduce_scatter:
            grad = model.module.net[0].weight.grad.flatten()[:64].contiguous()
            dist.reduce_scatter_tensor(torch.empty(64 // dist.get_world_size(), device=device), grad)
        if a.gather_scatter:  # rooted: the list is the root's alone
            pieces = [torch.empty(16, device=device) for _ in range(dist.get_world_size())]
            dist.gather(torch.ones(16, device=device), pieces if rank == 0 else None, dst=0)
            dist.scatter(torch.empty(16, device=device), pieces if rank == 0 else None, src=0)
        if not a.no_optimizer:
            opt.step()
            opt.zero_grad()
    if a.hang_at_end:
        hang(rank)
    if a.part:  # rank 1's end fails rank 0's call, which raises: the job fails, each rank's capture written
        if rank == 0:
            dist.all_reduce(torch.ones(3))
        return
    if a.reinit:
        reinit(a.backend, rank)
    if a.os_exit:
        os._exit(0)
    if a.exit_after is not None and rank == 0:  # a crash after its last call (a failed checkpoint save)
        sys.exit(a.exit_after)
    if a.own_sigterm:  # the job's own graceful shutdown, which takes a while: commgate leaves it be

        def shutdown(signum: int, frame: object) -> None:
            time.sleep(3)
            (a.own_sigterm / f"graceful{rank}").touch()
            sys.exit(0)

        signal.signal(signal.SIGTERM, shutdown)
        (a.own_sigterm / f"ready{rank}").touch()
        time.sleep(300)
    if a.linger:
        (a.linger / f"ready{rank}").touch()
        time.sleep(300)
    if a.deadlock:  # both ranks blocked inside gloo, each waiting on a call the other never issues
        pair = dist.new_group([0, 1])
        (a.deadlock / f"ready{rank}").touch()
        dist.all_reduce(torch.ones(4), group=pair if rank == 0 else None)
    if a.dump_fr:
        torch.cuda.synchronize() if a.backend == "nccl" else None
        dump_fr(rank, nccl=a.backend == "nccl")
    if a.spawn_child and rank == 1:  # it inherits the rank's environment, as a DataLoader worker does
        code = "import os, pathlib, sys, time; time.sleep(2); pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))"
        subprocess.Popen([sys.executable, "-c", code, str(a.spawn_child)])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']}: {a.steps} steps, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def reinit(backend: str, rank: int) -> None:
    """Destroy the group and set up a second one, as a job that re-initialises does, on a prefix of the
    launcher's store of its own: the second group's rendezvous then cannot read the first's addresses."""
    dist.destroy_process_group()
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore("second/", store), rank=rank, world_size=world)
    dist.all_reduce(torch.ones(3))


def dump_fr(rank: int, *, nccl: bool = False) -> None:
    """TORCH_FR_BUFFER_SIZE on; the files named as the watchdog names them: <prefix><rank> and .json. An NCCL
    job's calls are in NCCL's own recorder (``_dump_nccl_trace``), what its watchdog dumps."""
    import torch._C._distributed_c10d as c10d

    which = "_dump_nccl_trace" if nccl else "_dump_fr_trace"
    if nccl:  # a call has its duration once NCCL's watchdog has retired it: wait for that (at most 60 s)
        import pickle

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(e.get("retired", True) for e in pickle.loads(c10d._dump_nccl_trace()).get("entries", [])):
                break
            time.sleep(0.05)
    prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    for suffix, dump in (("", getattr(c10d, which)()), (".json", getattr(c10d, f"{which}_json")())):
        dump = dump.encode() if isinstance(dump, str) else dump
        with open(f"{prefix}{rank}{suffix}.part", "wb") as f:
            f.write(dump)
        os.replace(f"{prefix}{rank}{suffix}.part", f"{prefix}{rank}{suffix}")  # whole, or not there


def hang(rank: int) -> None:
    """Rank 0 blocks in an all_reduce rank 1 never issues; a thread of rank 0 dumps once that call is in the
    Flight Recorder (waiting on the record, not on a clock) and ends the job; rank 1 dumps, then waits for
    rank 0's dump before it leaves (its leaving would fail rank 0's call before the dump)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    def entries() -> int:
        return len(pickle.loads(_dump_fr_trace()).get("entries", []))

    if rank == 1:
        dump_fr(rank)
        theirs = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0"
        deadline = time.monotonic() + 300
        while not os.path.exists(theirs) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)
    before = entries()

    def watch() -> None:
        while entries() == before:
            time.sleep(0.01)
        dump_fr(rank)
        print("rank 0: stuck in an all_reduce rank 1 never issued; Flight Recorder dumped", flush=True)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    dist.all_reduce(torch.ones(2048))  # never completes


if __name__ == "__main__":
    main()
