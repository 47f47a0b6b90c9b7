"""``torch.distributed.pipelining`` (``parallelism.pipeline: {engine: torch, schedule, virtual_stages}``):
per micro-batch every boundary between consecutive stages carries the activation forward and its
gradient back, whatever the schedule; interleaving adds boundaries (a named term against Eq. 4); the
time model's bubble follows the schedule. The real runs: ``scenarios/pp-torch-interleaved.yaml`` and
the generator's draws."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.model.collectives import Op
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.report.timemodel import bubble_factor


def scenario(pipeline: str, extra: str = "", model: str = "{preset: 19M-cpu, L: 8}") -> str:
    return (
        f"schema_version: 1\nname: s\nmodel: {model}\n"
        f"parallelism: {{scheme: pp, pp: 2, micro_batches: 4{extra}, pipeline: {{engine: torch, {pipeline}}}}}\n"
    )


@pytest.mark.parametrize(
    ("pipeline", "boundaries"),
    [
        ("schedule: gpipe", 1),
        ("schedule: 1f1b", 1),
        ("schedule: interleaved-1f1b, virtual_stages: 2", 3),
        ("schedule: interleaved-1f1b, virtual_stages: 4", 7),
        ("schedule: zero-bubble, virtual_stages: 2", 3),
    ],
)
def test_every_boundary_carries_an_activation_and_a_gradient_per_micro_batch(pipeline: str, boundaries: int) -> None:
    (s,) = load_text(scenario(pipeline))
    p = predict(s)
    bsh = 1 * 128 * 64
    sends = Counter(c.source.split(" ")[2] for c in p.collectives if c.op is Op.SEND for _ in range(c.calls))
    assert sends == {"activation": boundaries * 4, "gradient": boundaries * 4}  # m = 4
    assert {c.elements for c in p.collectives} == {bsh} and {c.op for c in p.collectives} == {Op.SEND, Op.RECV}
    # stage k on rank k mod 2: every boundary crosses between the two ranks, both ways
    assert {c.groups for c in p.collectives if c.op is Op.SEND} == {((0, 1),), ((1, 0),)}
    (c,) = p.comparison()
    assert c.unexplained_bytes == 0
    assert ("interleaved virtual stages" in {r.name for r in c.residuals}) == (boundaries > 1)


def test_the_bubble_follows_the_schedule() -> None:
    def factor(pipeline: str) -> float:
        (s,) = load_text(scenario(pipeline))
        return bubble_factor(s.parallelism)

    assert factor("schedule: 1f1b") == factor("schedule: gpipe") == 1 / 4  # (p-1)/m
    assert factor("schedule: interleaved-1f1b, virtual_stages: 2") == 1 / 8  # (p-1)/(v m)
    assert factor("schedule: zero-bubble, virtual_stages: 2") == 1 / 24


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (scenario("schedule: gpipe", ", dp: 2"), "data parallelism inside torch.s stages is FSDP2.s"),
        (scenario("schedule: interleaved-1f1b"), "an interleaved schedule needs virtual_stages >= 2"),
        (scenario("schedule: 1f1b, virtual_stages: 2"), "runs one stage per rank"),
        (scenario("schedule: interleaved-1f1b, virtual_stages: 3"), "L=8 are not divisible by pp\\*virtual_stages=6"),
        (scenario("schedule: gpipe").replace("engine: torch", "engine: deepspeed"), "DeepSpeed's engine runs its own"),
        (scenario("schedule: gpipe").replace("scheme: pp, pp: 2", "scheme: ddp, dp: 2"), "needs a pipeline scheme"),
        (scenario("schedule: wavefront"), "parallelism.pipeline.schedule"),
        (scenario("schedule: 1f1b").replace("batches: 4", "batches: 1"), "Schedule1F1B needs at least pp=2"),
        (scenario("schedule: gpipe", ", zero: {stage: 1}"), "ZeRO options do not apply to torch"),
        (
            scenario("schedule: gpipe").replace("scheme: pp", "scheme: 3d, tp: 2"),
            r"modelled under schemes 'fsdp' or 'pp', not '3d' \(scheme '3d' with engine torch is torchtitan's",
        ),
    ],
)
def test_what_torch_pipelining_refuses_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "pipeline",
    ["schedule: 1f1b", "schedule: interleaved-1f1b, virtual_stages: 2", "schedule: zero-bubble, virtual_stages: 2"],
)
def test_activation_checkpointing_in_torchs_stages_reconciles(pipeline: str, tmp_path: Path) -> None:
    """torch.utils.checkpoint (non-reentrant) around each layer of a stage: the recompute runs inside the
    stage's backward and sends nothing across the boundaries; the runs reconcile as modelled."""
    from commgate.judge.reconcile import reconcile
    from commgate.run.launcher import launch_local

    model = "{architecture: llama, L: 4, h: 32, a: 4, kv_heads: 2, ffn_hidden: 88, V: 128, s: 32}"
    (s,) = load_text(scenario(pipeline, ", activation_checkpointing: true", model) + "steps: 2\n")
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
