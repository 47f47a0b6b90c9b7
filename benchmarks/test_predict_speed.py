"""How long ``predict`` takes: a 4096-rank 3D layout of the 13B preset (goal: well under 10 ms).

Run: .venv/bin/python -m pytest benchmarks --benchmark-only
"""

from typing import Any

import pytest
from commgate.model import layout
from commgate.model import transformer as model
from commgate.model.loader import load_document
from commgate.model.predict import predict
from commgate.model.scenario import Scenario
from commgate.model.schemes import deepspeed_zero, zero3_fetch

BIG = {"scheme": "3d", "dp": 64, "tp": 8, "pp": 8, "micro_batches": 16}


def scenario(**par: Any) -> Scenario:
    doc = {"schema_version": 1, "name": "bench", "model": {"preset": "13B"}, "parallelism": par}
    (s,) = load_document(doc, file="<bench>")
    return s


def clear_caches() -> None:
    model.inventory.cache_clear()
    zero3_fetch.module_tree.cache_clear()
    zero3_fetch._builtin_layers.cache_clear()
    zero3_fetch._builtin_hooks.cache_clear()
    zero3_fetch._builtin_recording.cache_clear()
    zero3_fetch._builtin_traced.cache_clear()
    zero3_fetch._shape.cache_clear()
    zero3_fetch._passes.cache_clear()
    deepspeed_zero._ready_order_of.cache_clear()
    deepspeed_zero._zero3_buckets.cache_clear()
    for f in (layout.Layout.dp_groups, layout.Layout.tp_groups, layout.Layout.pp_groups, layout.Layout.stage_pairs):
        f.cache_clear()


def run(s: Scenario) -> None:
    p = predict(s)
    assert all(c.unexplained_bytes == 0 for c in p.comparison())


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_predict_4096_rank_3d(benchmark: Any, cold: bool) -> None:
    s = scenario(**BIG)
    assert s.world_size == 4096
    if cold:
        benchmark.pedantic(run, args=(s,), setup=clear_caches, rounds=50)
    else:
        benchmark(run, s)


def test_load_and_predict_default_suite(benchmark: Any) -> None:
    from pathlib import Path

    from commgate.model.loader import load_paths

    root = Path(__file__).resolve().parents[1] / "scenarios"
    benchmark(lambda: [predict(s) for s in load_paths([root])])


@pytest.mark.parametrize("scheme", ["zero3", "zero2", "ddp"])
def test_predict_13b_at_1024_gpus(benchmark: Any, scheme: str) -> None:
    """Goal (issue 11): a full-size config, 13B on 1024 GPUs with accumulation, predicted in under 50 ms
    (cold caches: the parameter inventory and the layout are rebuilt every round)."""
    s = scenario(scheme=scheme, dp=1024, micro_batches=4, activation_checkpointing=True)
    benchmark.pedantic(run, args=(s,), setup=clear_caches, rounds=20)


def test_import_and_predict_neox_13b_at_1024_gpus(benchmark: Any) -> None:
    """Goal (issue 11): GPT-NeoX's own 13B config (ZeRO-1 with overlap_comm, fp16, checkpointing), imported
    at 1024 GPUs and predicted in under 50 ms, from the file (cold caches every round)."""
    from pathlib import Path

    from commgate.model.importer import build

    neox = Path(__file__).resolve().parents[1] / "tests" / "data" / "neox" / "13B.yml"

    def imported() -> None:
        (s,) = load_document(build(neox=neox, dp=1024).doc, file="<import>")
        run(s)

    benchmark.pedantic(imported, setup=clear_caches, rounds=20)
