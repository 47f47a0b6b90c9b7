"""A plain torch DDP training script, as a user writes it (nothing of commgate in it): a small MLP, SGD,
``--steps`` steps on gloo (or the backend named by ``--backend``), launched by torchrun.

* ``--bucket-cap-mb`` and ``--extra-all-reduce``: the planted changes the gate must catch;
* ``--fail-at K``: rank 1 raises at step K (a failing job must still leave a readable capture);
* ``--mark-steps``: each step marked with ``commgate.capture.step()``, as a job whose steps the optimizer
  does not mark would;
* ``--dump-fr``: the Flight Recorder (``TORCH_FR_BUFFER_SIZE``) dumped at the end, as a job asked for its
  dump does, to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (pickle) and ``<rank>.json``.
"""

import argparse
import os

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
    a = p.parse_args()
    dist.init_process_group(a.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    kw = {} if a.bucket_cap_mb is None else {"bucket_cap_mb": a.bucket_cap_mb}
    model = DistributedDataParallel(MLP(), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for k in range(a.steps):
        if a.mark_steps:
            import commgate.capture

            commgate.capture.step()
        if a.fail_at == k and rank == 1:
            raise RuntimeError(f"planted failure at step {k}")
        x = torch.randn(4, 64)
        loss = model(x)
        loss.backward()
        if a.extra_all_reduce:
            dist.all_reduce(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    if a.dump_fr:  # TORCH_FR_BUFFER_SIZE on; the files are named as the watchdog names them: <prefix><rank>
        from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

        prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
        for suffix, dump in (("", _dump_fr_trace()), (".json", _dump_fr_trace_json())):
            with open(f"{prefix}{rank}{suffix}", "wb") as f:
                f.write(dump)
    print(f"rank {rank} of {os.environ['WORLD_SIZE']}: {a.steps} steps, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
