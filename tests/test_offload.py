"""ZeRO-Offload on commgate's own ZeRO workload, as users fit models with it: ``offload_optimizer`` and
``offload_param`` to the CPU are modelled (measured on CPU gloo: ZeRO-1/2 send what they send without it;
ZeRO-3 all-reduces its gradient norm as one fp32 instead of one float64 once the optimizer is offloaded),
the config's own optimizer is the one DeepSpeed builds (DeepSpeedCPUAdam under offload), and without one
the client optimizer is DeepSpeedCPUAdam, which DeepSpeed requires there. NVMe and partial offload are
not modelled: a one-line error unless the model check is off. The first run builds DeepSpeed's cpu_adam op
(once per environment)."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.judge.reconcile import reconcile
from commgate.model.collectives import Op
from commgate.model.loader import load_text
from commgate.model.predict import predict


def scenario(scheme: str, zero: str, optimizer: bool = True, extra: str = "") -> str:
    config = "optimizer: {type: AdamW, params: {lr: 0.0001}}, " if optimizer else ""
    return (
        f"schema_version: 1\nname: off-{scheme}\nmodel: {{preset: 19M-cpu, L: 2}}\n"
        f"parallelism: {{scheme: {scheme}, dp: 2}}\nsteps: 2\ndeadline_s: 1800\n"
        f"deepspeed: {{{config}zero_optimization: {{{zero}}}}}\n{extra}"
    )


def norm(text: str) -> set[str]:
    (s,) = load_text(text)
    return {c.dtype for c in predict(s).collectives if c.op is Op.ALL_REDUCE and "gradient-norm" in c.source}


def test_zero3_offloading_its_optimizer_all_reduces_the_norm_in_fp32() -> None:
    assert norm(scenario("zero3", "offload_optimizer: {device: cpu}")) == {"fp32"}
    assert norm(scenario("zero3", "cpu_offload: true")) == {"fp32"}
    assert norm(scenario("zero3", "offload_param: {device: cpu}")) == {"float64"}
    assert norm(scenario("zero3", "offload_optimizer: {device: none}")) == {"float64"}


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ("offload_optimizer: {device: nvme, nvme_path: /tmp}", "optimizer offload to NVMe or in part is not modelled"),
        ("offload_optimizer: {device: cpu, ratio: 0.5}", "optimizer offload to NVMe or in part is not modelled"),
        ("offload_param: {device: nvme, nvme_path: /tmp}", "parameter offload to NVMe or in part is not modelled"),
    ],
)
def test_nvme_and_partial_offload_are_one_line_errors(zero: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(scenario("zero3", zero))
    assert len(info.value.problems) == 1
    (s,) = load_text(scenario("zero3", zero, extra="expectations: {model: {check: false}}\n"))
    assert s.deepspeed_config["zero_optimization"]


@pytest.mark.parametrize(
    ("scheme", "zero", "optimizer"),
    [
        ("zero3", "offload_optimizer: {device: cpu}, offload_param: {device: cpu}", True),
        ("zero2", "offload_optimizer: {device: cpu}", False),
    ],
    ids=["zero3-config-optimizer", "zero2-client-cpu-adam"],
)
def test_offloaded_runs_reconcile(scheme: str, zero: str, optimizer: bool, tmp_path: Path) -> None:
    from commgate.run.launcher import launch_local

    (s,) = load_text(scenario(scheme, zero, optimizer))
    prediction = predict(s)
    assert all(c.unexplained_bytes == 0 for c in prediction.comparison())
    rec = reconcile(prediction, launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
