"""Context parallelism (``scheme: cp``, ``parallelism.cp``, ``cp_rotate``): torch's ring attention passes
each rank's K/V shard around the context-parallel group in the forward and again in the backward, and dK/dV
once more in fp32; the volume is 6*L*b*s*kv_dim*(c-1)/c per rank and micro-batch, what differs from it is
named. The real runs: ``scenarios/cp.yaml`` (a sequence-length sweep), ``scenarios/cp-tp-llama.yaml``, the
runs below and the generator's draws."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.judge.reconcile import reconcile
from commgate.model.collectives import Op
from commgate.model.expectation import Phase
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.run.launcher import launch_local


def scenario(par: str = "", model: str = "{preset: 19M-cpu}", extra: str = "") -> str:
    """cp=2 unless ``par`` gives cp."""
    cp = "" if " cp: " in par else ", cp: 2"
    return f"schema_version: 1\nname: c\nmodel: {model}\nparallelism: {{scheme: cp{cp}{par}}}\nsteps: 2\n{extra}"


def ring(text: str) -> tuple[list, object]:  # type: ignore[type-arg]
    (s,) = load_text(text)
    p = predict(s)
    return [c for c in p.collectives if c.axis == "cp"], p


@pytest.mark.parametrize(
    "par",
    [
        "",
        ", cp_rotate: alltoall",
        ", activation_checkpointing: true, micro_batches: 3",
        ", cp: 4, cp_rotate: alltoall, activation_checkpointing: true, micro_batch: 2",
        ", cp: 4, tp: 2, dp: 2",
    ],
)
@pytest.mark.parametrize("model", ["{preset: 13B}", "{preset: llama3-8B}", "{preset: 19M-cpu, dtype: bf16}"])
def test_every_difference_from_the_ring_volume_is_named(par: str, model: str) -> None:
    rows, p = ring(scenario(par, model))
    comparison = {c.term.equation: c for c in p.comparison()}  # type: ignore[attr-defined]
    assert all(c.unexplained_bytes == 0 for c in comparison.values())
    cp = comparison["CP ring"]
    assert sum(r.calls for r in rows) > 0 and cp.term.bytes > 0
    names = {r.name for r in cp.residuals}
    assert ("dK/dV in fp32" in names) == ("13B" in model or "llama" in model or "bf16" in model)  # 16-bit models
    assert ("K/V rotations by the all-to-all convention" in names) == ("alltoall" in par)


def test_allgather_rotation_is_the_derived_volume_exactly() -> None:
    """Rank 0 of cp=2 on the 19M model: per layer one all-gather of the K/V buffer each way and two
    dK/dV rotations; fp32, so the derived volume with no term at all."""
    rows, p = ring(scenario())
    (cp,) = [c for c in p.comparison() if c.term.equation == "CP ring"]  # type: ignore[attr-defined]
    assert cp.residuals == () and cp.model_bytes == cp.term.bytes
    b, s, h, L = 1, 128, 64, 6
    buf = 2 * b * (s // 2) * h  # K and V of half the sequence
    calls = Counter((c.op, c.phase, c.elements, c.dtype) for c in rows for _ in range(c.calls))
    assert calls == {
        (Op.ALL_GATHER, Phase.FORWARD, 2 * buf, "fp32"): L,
        (Op.ALL_GATHER, Phase.BACKWARD, 2 * buf, "fp32"): L,
        (Op.ALL_TO_ALL, Phase.BACKWARD, buf, "fp32"): 2 * L,
    }
    assert cp.term.elements == 6 * L * b * s * h * Fraction(1, 2)


def test_the_key_value_width_follows_grouped_heads_and_tensor_parallelism() -> None:
    """Llama-3-8B: 8 key/value heads of 128 = 1024 wide; with tp=2 each rank passes its 4 heads; the dK/dV
    rotations are fp32 whatever the model's dtype (bf16)."""
    rows, _ = ring(scenario(", tp: 2", "{preset: llama3-8B, s: 4096}"))
    kv = {c.dtype: c.elements for c in rows if c.op is Op.ALL_TO_ALL}
    gathered = {c.elements for c in rows if c.op is Op.ALL_GATHER}
    assert kv == {"fp32": 2 * 2048 * 512} and gathered == {2 * 2 * 2048 * 512}
    assert {g for c in rows for g in c.groups} == {(0, 2), (1, 3)}  # mesh (dp, cp, tp): cp strided by tp


def test_groups_on_the_dp_cp_tp_mesh() -> None:
    """dp=2, cp=2, tp=2 as torchtitan orders the mesh: the ring within (0, 2), (1, 3), (4, 6), (5, 7); DDP's
    all-reduce over the 4 ranks of a tensor-parallel index (dp x cp), TP within consecutive pairs."""
    (s,) = load_text(scenario(", dp: 2, tp: 2"))
    p = predict(s)
    by_axis = {c.axis: set(c.groups) for c in p.steady}
    assert by_axis["cp"] == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert by_axis["dp"] == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert by_axis["tp"] == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert s.world_size == 8 and s.parallelism.data_ranks == 4


