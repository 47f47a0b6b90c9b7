"""A plain DeepSpeed training script, as a user writes it (nothing of commgate in it): the MLP of
``ddp_train.py`` under ``deepspeed.initialize`` with ZeRO stage 1 and torch's AdamW, on gloo, ``--steps``
steps, launched by torchrun. ``--reduce-bucket-size 2048`` (4096 elements by default) is the planted change
the gate must catch."""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from ddp_train import MLP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reduce-bucket-size", type=int, default=4096)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MLP()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": a.reduce_bucket_size, "allgather_bucket_size": 4096},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config
    )
    for _ in range(a.steps):
        loss = engine(torch.randn(4, 64))
        engine.backward(loss)
        engine.step()
    print(f"rank {engine.global_rank}: {a.steps} ZeRO-1 steps, loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
