"""Tied embeddings under tensor parallelism, on commgate's own workloads: the output layer is Megatron's
tied head, a column-parallel layer whose weight is the vocabulary-parallel word embedding's (one DTensor
sharded on the vocabulary, distributed once, its gradient summed from both uses on each rank), with DDP
(tp and cp schemes) or FSDP2 over the replicas, and with sequence parallelism. Every byte as modelled."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.run.workloads import skip_reason

LLAMA = "architecture: llama, L: 2, h: 32, a: 4, kv_heads: 2, ffn_hidden: 88, V: 128, s: 32"


def scenario(scheme: str, par: str, model: str = "preset: 19M-cpu"):  # type: ignore[no-untyped-def]
    (s,) = load_text(
        f"schema_version: 1\nname: tied-{scheme}\nmodel: {{{model}, tied_embeddings: true}}\n"
        f"parallelism: {{scheme: {scheme}, {par}}}\nsteps: 2\n"
    )
    return s


@pytest.mark.parametrize(
    ("scheme", "par", "model"),
    [
        ("tp", "dp: 2, tp: 2", "preset: 19M-cpu"),
        ("tp", "dp: 1, tp: 2, sequence_parallel: true", LLAMA),
        ("fsdp", "dp: 2, tp: 2", "preset: 19M-cpu"),
        ("cp", "dp: 1, cp: 2, tp: 2", LLAMA),
        ("pp", "dp: 2, pp: 2, micro_batches: 2", "preset: 19M-cpu, dtype: bf16"),
        ("pp", "dp: 1, pp: 3, micro_batches: 3, activation_checkpointing: true", "preset: 19M-cpu"),
        ("3d", "dp: 1, tp: 2, pp: 2, micro_batches: 2", LLAMA.replace("L: 2", "L: 4")),
    ],
    ids=["tp-ddp", "tp-sp", "fsdp-tp", "cp-tp", "pp-dp-bf16", "pp3-checkpointing", "3d"],
)
def test_tied_embeddings_reconcile(scheme: str, par: str, model: str, tmp_path: Path) -> None:
    from commgate.run.launcher import launch_local

    s = scenario(scheme, par, model)
    assert skip_reason(s, gpus=False) is None
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted


def test_the_tied_head_holds_the_embeddings_parameter() -> None:
    """The tie survives the plan: after ``parallelize`` the head's and the embedding's weight are one
    parameter (checked on one rank of a one-rank mesh: the tie is local)."""
    import torch
    import torch.distributed as dist
    from commgate.run.workloads.gpt import GPT
    from commgate.run.workloads.tp import parallelize
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = GPT(scenario("tp", "dp: 1, tp: 2").model)
        assert model.head is None
        parallelize(model, init_device_mesh("cpu", (1,)))
        assert model.head is not None and model.head.weight is model.embed.word.weight
        assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
        assert torch.equal(model.head.weight.full_tensor(), model.embed.word.weight.full_tensor())
    finally:
        dist.destroy_process_group()


def test_tied_embeddings_in_torchs_pipeline_stages_are_skipped_with_the_reason() -> None:
    s = scenario("pp", "dp: 1, pp: 2, micro_batches: 2, pipeline: {engine: torch, schedule: gpipe}")
    assert "torch.distributed.pipelining ties no weights across stages" in (skip_reason(s, gpus=False) or "")