def test_the_volume_grows_linearly_in_the_sequence_length() -> None:
    """The sweep of scenarios/cp.yaml at full size: the ring's volume doubles with s, DDP's does not move
    (Anthony et al.'s Figs. 14-15 show TP and PP growing in s, DP flat)."""

    def volumes(s: int) -> tuple[int, int]:
        (sc,) = load_text(scenario(", dp: 2", f"{{preset: 1.3B, s: {s}, position: rotary}}"))
        p = predict(sc)
        by = Counter[str]()
        for c in p.steady:
            by[c.axis] += c.bytes_per_step if c.issued_by(0) else 0
        return by["cp"], by["dp"]

    (cp1, dp1), (cp2, dp2), (cp4, dp4) = volumes(2048), volumes(4096), volumes(8192)
    assert cp2 == 2 * cp1 and cp4 == 4 * cp1 and dp1 == dp2 == dp4 > 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (scenario().replace("cp: 2", "cp: 1"), r"parallelism\.cp: 1: scheme 'cp' needs cp >= 2"),
        (scenario().replace("scheme: cp", "scheme: ddp, dp: 2"), r"parallelism\.cp: 2: scheme 'ddp' has no context"),
        (scenario(", cp: 3"), r"parallelism\.cp: 3: sequence length s=128 is not divisible by cp"),
        (scenario(", tp: 2, sequence_parallel: true"), "sequence parallelism with context parallelism"),
        (
            scenario(", cp_rotate: alltoall").replace("scheme: cp, cp: 2", "scheme: ddp, dp: 2"),
            r"parallelism\.cp_rotate: alltoall: rotates K/V between context-parallel ranks",
        ),
        (scenario(", cp_rotate: ring"), r"parallelism\.cp_rotate"),
        (scenario(model="{module: 'commgate.examples.mixer:build'}"), "a user's module is modelled under"),
        (scenario(extra="world_size: 4\n"), r"world_size: 4 != dp\*cp\*tp\*pp = 1\*2\*1\*1 = 2"),
    ],
)
def test_what_context_parallelism_refuses_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "par",
    [", cp_rotate: alltoall, activation_checkpointing: true, micro_batches: 2", ", tp: 2"],
    ids=["alltoall-checkpointing-accumulation", "tp2"],
)
def test_a_real_run_reconciles_to_zero(par: str, tmp_path: Path) -> None:
    (s,) = load_text(scenario(par, "{preset: 19M-cpu, architecture: llama, kv_heads: 2, s: 64}"))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    assert "all_to_all" in {o.op for o in rec.ops}


@pytest.mark.parametrize(
    ("model", "par"),
    [
        ("{preset: 19M-cpu, s: 64}", ", cp: 4"),  # learned positions, load-balanced (64 % 8 == 0)
        ("{preset: 19M-cpu, s: 60, architecture: llama, kv_heads: 2}", ", cp: 3, cp_rotate: alltoall"),  # no balancing
    ],
)
def test_ring_attention_on_cpu_computes_what_plain_attention_does(model: str, par: str, tmp_path: Path) -> None:
    """The CPU kernel's handlers (``commgate.run.workloads.cp.cpu_ring_attention``) under torch's ring: every
    rank's loss and every parameter gradient, summed over the ring, equal the single-process ones (the
    check workload raises on a rank where they differ by more than 1e-5, and the run then fails)."""
    (s,) = load_text(scenario(par, model, "workload: commgate.run.workloads.cp:ring_check\n"))
    capture = launch_local(s, workdir=tmp_path)  # raises RunError naming the rank whose results differ
    ops = {c.op for c in capture.calls if c.step >= 0}
    # the check's own all-reduce, the dK/dV rotations, and K/V by all-gather unless rotated
    assert ops == {"all_reduce", "all_to_all"} | (set() if "alltoall" in par else {"all_gather"})


def test_fsdp2_shards_over_dp_times_cp() -> None:
    """torchtitan's composition: FSDP2 gathers and reduce-scatters over the dp x cp ranks (dp=1, cp=2: the
    2 of them), the ring runs within cp, in FSDP2's param_dtype (bf16: a named term), dK/dV in fp32."""
    (s,) = load_text(
        "schema_version: 1\nname: f\nmodel: {preset: 19M-cpu}\n"
        "parallelism: {scheme: fsdp, dp: 2, cp: 2, fsdp: {param_dtype: bf16}}\n"
    )
    p = predict(s)
    by_axis = {c.axis: {g for g in c.groups} for c in p.steady}
    assert by_axis["dp"] == {(0, 1, 2, 3)} and by_axis["cp"] == {(0, 1), (2, 3)}
    assert {c.dtype for c in p.steady if c.axis == "cp"} == {"bf16", "fp32"}
    comparison = {c.term.equation: c for c in p.comparison()}
    assert set(comparison) == {"Eq. 3", "CP ring"} and all(c.unexplained_bytes == 0 for c in comparison.values())
    names = {r.name for r in comparison["CP ring"].residuals}
    assert names == {"activations in a lower precision"}  # fp32 model: dK/dV's fp32 is no term


@pytest.mark.parametrize(
    ("par", "message"),
    [
        (", dp_replicate: 2", r"parallelism\.dp_replicate: 2: HSDP with context parallelism"),
        (", dp: 2, fsdp: {reshard_after_forward: 2}", r"reshard_after_forward: 2: an int with context parallelism"),
    ],
)
def test_what_fsdp2_with_context_parallelism_refuses_is_one_line(par: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(scenario(par).replace("scheme: cp", "scheme: fsdp"))
    assert "\n" not in str(info.value)


def test_a_real_fsdp2_context_tensor_run_reconciles_to_zero(tmp_path: Path) -> None:
    """FSDP2 x CP x TP on 4 ranks (dp=1): bf16 gathers, fp32 reduce-scatters, K/V rotated in bf16."""
    (s,) = load_text(
        "schema_version: 1\nname: f\nmodel: {preset: 19M-cpu, s: 64, architecture: llama, kv_heads: 2}\n"
        "parallelism: {scheme: fsdp, cp: 2, tp: 2, cp_rotate: alltoall, micro_batches: 2, "
        "fsdp: {param_dtype: bf16, reduce_dtype: fp32}}\nsteps: 2\n"
    )
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    assert {o.op for o in rec.ops} >= {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}
