"""FSDP2 inside torch.distributed.pipelining's stages (``scheme: fsdp`` with ``pp``, engine torch; with ``tp``
the 3-D composition): each stage's blocks and the stage sharded over its data-parallel ranks; how often a
group is gathered follows the schedule's order of forwards and backwards, since torch's stage keeps it
gathered after every backward but the step's last; one reduce-scatter per group at the step's end. The real
runs: ``scenarios/fsdp-tp-pp.yaml``, the runs below and the generator's draws."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.judge.reconcile import reconcile
from commgate.model.collectives import Op
from commgate.model.expectation import Context, Phase
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.schemes.fsdp import pipeline_order, pipelined_gathers
from commgate.run.launcher import launch_local


def scenario(par: str = "", schedule: str = "1f1b", model: str = "{preset: 19M-cpu, L: 4}") -> str:
    return (
        f"schema_version: 1\nname: f\nmodel: {model}\nparallelism: {{scheme: fsdp, dp: 2, pp: 2, micro_batches: 4"
        f"{par}, pipeline: {{engine: torch, schedule: {schedule}}}}}\nsteps: 2\n"
    )


@pytest.mark.parametrize(
    ("schedule", "stage", "order", "blocks"),
    [
        # measured on 4 ranks (dp=2, pp=2, m=4): stage 0 gathers each block in 2 forwards and 3 backwards
        ("1f1b", 0, "FFBFBFBB", (2, 3)),
        ("1f1b", 1, "FBFBFBFB", (1, 4)),
        ("gpipe", 0, "FFFFBBBB", (4, 1)),
        ("gpipe", 1, "FFFFBBBB", (4, 1)),
    ],
)
def test_the_gathers_follow_the_schedule(schedule: str, stage: int, order: str, blocks: tuple[int, int]) -> None:
    (s,) = load_text(scenario(schedule=schedule))
    ctx = Context(scenario=s)
    assert pipeline_order(ctx, stage) == order
    assert pipelined_gathers(ctx, stage, reshards=True) == blocks
    assert pipelined_gathers(ctx, stage, reshards=False) == (1, 0)  # the root: gathered once, kept


def test_groups_pairs_and_phases_on_the_pp_dp_tp_mesh() -> None:
    """pp=2, dp=2, tp=2 (8 ranks, rank = stage*4 + data*2 + model): FSDP2 within (0, 2), (1, 3) on stage 0,
    TP within (0, 1), the boundary sends one per pipeline; forwards and the step's final reduce-scatter run
    in the schedule (phase pipeline), the backward gathers in autograd."""
    (s,) = load_text(scenario(", tp: 2"))
    p = predict(s)
    fsdp = [c for c in p.steady if c.source.startswith("FSDP2")]
    assert {g for c in fsdp for g in c.groups} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert {(c.op, c.phase) for c in fsdp} == {
        (Op.ALL_GATHER, Phase.PIPELINE),
        (Op.ALL_GATHER, Phase.BACKWARD),
        (Op.REDUCE_SCATTER, Phase.PIPELINE),
    }
    sends = {g for c in p.steady if c.op is Op.SEND for g in c.groups}
    assert sends == {(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3)}
    assert {g for c in p.steady if c.axis == "tp" for g in c.groups} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert all(c.unexplained_bytes == 0 for c in p.comparison())
    assert {c.term.equation for c in p.comparison()} == {"Eq. 3", "Eq. 4", "Eq. 5"}


def test_the_stages_send_in_fsdp2s_param_dtype() -> None:
    (s,) = load_text(scenario(", fsdp: {param_dtype: bf16}"))
    p = predict(s)
    assert {c.dtype for c in p.steady if c.op in (Op.SEND, Op.RECV)} == {"bf16"}
    (eq4,) = [c for c in p.comparison() if c.term.equation == "Eq. 4"]
    assert "activations in a lower precision" in {r.name for r in eq4.residuals} and eq4.unexplained_bytes == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (scenario().replace("engine: torch, schedule: 1f1b", "engine: deepspeed"), "FSDP2 runs in torch.distributed"),
        (scenario(", dp_replicate: 2"), "HSDP in pipeline stages is not modelled yet"),
        (scenario(", fsdp: {reshard_after_forward: 2}"), "an int in pipeline stages is not modelled yet"),
        (scenario(", cp: 2"), "context parallelism in pipeline stages is not modelled yet"),
        (scenario(", tp: 2, sequence_parallel: true"), "sequence_parallel: true: not modelled in pipeline stages"),
        (
            scenario(schedule="interleaved-1f1b").replace("1f1b}", "1f1b, virtual_stages: 2}"),
            "modelled under gpipe and 1f1b",
        ),
    ],
)
def test_what_fsdp2_in_pipeline_stages_refuses_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("par", "schedule"),
    [
        (", fsdp: {param_dtype: bf16, reduce_dtype: fp32}", "gpipe"),
        (", tp: 2", "1f1b"),
        (", tp: 2, activation_checkpointing: true", "gpipe"),
    ],
    ids=["2-D-gpipe-mixed-precision", "3-D-1f1b", "3-D-gpipe-checkpointing"],
)
def test_a_real_run_reconciles_to_zero(par: str, schedule: str, tmp_path: Path) -> None:
    (s,) = load_text(scenario(par, schedule, "{preset: 19M-cpu, L: 4, s: 64}"))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    assert {o.op for o in rec.ops} >= {"all_gather", "reduce_scatter", "send", "recv"}
