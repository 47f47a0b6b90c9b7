"""Step time with capture on vs off, interleaved step by step in one run, medians and ratios.

    .venv/bin/python benchmarks/capture_overhead.py [--steps 40] [--preset 19M-cpu]

Two ranks on CPU gloo. Every round runs one step of each variant, in rotating order:

* DDP: ``DistributedDataParallel`` on a plain gloo process group vs an identical model on commgate's
  capturing group (the full cost of interposing and recording);
* DeepSpeed ZeRO-1 on the capturing group: recording on vs off (the same engine), and DeepSpeed's own
  ``comms_logger`` on vs off (what DeepSpeed users would otherwise use).

Prints per-variant median step time and the ratios (goal for capture: <= 1.03).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, steps: int, preset: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from commgate.model.loader import load_text
    from commgate.model.transformer import PRESETS
    from commgate.run import interpose
    from commgate.run.workloads.gpt import GPT, batch
    from commgate.run.workloads.zero import ds_config

    rec = interpose.install("gloo", rank)
    dist.init_process_group(interpose.BACKEND_NAME, init_method=f"file://{store}", rank=rank, world_size=world)
    plain = dist.new_group(backend="gloo")
    spec = PRESETS[preset]

    def ddp(group: object) -> Callable[[int], None]:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(GPT(spec), process_group=group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(k: int) -> None:
            model(batch(spec, 1, seed=k + rank)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    (scenario,) = load_text(
        f"schema_version: 1\nname: b\nmodel: {{preset: {preset}}}\nparallelism: {{scheme: zero1, dp: {world}}}\n"
    )
    torch.manual_seed(0)
    model = GPT(spec)
    config = ds_config(scenario) | {"comms_logger": {"enabled": False, "verbose": False}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    from deepspeed.comm import comm as ds_comm

    def zero(record: bool, logger: bool) -> Callable[[int], None]:
        def step(k: int) -> None:
            interpose.RECORDER = rec if record else None
            ds_comm.comms_logger.enabled = logger
            loss = engine(batch(spec, 1, seed=k + rank))
            engine.backward(loss)
            engine.step()
            interpose.RECORDER = rec

        return step

    interpose.RECORDER = None
    variants = {"ddp-plain": ddp(plain), "ddp-captured": ddp(None)}
    interpose.RECORDER = rec
    variants |= {
        "zero1-off": zero(False, False),
        "zero1-captured": zero(True, False),
        "zero1-comms_logger": zero(False, True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for k in range(steps + 2):
        order = names[k % len(names) :] + names[: k % len(names)]
        for name in order:
            dist.barrier(group=plain)
            t = time.perf_counter()
            variants[name](k)
            if k >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - t)
        rec.calls.clear()  # keep the recorder's memory flat over the run
    if rank == 0:
        med = {n: statistics.median(v) for n, v in times.items()}
        lines = [f"{n:<20} median {1e3 * m:8.2f} ms over {len(times[n])} steps" for n, m in med.items()]
        lines.append(f"DDP capture / plain gloo        : {med['ddp-captured'] / med['ddp-plain']:.3f}")
        lines.append(f"ZeRO-1 recording on / off       : {med['zero1-captured'] / med['zero1-off']:.3f}")
        lines.append(f"ZeRO-1 comms_logger on / off    : {med['zero1-comms_logger'] / med['zero1-off']:.3f}")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier(group=plain)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--preset", default="19M-cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.steps, args.preset, out), nprocs=2)
        with open(out) as f:
            print(f.read(), end="")


if __name__ == "__main__":
    main()
