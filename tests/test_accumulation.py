"""Gradient accumulation (m micro-batches a step), activation checkpointing and 16-bit parameters on the
real frameworks: DeepSpeed ZeRO-1/2/3, ZeRO++ hpZ and MoE with ZeRO, and torch DDP with ``no_sync``,
each reconciled to 0 unexplained bytes, with the model's own named terms making up the difference to the
paper exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.run.launcher import launch_local

MODEL = "{L: 2, h: 32, a: 4, V: 256, s: 32, x: 2, dtype: DTYPE}"


def run(par: str, *, m: int, dtype: str = "fp32", ac: bool = False, tmp: Path, deepspeed: str = "{}") -> None:
    text = (
        f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', dtype)}\n"
        f"parallelism: {{{par}, micro_batches: {m}, activation_checkpointing: {str(ac).lower()}}}\nsteps: 2\n"
        f"deepspeed: {deepspeed}\n"
    )
    (s,) = load_text(text)
    prediction = predict(s)
    rec = reconcile(prediction, launch_local(s, workdir=tmp))
    missed = [f"{k.label}: {k.measured_calls} vs {k.predicted_calls}" for k in rec.mismatches]
    assert not missed, "\n".join(missed)
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    comparison = prediction.comparison()
    assert comparison and all(c.unexplained_bytes == 0 for c in comparison)
    named = {r.name for c in comparison for r in c.residuals}
    if m > 1 and not any(k in par for k in ("zero1", "ddp", "stage: 0", "stage: 1", "scheme: pp")):
        assert "gradient accumulation" in named  # the m - 1 extra passes are a named term, not a remainder


SCHEMES = {
    "ddp": "scheme: ddp, dp: 2",
    "zero1": "scheme: zero1, dp: 2, zero: {bucket_elements: 4000}",
    "zero2": "scheme: zero2, dp: 2, zero: {bucket_elements: 4000}",
    "zero3": "scheme: zero3, dp: 2, zero: {bucket_elements: 4000}",
    "zero++": "scheme: zero++, dp: 4, zero: {hpz: 2}",
    "moe-zero2": "scheme: moe, dp: 2, moe: {experts: 2, ep: 2}, zero: {stage: 2}",
    "pp": "scheme: pp, pp: 2, dp: 2",
}


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_accumulation_is_modelled(scheme: str, m: int, tmp_path: Path) -> None:
    run(SCHEMES[scheme], m=m, tmp=tmp_path)


OVERLAP = "{zero_optimization: {overlap_comm: true}}"


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(
    "par",
    [
        "scheme: zero1, dp: 2, zero: {bucket_elements: 4000}",
        "scheme: moe, dp: 2, moe: {experts: 2, ep: 2}, zero: {stage: 1, bucket_elements: 2000}",
    ],
)
def test_zero1_with_overlap_comm_reduces_in_the_hooks(par: str, m: int, tmp_path: Path) -> None:
    """``overlap_comm: true`` at ZeRO-1 (GPT-NeoX's configs set it) fills the buckets as the gradients
    become ready in the boundary micro-batch's backward, not in registration order after it: other
    bucket sizes, once per step."""

    def buckets(ds: str) -> list[tuple[int, int]]:
        (s,) = load_text(
            f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'fp32')}\n"
            f"parallelism: {{{par}}}\ndeepspeed: {ds}\n"
        )
        return sorted((r.elements, r.calls) for r in predict(s).collectives if "gradient all-reduce" in r.source)

    assert buckets(OVERLAP) != buckets("{}")  # the test below can tell the orders apart
    run(par, m=m, tmp=tmp_path, deepspeed=OVERLAP)


BF16 = {  # scheme, its DeepSpeed keys, the optimizer wrapper DeepSpeed's engine chooses
    "zero1-fp32-accumulation": ("scheme: zero1, dp: 3", "{data_types: {grad_accum_dtype: fp32}}", "BF16_Optimizer"),
    "pp-stage0": ("scheme: pp, pp: 2, dp: 3", "{}", "BF16_Optimizer"),
    "pp-zero1": ("scheme: pp, pp: 2, dp: 2, zero: {stage: 1, bucket_elements: 300}", "{}", "ZeRO"),
    "moe-stage0": ("scheme: moe, dp: 4, moe: {experts: 2, ep: 2}, zero: {stage: 0}", "{}", "FP16_Optimizer"),
}


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("case", BF16)
def test_deepspeeds_bf16_optimizers(case: str, m: int, tmp_path: Path) -> None:
    """bf16 where DeepSpeed's engine wraps the optimizer otherwise than in ZeRO: BF16_Optimizer (its flat
    gradient buffer all-reduced whole, padded; the updated partitions all-gathered) and FP16_Optimizer
    in bf16 (only an overflow flag), and ZeRO-1 inside the pipeline engine (norms in fp32, overflow
    flags in uint8)."""
    from commgate.model.expectation import Context

    par, ds, wrapper = BF16[case]
    (s,) = load_text(
        f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'bf16')}\nparallelism: {{{par}}}\n"
        f"deepspeed: {ds}\n"
    )
    assert Context(scenario=s).optimizer == wrapper
    run(par, m=m, dtype="bf16", tmp=tmp_path, deepspeed=ds)


@pytest.mark.parametrize("scheme", ["ddp", "zero2", "zero3"])
def test_bf16_with_accumulation_and_checkpointing(scheme: str, tmp_path: Path) -> None:
    run(SCHEMES[scheme], m=2, dtype="bf16", ac=True, tmp=tmp_path)


def test_the_model_names_the_recompute_of_zero3(tmp_path: Path) -> None:
    (s,) = load_text(
        f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'fp32')}\n"
        "parallelism: {scheme: zero3, dp: 2, activation_checkpointing: true}\n"
    )
    (c,) = predict(s).comparison()
    assert "activation-checkpoint recompute" in {r.name for r in c.residuals} and c.unexplained_bytes == 0


@pytest.mark.parametrize("scheme", ["zero1", "zero3", "pp", "moe-zero2"])
def test_a_communication_dtype_other_than_the_parameters(scheme: str, tmp_path: Path) -> None:
    """bf16 parameters with ``communication_data_type: fp32``: the gradients travel in fp32 (same buckets,
    twice the bytes; the pipeline engine's BF16_Optimizer and MoE's engine convert them as ZeRO does),
    and the difference to the paper is the named term "communication dtype"."""
    text = (
        f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'bf16')}\n"
        f"parallelism: {{{SCHEMES[scheme]}}}\nsteps: 2\ndeepspeed: {{communication_data_type: fp32}}\n"
    )
    (s,) = load_text(text)
    prediction = predict(s)
    grads = [
        r for r in prediction.collectives if "gradient" in r.source and r.op.value in ("all_reduce", "reduce_scatter")
    ]
    assert {r.dtype for r in grads if "norm" not in r.source and "overflow" not in r.source} == {"fp32"}
    comparison = prediction.comparison()
    assert "communication dtype" in {r.name for c in comparison for r in c.residuals}
    assert all(c.unexplained_bytes == 0 for c in comparison)
    assert reconcile(prediction, launch_local(s, workdir=tmp_path)).ok


@pytest.mark.parametrize("m", [1, 4])
def test_ddp_under_autocast_reduces_fp32_gradients(m: int, tmp_path: Path) -> None:
    """``model.autocast: bf16``: the forward computes in bf16 under torch.autocast, the parameters stay
    fp32, so DDP all-reduces fp32 gradients: the same buckets as plain fp32, and 0 unexplained bytes."""
    text = (
        f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'fp32').replace('}', ', autocast: bf16}')}\n"
        f"parallelism: {{scheme: ddp, dp: 2, micro_batches: {m}}}\nsteps: 2\n"
    )
    (s,) = load_text(text)
    assert s.model.autocast == "bf16"
    prediction = predict(s)
    assert {r.dtype for r in prediction.collectives if "gradient all-reduce" in r.source} == {"fp32"}
    rec = reconcile(prediction, launch_local(s, workdir=tmp_path))
    assert not rec.mismatches and all(o.unexplained_bytes == 0 for o in rec.ops)


def test_autocast_is_for_ddp_with_fp32_parameters() -> None:
    from commgate.core.errors import ScenarioError

    bad = f"schema_version: 1\nname: t\nmodel: {MODEL.replace('DTYPE', 'bf16').replace('}', ', autocast: bf16}')}\n"
    with pytest.raises(ScenarioError, match=r"model\.autocast: bf16: autocast is run under scheme ddp with fp32"):
        load_text(bad + "parallelism: {scheme: ddp, dp: 2}\n")
    with pytest.raises(ScenarioError, match=r"scheme 'zero2'"):
        load_text(bad.replace("bf16,", "fp32,") + "parallelism: {scheme: zero2, dp: 2}\n")
