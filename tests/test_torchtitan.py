"""``trainer: torchtitan``: torchtitan 0.3.0's own Trainer under the gate.

* The model at full size (no torchtitan needed): the figures of torchtitan's llama3 8B and 70B jobs, and
  Eqs. 3 and 5 against it at 0 unexplained bytes; what the rules refuse, one line each.
* Upstream (torchtitan importable, else skipped with the reason): one test per workaround of the adapter
  (``commgate.run.trainers.torchtitan``), each failing when torchtitan or torch changes so that the
  workaround is no longer needed or no longer works, and one per upstream behaviour the model relies on.
* Real runs on 2 and 4 CPU gloo ranks through commgate's launcher: every call key as predicted, 0 bytes
  unexplained, and the paper comparison at 0 unexplained.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from commgate.core.errors import CommgateError, ScenarioError
from commgate.model.collectives import Op
from commgate.model.expectation import Phase, Prediction
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.scenario import Scenario

TINY = "architecture: llama, L: 2, h: 72, a: 4, kv_heads: 2, V: 385, s: 256, ffn_hidden: 195"
"""A reduced llama3 with grouped-query attention whose vocabulary and FFN FSDP2 pads on 2 ranks (385 -> 386,
195 -> 196)."""
PP = "scheme: pp, pp: 2, micro_batch: 1, micro_batches: 4, pipeline: {engine: torch, schedule: 1f1b}"
"""torchtitan's pipeline over 2 ranks, 4 micro-batches a step."""
TINY_TP = TINY.replace("V: 385", "V: 386").replace("ffn_hidden: 195", "ffn_hidden: 196")
"""The same, with what tensor parallelism over 2 ranks splits even (each TP rank's 193 rows FSDP2 pads)."""


def scenario(par: str, block: str = "log_freq: 1", model: str = TINY, steps: int = 2, extra: str = "") -> Scenario:
    (s,) = load_text(
        f"schema_version: 1\nname: tt\ntrainer: torchtitan\ntorchtitan: {{{block}}}\nmodel: {{{model}}}\n"
        f"parallelism: {{{par}}}\nsteps: {steps}\nwarmup_steps: 1\ndeadline_s: 900\n{extra}"
    )
    return s


def bytes_at(p: Prediction, step: int, rank: int = 0) -> int:
    """What ``rank`` sends at ``step`` (its calls' message bytes)."""
    return sum(c.bytes_per_call * c.calls_in(range(step, step + 1)) for c in p.collectives if c.issued_by(rank))


def explained(p: Prediction) -> None:
    """Every paper equation against the model, 0 bytes left unexplained."""
    assert p.comparison() and all(c.unexplained_bytes == 0 for c in p.comparison()), p.comparison()


# ------------------------------------------------------------------------------------ at full size

LLAMA3_8B = "preset: llama3-8B, dtype: fp32"


def test_llama3_8b_fsdp_on_8_ranks() -> None:
    """llama3_8b (local batch 1, s = 8192, selective AC, log_freq 10) on d = 8: each block (wqkv 6144 x 4096,
    wo, w1, w3 14336 x 4096, w2, two norms) is gathered in bf16 twice and reduce-scattered in fp32 once;
    the embedding and [norm, lm_head] (128256 rows, padded to 128256 = 8 * 16032) as REPORT.md section 3
    gives them: 65.3 GB a rank a step."""
    p = predict(scenario("scheme: fsdp, dp: 8, micro_batch: 1, activation_checkpointing: true", "", LLAMA3_8B))
    block = 6144 * 4096 + 4096 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    rows = {(c.op, c.phase, c.bytes_per_call): c.calls for c in p.collectives if c.from_step == 0}
    assert rows[Op.ALL_GATHER, Phase.FORWARD, 2 * block] == rows[Op.ALL_GATHER, Phase.BACKWARD, 2 * block] == 32
    assert rows[Op.REDUCE_SCATTER, Phase.BACKWARD, 4 * block] == 32
    assert 2 * block == 436_224_000
    emb, head = 128256 * 4096 * 2, (128256 * 4096 + 4096) * 2
    assert (emb, head) == (1_050_673_152, 1_050_681_344)
    head_gathers = [(c.phase, c.calls) for c in p.collectives if c.op is Op.ALL_GATHER and c.bytes_per_call == head]
    assert sorted(head_gathers, key=str) == [(Phase.BACKWARD, 1), (Phase.FORWARD, 1), (Phase.FORWARD, 1)]
    assert bytes_at(p, 1) == 65_292_772_244  # 65.3 GB
    assert bytes_at(p, 0) == bytes_at(p, 1) - head + 16  # step 0: one head gather; the metrics (log step 1)
    explained(p)
    names = {r.name for r in p.residuals}
    assert names == {"chunked loss re-gathers [norm, lm_head]", "mixed precision"}


def test_llama3_70b_fsdp_and_tp_on_64_ranks() -> None:
    """llama3_70b (local batch 8, s = 8192, full AC, TP 8 with sequence parallelism) on d = 8 x t = 8:
    482 all-gathers and 482 reduce-scatters of the 1 GiB activation (8 * 8192 * 8192 bf16) a step,
    1.106 TB a rank a step; Eqs. 3 and 5 exact after named terms."""
    par = "scheme: fsdp, dp: 8, tp: 8, sequence_parallel: true, micro_batch: 8, activation_checkpointing: true"
    p = predict(scenario(par, "config: llama3_70b, activation_checkpoint: full", "preset: llama3-70B, dtype: fp32"))
    act = 8 * 8192 * 8192 * 2
    assert act == 1 << 30
    tp = [c for c in p.collectives if c.axis == "tp" and c.bytes_per_call == act]
    assert sum(c.calls for c in tp if c.op is Op.ALL_GATHER) == sum(c.calls for c in tp if c.op is Op.REDUCE_SCATTER)
    assert sum(c.calls for c in tp if c.op is Op.ALL_GATHER) == 482
    assert bytes_at(p, 1) == 1_105_916_170_656  # 1.106 TB
    explained(p)
    assert {c.term.equation for c in p.comparison()} == {"Eq. 3", "Eq. 5"}
    # the grad-norm all-reduce once per mesh dimension: 7 tensors a layer, embedding, norm, head
    norms = [c for c in p.collectives if c.phase is Phase.OPTIMIZER and c.op is Op.ALL_REDUCE and c.dtype == "fp32"]
    assert sorted(c.axis for c in norms if c.elements == 7 * 80 + 3) == ["dp", "tp"]


@pytest.mark.parametrize(
    ("block", "par", "names"),
    [
        ("fsdp_reshard_after_forward: never", "activation_checkpointing: false", {"fsdp_reshard_after_forward never"}),
        ("fsdp_reshard_after_forward: always", "activation_checkpointing: false", set()),
        ("loss: cross_entropy", "activation_checkpointing: false", {"[norm, lm_head] kept gathered for the backward"}),
        ("mixed_precision_param: float32", "activation_checkpointing: false", set()),
    ],
)
def test_eq_3_is_explained_under_every_policy_and_loss(block: str, par: str, names: set[str]) -> None:
    p = predict(scenario(f"scheme: fsdp, dp: 8, {par}", block, LLAMA3_8B))
    explained(p)
    got = {r.name for r in p.residuals} - {
        "chunked loss re-gathers [norm, lm_head]",
        "mixed precision",
        "dim-0 padding",
    }
    assert got == names


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_eq_5_counts_what_each_checkpointing_mode_recomputes(ac: str) -> None:
    """Eq. 5 assumes 6 all-reduces a layer (2 of them recomputed); torchtitan's TP with sequence parallelism
    sends 8 all-gather or reduce-scatter units a layer without recomputation, 10 with selective (its
    all-gathers), 12 with full checkpointing: Eq. 5's count in all-reduce halves."""
    on = ac != "none"
    block = f"activation_checkpoint: {ac}" if on else ""
    par = f"scheme: tp, dp: 1, tp: 2, sequence_parallel: true, activation_checkpointing: {str(on).lower()}"
    p = predict(scenario(par, block, TINY_TP))
    explained(p)
    recompute = [r for r in p.residuals if r.name.startswith("recomputation")]
    assert (len(recompute) == 0) == (ac == "full")
    units = sum(c.calls for c in p.collectives if c.paper_term == "Eq. 5")
    assert units == 8 * 2 + 2 + {"none": 0, "selective": 4, "full": 8}[ac]


def test_the_metrics_follow_log_freq() -> None:
    """log_freq 2: torchtitan logs at its steps 1, 2, 4 (commgate's 0, 1, 3): three all-reduces each."""
    p = predict(scenario("scheme: fsdp, dp: 2", "log_freq: 2", steps=3))
    metrics = [c for c in p.collectives if c.source.startswith("metrics")]
    assert sorted({c.at_step for c in metrics if c.once}) == [0, 1, 3]
    assert all(c.once for c in metrics)


def test_left_off_is_named_in_every_prediction_and_run() -> None:
    s = scenario("scheme: fsdp, dp: 2", "left_off: [compile, float8]")
    assert [w.split(":")[0] for w in s.warnings if w.startswith("torchtitan")] == [
        "torchtitan.left_off compile",
        "torchtitan.left_off float8",
    ]


FSDP, TP = "scheme: fsdp, dp: 2", "scheme: tp, dp: 1, tp: 2, sequence_parallel: true"
REFUSED = [
    (
        "scheme: cp, cp: 2, pp: 2, micro_batches: 2, pipeline: {engine: torch, schedule: gpipe}",
        "",
        TINY,
        r"parallelism.cp: 2: torchtitan's context parallelism is modelled with FSDP2 over dp x cp and TP inside",
    ),
    ("scheme: cp, cp: 4", "", TINY, r"model.s: 256: flex attention under context parallelism needs s divisible"),
    (
        "scheme: fsdp, dp: 2, dp_replicate: 2, cp: 2",
        "",
        TINY,
        r"parallelism.dp_replicate: 2: HSDP with context parallelism is not modelled yet",
    ),
    (FSDP + ", fsdp: {param_dtype: bf16}", "", TINY, r"parallelism.fsdp: torchtitan's FSDP2 options"),
    (TP.replace("dp: 1", "dp: 2"), "", TINY_TP, r"parallelism.dp: 2: torchtitan shards .* scheme 'fsdp'"),
    ("scheme: ddp, dp: 2", "", TINY, r"'ddp': trainer 'torchtitan' runs schemes fsdp, tp"),
    (TP.replace("true", "false"), "", TINY_TP, r"sequence_parallel: false: torchtitan's TP without sequence"),
    (TP, "left_off: [float8]", TINY_TP, r"torchtitan.left_off: float8 with tensor"),
    (
        FSDP,
        "gradient_accumulation_steps: 2",
        TINY,
        r"torchtitan.gradient_accumulation_steps: 2: without a pipeline torchtitan's accumulation steps are "
        r"parallelism.micro_batches",
    ),
    (
        FSDP,
        "activation_checkpoint: full",
        TINY,
        r"activation_checkpoint: full: parallelism.activation_checkpointing is",
    ),
    (FSDP, "loss_chunks: 3", TINY, r"model.s: 256: ChunkedLossWrapper splits the sequence into loss_chunks=3"),
    (FSDP, "", TINY.replace("V: 385", "V: 256"), r"model.V: 256: a torchtitan run reads text through a byte-level"),
    (FSDP, "", "preset: 19M-cpu", r"model.architecture: 'gpt-neox': torchtitan's llama3 model"),
    (FSDP, "", "preset: llama3-8B", r"model.dtype: 'bf16': torchtitan trains fp32 parameters"),
    (
        FSDP,
        "args: ['--training.seq_len', '512']",
        TINY,
        r"args\[0\]: '--training.seq_len': .* given by model.s; remove",
    ),
    (FSDP, "args: ['--compile.enable']", TINY, r"args\[0\]: '--compile.enable': compile does not run on torch 2.13"),
    # a fake backend, a CSV schedule and torchtitan's help ran, or ran as another job, unsaid (an adversarial pass)
    (
        FSDP,
        "args: ['--comm.mode', 'fake_backend']",
        TINY,
        r"args\[0\]: '--comm.mode': the gate's ranks run on commgate",
    ),
    (PP, "args: ['--parallelism.pipeline_parallel_schedule_csv', 's.csv']", TINY, r"a schedule read from a CSV"),
    (FSDP, "args: ['-h']", TINY, r"args\[0\]: '-h': torchtitan's help is not a job"),
    (FSDP, "args: ['--help']", TINY, r"args\[0\]: '--help': torchtitan's help is not a job"),
    # checkpoints and validation ran as nothing (the gate steps train_step), or failed on DCP's unmodelled gathers;
    # torchtitan's determinism compiled flex attention again, and every rank died of it (an adversarial pass)
    (FSDP, "args: ['--checkpoint.enable']", TINY, r"args\[0\]: '--checkpoint.enable': checkpoints are not modelled"),
    (FSDP, "args: ['--validator.enable']", TINY, r"args\[0\]: '--validator.enable': validation is not modelled"),
    (FSDP, "args: ['--debug.deterministic']", TINY, r"set_determinism compiles flex attention again"),
    (
        FSDP,
        "args: ['--training.steps', '1']",
        TINY,
        r"args\[0\]: '--training.steps': the job's 1 step\(s\), fewer than the 3",
    ),
    (FSDP, "args: ['--training.steps=2']", TINY, r"the job's 2 step\(s\), fewer than the 3 the gate runs"),
    (FSDP, "args: ['--parallelism.no-enable-sequence-parallel']", TINY, r"given by parallelism.sequence_parallel"),
    (FSDP, "args: [activation-checkpoint:full]", TINY, r"activation-checkpoint is given by parallelism.activation_che"),
    (FSDP, "args: ['--parallelism.pipeline_parallel_degree=2']", TINY, r"given by parallelism.pp"),
    (
        PP.replace("pp: 2", "pp: 2, dp: 2").replace("scheme: pp", "scheme: fsdp").replace("1f1b", "interleaved-1f1b"),
        "",
        TINY.replace("L: 2", "L: 4"),
        r"virtual_stages: 1: an interleaved schedule needs virtual_stages >= 2",
    ),
    (
        PP.replace("pp: 2", "pp: 2, dp: 2, tp: 2, sequence_parallel: true")
        .replace("scheme: pp", "scheme: fsdp")
        .replace("1f1b", "interleaved-1f1b, virtual_stages: 2"),
        "",
        TINY_TP.replace("L: 2", "L: 4"),
        r"interleaved-1f1b: torchtitan's 3-D under an interleaved schedule aborts on torch 2.13's CPU gloo",
    ),
    (
        PP,
        "loss_chunks: 1",
        TINY,
        r"torchtitan.loss_chunks: 1: torchtitan itself fails this job: under a pipeline whose last stage runs",
    ),
    (
        PP.replace("pp: 2", "pp: 4"),
        "",
        TINY.replace("L: 2", "L: 1"),
        r"parallelism.pp: 4: torchtitan splits L \+ 2 = 3 units .* refuses an empty one",
    ),
    (
        PP,
        "args: ['--parallelism.pipeline_parallel_layers_per_stage', '1']",
        TINY,
        r"pipeline_parallel_layers_per_stage': the model holds torchtitan's default split",
    ),
    (
        PP.replace("1f1b", "zero-bubble, virtual_stages: 2").replace(
            "scheme: pp", "scheme: pp, activation_checkpointing: true"
        ),
        "",
        TINY.replace("L: 2", "L: 4"),
        r"activation_checkpointing: true: torchtitan itself fails this job: InterleavedZeroBubble runs each backward",
    ),
    (PP, "", TINY + ", tied_embeddings: true", r"model.tied_embeddings: true: torchtitan refuses weight tying under"),
    (
        "scheme: fsdp, dp: 2, tp: 2, sequence_parallel: true",
        "",
        TINY_TP + ", tied_embeddings: true",
        r"model.tied_embeddings: true: with FSDP2 over dp and TP, the tied group's all-gather carries",
    ),
    (FSDP, "left_off: [compile, compile]", TINY, r"torchtitan.left_off: .* has duplicate items"),
    (FSDP, "flavor: tiny", TINY, r"torchtitan.flavor: unknown field 'flavor'"),
]


@pytest.mark.parametrize(("par", "block", "model", "message"), REFUSED)
def test_what_torchtitan_refuses_is_one_line_naming_the_key(par: str, block: str, model: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as err:
        scenario(par, block, model)
    assert all("\n" not in str(p) for p in err.value.problems)


def test_a_config_or_model_package_torchtitan_does_not_have_is_refused_at_load() -> None:
    """Read off the registry's source without importing it; before, validate and predict passed and the run
    failed in torchtitan's ConfigManager after its ranks started (found by an adversarial pass)."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed: pip install 'commgate[torchtitan]'")
    with pytest.raises(
        ScenarioError,
        match=r"torchtitan.config: 'llama3_debugmodle': torchtitan.models.llama3.config_"
        r"registry \(.*config_registry.py\) has no such function; did you mean 'llama3_debugmodel'\?",
    ):
        scenario(FSDP, "config: llama3_debugmodle")
    with pytest.raises(
        ScenarioError,
        match=r"torchtitan.module: 'llama4x': torchtitan has no such model package; did "
        r"you mean 'llama3'\? its models: .*llama3",
    ):
        scenario(FSDP, "module: llama4x")
    # another of torchtitan's model packages ran into the ranks' refusal after their start-up (an adversarial pass)
    with pytest.raises(ScenarioError, match=r"torchtitan.module: 'qwen3': torchtitan's qwen3 model package; commgate"):
        scenario(FSDP, "module: qwen3, config: qwen3_debugmodel")
    assert scenario(FSDP, "config: llama3_debugmodel_ce_loss, loss: cross_entropy").trainer_config["config"] == (
        "llama3_debugmodel_ce_loss"
    )


def test_an_emulated_torchtitan_run_is_refused() -> None:
    with pytest.raises(ScenarioError, match=r"\$.emulate: true: torchtitan's ranks all run"):
        scenario(FSDP, extra="emulate: true\n")


def test_what_passes_through_args() -> None:
    """torchtitan's own keys the scenario does not give pass (the optimizer's), and so does turning off
    what does not run here."""
    s = scenario("scheme: fsdp, dp: 2", "args: ['--optimizer.lr', '1e-4', '--compile.no-enable']")
    assert s.trainer_config["args"] == ["--optimizer.lr", "1e-4", "--compile.no-enable"]


# ----------------------------------------------------------------------------------------- upstream


@pytest.fixture(scope="module")
def tt() -> Iterator[Any]:
    """torchtitan imported as the adapter imports it (P2 where triton is absent, P1 on this CPU torch); the
    adapter module. Skipped with the reason where torchtitan is not installed."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install 'commgate[torchtitan]')")
    from commgate.run.trainers import torchtitan as adapter

    adapter.without_triton()
    adapter.device_type("cpu")
    with warnings.catch_warnings():  # torchtitan's imports warn (deprecations of torch and its dependencies)
        warnings.simplefilter("ignore")
        for module in ("torchtitan.trainer", "torchtitan.config", "torchtitan.models.llama3.config_registry"):
            importlib.import_module(module)
    yield adapter


def source(module: str) -> str:
    """A module's source file as installed (found by path: the adapter may stand in for the module)."""
    top, *parts = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin is not None, top
    path = Path(spec.origin).parent.joinpath(*parts)
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text(encoding="utf-8")


def test_p1_torchtitan_falls_back_to_cuda_on_a_cpu_torch(tt: Any) -> None:
    """tools/utils.py:54-60: ``device_type = _get_available_device_type() or "cuda"`` at import."""
    import torch._utils as tu
    import torchtitan.tools.utils as utils

    assert tu._get_available_device_type() is None, "torch reports a CPU device type now: P1 may be dropped"
    assert '_get_available_device_type() or "cuda"' in inspect.getsource(utils.get_device_info)
    assert utils.device_type == "cpu" and utils.device_module.get_device_name() == "cpu"  # P1 took effect
    assert tu._get_available_device_type() is None  # and torch's probe is restored


def test_p1_the_cpu_device_module_still_answers_what_torchtitan_calls(tt: Any) -> None:
    """components/metrics.py:39-50, 62, 92: CUDA memory calls on the device module, which torch.cpu lacks."""
    import torch

    metrics = source("torchtitan.components.metrics")
    for call in tt.CPU_CALLS:
        assert f"device_module.{call}(" in metrics, f"torchtitan no longer calls {call}: drop it from the shim"
        assert not hasattr(torch.cpu, call), f"torch.cpu.{call} exists now: the shim may drop it"
        getattr(tt.CpuDeviceModule("x"), call)()


def test_p2_triton_is_imported_on_the_trainers_path_and_the_stand_in_covers_it(tt: Any) -> None:
    """distributed/minimal_async_ep/kernels.py:10 ``import triton``, reached from trainer.py:55; the
    stand-in defines exactly the names api.py imports from it."""
    assert "\nimport triton\n" in source("torchtitan.distributed.minimal_async_ep.kernels")
    assert "minimal_async_ep" in source("torchtitan.models.common.token_dispatcher")
    tree = ast.parse(source("torchtitan.distributed.minimal_async_ep.api"))
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == tt.EP_KERNELS_MODULE
        for a in n.names
    }
    assert imported == set(tt.EP_KERNELS)
    import torchtitan.trainer  # noqa: F401  (imports with the stand-in, or with triton where installed)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_p3_flex_attention_refuses_a_cpu_backward_and_the_eager_one_is_right(
    tt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch nn/attention/flex_attention.py:2075-2083 refuses CPU inputs that need a gradient; with P3 the
    eager operator differentiates on CPU and agrees with SDPA on a causal mask."""
    import torch
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common.attention import FlexAttention

    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        fa._validate_device(q, q, q)
    assert "_compiled_flex_attn" in vars(FlexAttention)
    monkeypatch.setattr(fa, "_validate_device", fa._validate_device)  # restored after the test
    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", FlexAttention._compiled_flex_attn)
    tt.eager_flex_on_cpu()
    k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(2))
    mask = fa.create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    out = FlexAttention._compiled_flex_attn(q, k, v, block_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-5) and all(
        torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, ref_grads, strict=True)
    )


def test_p4_torchtitan_divides_by_one_which_selects_premul_sum_which_gloo_lacks(tt: Any) -> None:
    """distributed/fsdp.py:27-41 sets gradient_divide_factor 1.0; torch's _fsdp_collectives.py:840-851 then
    reduces fp32 with PREMUL_SUM(1.0); gloo refuses it; FSDP2 still offers the forced SUM P4 sets."""
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    from torch.distributed.fsdp import FSDPModule

    _, _, reduce_op, _ = fc._get_gradient_divide_factors(None, None, torch.float32, "cpu", 1.0, False)
    assert "PREMUL" in str(reduce_op) or not isinstance(reduce_op, dist.ReduceOp.RedOpType)
    assert "set_gradient_divide_factor(1.0)" in source("torchtitan.distributed.fsdp")
    assert "disable_fsdp_gradient_division(model)" in source("torchtitan.distributed.fsdp")  # a module global
    store = dist.FileStore(tempfile.mktemp(), 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(1.0)
    with pytest.raises(Exception, match="PREMUL_SUM"):
        gloo._reduce_scatter_base(torch.zeros(4), torch.zeros(4), opts).wait()
    assert hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def test_p5_set_pg_timeouts_needs_what_torch_2_13_lacks_and_the_gate_never_calls_it(tt: Any) -> None:
    """distributed/utils.py:586 ``barrier(device_ids=[device_module.current_device()])``, :595
    ``torch.distributed.set_timeout``; called by Trainer.train() only (trainer.py:1061-1067)."""
    import torch.distributed as dist
    import torchtitan.distributed.utils as utils
    from torchtitan.trainer import Trainer

    src = inspect.getsource(utils.set_pg_timeouts)
    assert "device_ids=[device_module.current_device()]" in src and "set_timeout(" in src
    assert not hasattr(dist, "set_timeout"), "torch.distributed.set_timeout exists now"
    assert "set_pg_timeouts" in inspect.getsource(Trainer.train)
    assert "set_pg_timeouts" not in inspect.getsource(Trainer.train_step)


def test_p6_the_block_mask_is_compiled_at_import(tt: Any) -> None:
    """models/common/attention.py:622 ``_compiled_create_block_mask = torch.compile(create_block_mask)``."""
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    assert "_compiled_create_block_mask = torch.compile(create_block_mask" in source(
        "torchtitan.models.common.attention"
    )
    assert attention._compiled_create_block_mask is not create_block_mask


def test_init_distributed_reuses_an_initialised_group(tt: Any) -> None:
    """distributed/utils.py:466-472: commgate's default group is torchtitan's."""
    import torchtitan.distributed.utils as utils

    src = inspect.getsource(utils.init_distributed)
    assert "if torch.distributed.is_initialized():" in src and "return torch.distributed.get_world_size()" in src


def test_the_default_spmd_backend_still_fails_in_torch_2_13s_fully_shard(tt: Any) -> None:
    """configs.py: spmd_backend "spmd_types" by default; fsdp.py:195 passes dp_mesh_dims, which torch 2.13's
    _fsdp_param.py refuses for plain tensors: the adapter sets partial_dtensor."""
    from torchtitan.config import ParallelismConfig

    assert ParallelismConfig().spmd_backend == "spmd_types"
    assert "When dp_mesh_dims is provided" in source("torch.distributed.fsdp._fully_shard._fsdp_param")


def test_p7_torchtitan_steps_its_pipeline_with_micro_batches_torch_2_13_does_not_take(tt: Any) -> None:
    """trainer.py:856-863 calls pp_schedule.step(arg_mbs=...); torch 2.13's schedules take step(*args) and
    split a whole batch. The shim repeats what their step does after the split: when either changes, this
    fails (no longer needed, or no longer the same steps)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    assert "arg_mbs=arg_mbs" in source("torchtitan.trainer")
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        assert "arg_mbs" not in inspect.signature(cls.step).parameters
        body = inspect.getsource(cls.step)
        assert "clear_runtime_states()" in body and "self._step_microbatches(" in body
        assert "has_backward = self._has_backward" in body


def test_p8_torchtitans_cpu_offload_pins_host_memory_which_a_cpu_torch_refuses(tt: Any) -> None:
    """distributed/fsdp.py:173-174 builds CPUOffloadPolicy() (pin_memory=True by default), _fsdp_param.py pins
    each shard, and a torch without an accelerator refuses to pin: P8 builds torchtitan's policy with
    FSDP2's own pin_memory=False."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert 'fsdp_config["offload_policy"] = CPUOffloadPolicy()' in source("torchtitan.distributed.fsdp")
    assert CPUOffloadPolicy().pin_memory and not CPUOffloadPolicy(pin_memory=False).pin_memory
    assert "local_tensor.cpu().pin_memory()" in source("torch.distributed.fsdp._fully_shard._fsdp_param")
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError, match="accelerator"):
            torch.empty(1).pin_memory()


def test_the_lost_norm_gradient_under_zero_bubble_is_said_where_it_happens() -> None:
    """Zero-bubble with FSDP2 over dp > 1 and the chunked loss loses the final norm's gradient (measured):
    every prediction and run of such a job says so; with plain cross-entropy, or one data rank, nothing."""
    from commgate.model.trainers.torchtitan import NORM_GRAD_LOST

    par = PP.replace("pp: 2", "pp: 2, dp: 2").replace("scheme: pp", "scheme: fsdp")
    par = par.replace("1f1b", "zero-bubble, virtual_stages: 2")
    assert NORM_GRAD_LOST in scenario(par).warnings
    assert NORM_GRAD_LOST not in scenario(par, "config: llama3_debugmodel_ce_loss, loss: cross_entropy").warnings
    assert NORM_GRAD_LOST not in scenario(PP.replace("1f1b", "zero-bubble, virtual_stages: 2")).warnings
    p = predict(scenario(par))
    assert not [c for c in p.collectives if c.source.startswith("FSDP2 gradient reduce-scatter") and "norm" in c.source]


def test_interleaved_1f1b_order_is_torchs_own(tt: Any) -> None:
    """The order FSDP2 is replayed over under interleaving comes from torch's ScheduleInterleaved1F1B, which
    computes it from four numbers alone: each stage runs each micro-batch's forward before its backward, in
    micro-batch order, and the first stage of rank 0 all its warm-up forwards first."""
    from commgate.model.schemes.fsdp import interleaved_order

    for p, v, m in ((2, 2, 4), (2, 2, 3), (4, 2, 8), (2, 3, 6)):
        for stage in range(p * v):
            order = interleaved_order("interleaved-1f1b", p, v, m, stage)
            assert sorted(order) == ["B"] * m + ["F"] * m, (p, v, m, stage, order)
            assert all(order[: i + 1].count("F") >= order[: i + 1].count("B") for i in range(2 * m))
    assert interleaved_order("interleaved-1f1b", 2, 2, 4, 3) == "FBFBFBFB"  # the last: B right after each F
    zb = interleaved_order("zero-bubble", 2, 2, 4, 0)  # the backward split: each I before its W
    assert sorted(zb) == ["F"] * 4 + ["I"] * 4 + ["W"] * 4 and zb.index("I") < zb.index("W")


def test_the_model_splits_the_stages_as_torchtitan_does(tt: Any) -> None:
    """``stages`` against torchtitan's own ``_generate_llm_fqn_per_model_part`` (its default weights), for
    every split it accepts up to 8 stages and 40 blocks."""
    from commgate.model.trainers.torchtitan import stages
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part as split

    checked = 0
    for n in range(1, 9):
        for L in range(1, 41):
            try:
                theirs = split(n, L, 1, 1)
            except ValueError:
                continue
            held = [("tok_embeddings" in m, sum(x.startswith("layers.") for x in m), "lm_head" in m) for m in theirs]
            assert [(st.embedding, st.layers, st.head) for st in stages(n, L)] == held, (n, L)
            checked += 1
    assert checked > 250


@pytest.mark.parametrize(
    ("order", "replay"),
    [("FBFBFBFB", (5, 4, 1, 3)), ("FFFBBB", (6, 1, 3, 0)), ("FFBFBB", (5, 2, 2, 1))],
    ids=["1f1b-last-stage", "gpipe", "1f1b-stage-0-of-2"],
)
def test_the_head_group_replay_under_the_chunked_loss(order: str, replay: tuple[int, int, int, int]) -> None:
    """(forward gathers, backward gathers, lm_head-alone reduce-scatters, lm_head+norm ones) per step; the
    first two as measured on the last stage (1F1B and GPipe, 4 ranks), the third worked by hand."""
    from commgate.model.trainers.torchtitan import head_replay

    r = head_replay(order)
    assert (r.forward, r.backward, r.head_alone, r.head_and_norm) == replay


def test_the_pipeline_keeps_fsdp_gathered_by_default_and_reduces_after_the_last_backward(tt: Any) -> None:
    """What the pipelined FSDP2 model assumes: torchtitan's default policy keeps groups gathered under a
    pipeline, and torch's stage turns resharding after backward and gradient sync off, then reduces
    once in ``perform_reduce_grad``."""
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy as policy

    assert policy("default", True) is False and policy("default", False) is True and policy("always", True)
    stage = source("torch.distributed.pipelining.stage")
    for line in (
        "self.submod.set_reshard_after_backward(False)",
        "self.submod.set_requires_gradient_sync(False)",
        "def perform_reduce_grad(",
        "fsdp_param_group.post_backward()",
    ):
        assert line in stage, line


def test_model_assumption_the_chunked_loss_reshards_the_head_group(tt: Any) -> None:
    """components/loss.py:728-772, the model's extra head-group gathers and split reduce-scatters."""
    src = source("torchtitan.components.loss")
    for line in (
        "lm_head.set_reshard_after_forward(False)",
        "lm_head.unshard()",
        "lm_head.set_requires_gradient_sync(False, recurse=False)",
        "lm_head.set_reshard_after_forward(True)",
        "lm_head.reshard()",
    ):
        assert line in src, line


def test_model_assumption_the_fsdp_groups(tt: Any) -> None:
    """distributed/fsdp.py: tok_embeddings alone, [norm, lm_head] (resharded only under "always"), each
    block, then the root."""
    src = source("torchtitan.distributed.fsdp")
    assert "model.tok_embeddings,\n" in src and "[model.norm, model.lm_head]" in src
    assert 'reshard_after_forward=reshard_after_forward_policy == "always"' in src
    assert "fully_shard(model, **fsdp_config)" in src


def test_model_assumption_selective_ac_saves_reduce_scatters_not_all_gathers(tt: Any) -> None:
    """distributed/activation_checkpoint.py:61-64: the TP all-gathers are recomputed in the backward."""
    src = source("torchtitan.distributed.activation_checkpoint")
    assert "torch.ops._c10d_functional.reduce_scatter_tensor.default" in src
    assert "all_gather_into_tensor" not in src


# ------------------------------------------------------------------------------------ the adapter


def test_the_adapter_builds_the_scenarios_job_through_torchtitans_config_manager(tt: Any, tmp_path: Path) -> None:
    """The scenario's overrides parse, the reduced model of its dimensions replaces the config's (the
    config's RoPE kept), and a config that runs another loss than the scenario's stops in one line."""
    from commgate.model.trainers.torchtitan import Job

    s = scenario("scheme: fsdp, dp: 2, micro_batch: 2, activation_checkpointing: true")
    job = Job.of(s)
    argv = tt.overrides(s, job, tokenizer=tmp_path, data=tmp_path, dump=tmp_path)
    config = tt.parse(s, job, argv)
    tt.check_config(config, s, job)
    own = config.model_spec.model
    assert tt.model_dims(own)["h"] == 256  # llama3_debugmodel's
    tt.with_scenario_model(config, s, job)
    assert tt.model_dims(config.model_spec.model) == tt.scenario_dims(s.model)
    assert config.model_spec.model.layers[0].attention.rope.theta == own.layers[0].attention.rope.theta
    assert config.loss.loss_fn.global_vocab_size == 385
    ce = Job.from_block({"config": "llama3_debugmodel_ce_loss", "log_freq": 1})
    config = tt.parse(s, ce, tt.overrides(s, ce, tokenizer=tmp_path, data=tmp_path, dump=tmp_path))
    with pytest.raises(CommgateError, match=r"runs loss cross_entropy, the scenario describes torchtitan.loss: chu"):
        tt.check_config(config, s, job)
    bad = Job.from_block({"config": "no_such_config"})
    with pytest.raises(CommgateError, match=r"torchtitan could not build config llama3:no_such_config"):
        tt.parse(s, bad, tt.overrides(s, bad, tokenizer=tmp_path, data=tmp_path, dump=tmp_path))
    # an override torchtitan's parser refuses: its words, not "SystemExit: 2" alone (found by an adversarial pass)
    typo = Job.from_block({"config": "llama3_debugmodel", "args": ["--optimizer.lrr", "1e-4"]})
    with pytest.raises(CommgateError, match=r"SystemExit: 2: Unrecognized options: --optimizer.lrr, 1e-4$"):
        tt.parse(s, typo, tt.overrides(s, typo, tokenizer=tmp_path, data=tmp_path, dump=tmp_path))
    # the docs' example of an override (theirs, --optimizer.lr, was one torchtitan 0.3.0 refuses: an adversarial pass)
    clip = Job.from_block({"config": "llama3_debugmodel", "args": ["--training.max-norm", "0.5"]})
    assert (
        tt.parse(s, clip, tt.overrides(s, clip, tokenizer=tmp_path, data=tmp_path, dump=tmp_path)).training.max_norm
        == 0.5
    )


def test_a_compiled_config_runs_only_with_compile_left_off(tt: Any, tmp_path: Path) -> None:
    from commgate.model.trainers.torchtitan import Job

    s = scenario("scheme: fsdp, dp: 2")
    job = Job.from_block({"log_freq": 1})
    config = tt.parse(s, job, tt.overrides(s, job, tokenizer=tmp_path, data=tmp_path, dump=tmp_path))
    config.compile.enable = True  # as llama3_405b's config function sets it
    with pytest.raises(CommgateError, match=r"compiles its blocks .* list compile in torchtitan.left_off"):
        tt.leave_off(config, job)
    tt.leave_off(config, Job.from_block({"left_off": ["compile"]}))
    assert config.compile.enable is False


# -------------------------------------------------------------------------------------- real runs


def run_and_reconcile(s: Scenario, workdir: Path) -> None:
    from commgate.judge.reconcile import reconcile
    from commgate.run.launcher import launch_local
    from commgate.run.workloads import skip_reason

    assert skip_reason(s, gpus=False) is None
    p = predict(s)
    rec = reconcile(p, launch_local(s, workdir=workdir))
    assert not rec.mismatches, [k.label for k in rec.mismatches]
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted
    explained(p)


@pytest.mark.parametrize(
    ("par", "block"),
    [
        ("activation_checkpointing: true", "log_freq: 1"),
        (
            "activation_checkpointing: true",
            "log_freq: 2, activation_checkpoint: full, fsdp_reshard_after_forward: never",
        ),
        ("activation_checkpointing: false", "log_freq: 1, fsdp_reshard_after_forward: always"),
        ("activation_checkpointing: false", "config: llama3_debugmodel_ce_loss, loss: cross_entropy, log_freq: 1"),
        ("activation_checkpointing: true", "log_freq: 1, cpu_offload: true"),
    ],
    ids=["selective", "full-never-log2", "always", "cross-entropy", "cpu-offload"],
)
def test_fsdp2_on_2_ranks_reconciles(tt: Any, par: str, block: str, tmp_path: Path) -> None:
    run_and_reconcile(scenario(f"scheme: fsdp, dp: 2, micro_batch: 2, {par}", block, steps=3), tmp_path)


@pytest.mark.parametrize(
    ("par", "block"),
    [
        ("scheme: fsdp, dp: 2, activation_checkpointing: true", "log_freq: 1"),
        (
            "scheme: fsdp, dp: 2, activation_checkpointing: false",
            "config: llama3_debugmodel_ce_loss, loss: cross_entropy, log_freq: 2, fsdp_reshard_after_forward: never",
        ),
        ("scheme: tp, dp: 1, tp: 2, sequence_parallel: true, activation_checkpointing: true", "log_freq: 1"),
    ],
    ids=["fsdp-chunked", "fsdp-ce-never", "tp-sp"],
)
def test_a_tied_llama3_reconciles(tt: Any, par: str, block: str, tmp_path: Path) -> None:
    """Llama 3.2's tying (the 1B and 3B flavors): torchtitan shards the shared weight with norm and the head
    as one [tok_embeddings, norm, lm_head] group (fsdp.py:180-192); under the chunked loss the weight's
    gradient is reduce-scattered twice (at the loss, then with the embedding's), a named term of Eq. 3."""
    s = scenario(f"{par}, micro_batch: 1", block, TINY_TP + ", tied_embeddings: true")
    names = {r.name for r in predict(s).residuals}
    assert ("tied weight reduce-scattered twice" in names) == ("cross_entropy" not in block and "fsdp" in par)
    run_and_reconcile(s, tmp_path)


@pytest.mark.parametrize(
    ("replicas", "block"),
    [(2, "log_freq: 1"), (2, "log_freq: 2, fsdp_reshard_after_forward: always, loss: cross_entropy, "
     "config: llama3_debugmodel_ce_loss")],
    ids=["chunked", "always-ce-log2"],
)  # fmt: skip
def test_hsdp_replicas_of_fsdp2_reconcile(tt: Any, replicas: int, block: str, tmp_path: Path) -> None:
    """HSDP (data_parallel_replicate_degree 2 x data_parallel_shard_degree 2): each reduce-scattered shard
    all-reduced across the replicas, the token count and the metrics over all four ranks, the gradient
    norm over the sharding group alone."""
    par = f"scheme: fsdp, dp: 2, dp_replicate: {replicas}, micro_batch: 1, activation_checkpointing: true"
    s = scenario(par, block)
    p = predict(s)
    assert any(c.op == Op.ALL_REDUCE and c.axis == "rep" for c in p.collectives)
    run_and_reconcile(s, tmp_path)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_tp_with_sequence_parallelism_on_2_ranks_reconciles(tt: Any, ac: str, tmp_path: Path) -> None:
    par = "scheme: tp, dp: 1, tp: 2, sequence_parallel: true, micro_batch: 2, activation_checkpointing: true"
    run_and_reconcile(scenario(par, f"log_freq: 1, activation_checkpoint: {ac}", TINY_TP), tmp_path)


@pytest.mark.parametrize(
    ("schedule", "layers", "pp"),
    [
        ("1f1b", 2, 2),
        ("gpipe", 4, 2),
        ("interleaved-1f1b, virtual_stages: 2", 4, 2),
        ("1f1b", 4, 4),
        ("zero-bubble, virtual_stages: 2", 3, 2),
    ],
    ids=["1f1b", "gpipe", "interleaved", "pp4", "zero-bubble-L3"],
)
def test_pipeline_on_torchtitans_own_step_reconciles(
    tt: Any, schedule: str, layers: int, pp: int, tmp_path: Path
) -> None:
    """torchtitan's own split and train step, through P7, under each schedule torchtitan names."""
    par = PP.replace("1f1b", schedule).replace("pp: 2", f"pp: {pp}")
    run_and_reconcile(scenario(par, "log_freq: 1", TINY_TP.replace("L: 2", f"L: {layers}")), tmp_path)


@pytest.mark.parametrize(
    ("schedule", "m", "block", "pp", "layers"),
    [
        ("1f1b", 4, "log_freq: 1", 2, 2),
        ("gpipe", 3, "log_freq: 1, fsdp_reshard_after_forward: always", 2, 3),
        ("1f1b", 2, "config: llama3_debugmodel_ce_loss, loss: cross_entropy, log_freq: 2", 2, 4),
        ("1f1b", 5, "log_freq: 1", 4, 3),
        ("interleaved-1f1b, virtual_stages: 2", 6, "log_freq: 1, fsdp_reshard_after_forward: always", 2, 3),
        ("zero-bubble, virtual_stages: 2", 4, "log_freq: 1, activation_checkpoint: full", 2, 3),
        (
            "zero-bubble, virtual_stages: 2",
            2,
            "activation_checkpoint: full, config: llama3_debugmodel_ce_loss, loss: cross_entropy",
            2,
            2,
        ),
        ("1f1b", 2, "log_freq: 1, gradient_accumulation_steps: 2", 2, 2),
    ],
    ids=[
        "1f1b",
        "gpipe-always-L3",
        "1f1b-ce",
        "pp4-m5-head-alone",
        "interleaved-m6-always-L3",
        "zero-bubble-norm-grad-lost",
        "zero-bubble-ce",
        "1f1b-accumulated",
    ],
)
def test_pipeline_with_fsdp2_in_each_stage_reconciles(
    tt: Any, schedule: str, m: int, block: str, pp: int, layers: int, tmp_path: Path
) -> None:
    """pp x dp on 4 ranks (8 with pp = 4): each stage's FSDP2 groups over its own data-parallel ranks,
    gathered as the schedule's order leaves them (interleaved: each of a rank's two stages over its own
    order in torch's schedule, checked on the ranks), the last stage's head group per micro-batch by the
    chunked loss; torchtitan's uneven splits (L = 3 on 2 stages; on 4, a last stage of [norm, lm_head]
    alone)."""
    par = (
        f"scheme: fsdp, dp: 2, pp: {pp}, micro_batch: 1, micro_batches: {m}, activation_checkpointing: true, "
        f"pipeline: {{engine: torch, schedule: {schedule}}}"
    )
    run_and_reconcile(scenario(par, block, TINY.replace("L: 2", f"L: {layers}")), tmp_path)


def test_pipeline_with_tp_and_one_data_rank_reconciles(tmp_path: Path, tt: Any) -> None:
    """pp x tp with dp = 1 (scheme 3d): each stage's blocks' TP collectives per micro-batch, the boundaries
    carrying each TP rank's sequence shard, FSDP2 silent on its one-rank mesh (its mixed precision applies)."""
    par = (
        "scheme: 3d, dp: 1, tp: 2, sequence_parallel: true, pp: 2, micro_batch: 1, micro_batches: 3, "
        "activation_checkpointing: true, pipeline: {engine: torch, schedule: gpipe}"
    )
    block = "log_freq: 2, activation_checkpoint: full, config: llama3_debugmodel_ce_loss, loss: cross_entropy"
    run_and_reconcile(scenario(par, block, TINY_TP.replace("L: 2", "L: 3")), tmp_path)


@pytest.mark.parametrize(
    ("schedule", "block"),
    [
        ("1f1b", "log_freq: 1"),
        ("gpipe", "log_freq: 2, activation_checkpoint: full, fsdp_reshard_after_forward: always"),
    ],
    ids=["1f1b-selective", "gpipe-full-always"],
)
def test_torchtitans_3d_reconciles(tt: Any, schedule: str, block: str, tmp_path: Path) -> None:
    """FSDP2 x TP (with SP) x its pipeline on 8 ranks: per stage, its blocks' TP collectives per micro-batch,
    the embedding's on the first stage, the final norm's and the loss-parallel all-reduces on the last; the
    boundaries carry each TP rank's sequence shard; the norms' gradients all-reduced with FSDP2's reduce of
    their group (fp32, at perform_reduce_grad, the final norm's also at each loss that carries it)."""
    par = (
        "scheme: fsdp, dp: 2, tp: 2, sequence_parallel: true, pp: 2, micro_batch: 1, micro_batches: 2, "
        f"activation_checkpointing: true, pipeline: {{engine: torch, schedule: {schedule}}}"
    )
    run_and_reconcile(scenario(par, block, TINY_TP), tmp_path)


@pytest.mark.parametrize(
    ("par", "block", "s"),
    [
        ("cp: 2, activation_checkpointing: true", "log_freq: 1", 256),
        ("cp: 2, activation_checkpointing: false", "log_freq: 2, mixed_precision_param: float32", 256),
        ("cp: 2, activation_checkpointing: true", "log_freq: 1, activation_checkpoint: full", 256),
        ("cp: 4, activation_checkpointing: true", "config: llama3_debugmodel_ce_loss, loss: cross_entropy", 512),
    ],
    ids=["selective", "no-ac-fp32", "full", "cp4-ce"],
)
def test_context_parallelism_on_torchtitans_flex_attention_reconciles(
    tt: Any, par: str, block: str, s: int, tmp_path: Path
) -> None:
    """torchtitan's flex CP: K and V all-gathered per layer, their gradients reduce-scattered, FSDP2 over
    the cp ranks."""
    run_and_reconcile(
        scenario(f"scheme: cp, micro_batch: 2, {par}", block, TINY.replace("s: 256", f"s: {s}")), tmp_path
    )


@pytest.mark.parametrize(
    ("par", "block", "model"),
    [
        ("scheme: tp, tp: 2, sequence_parallel: true, micro_batches: 3", "log_freq: 1", TINY_TP),
        ("scheme: cp, cp: 2, micro_batches: 2", "log_freq: 1, fsdp_reshard_after_forward: always", TINY),
    ],
    ids=["tp-m3", "cp-m2-always"],
)
def test_gradient_accumulation_reconciles(tt: Any, par: str, block: str, model: str, tmp_path: Path) -> None:
    """global_batch_size = m x local x dp: torchtitan's train_step runs m forward-backward passes a step, each
    syncing (TP's sends and the norms' all-reduces, CP's K/V, FSDP2's gathers and reduce-scatters m times; the
    token count, gradient norm and metrics once), from the run's first step."""
    s = scenario(f"{par}, micro_batch: 1, activation_checkpointing: true", block, model)
    run_and_reconcile(replace(s, warmup_steps=0), tmp_path)


def test_context_parallelism_with_fsdp2_over_dp_and_cp_reconciles(tt: Any, tmp_path: Path) -> None:
    """dp 2 x cp 2: FSDP2 over the 4 ranks, K/V over each cp pair, the token count over dp alone (torchtitan's
    batch mesh: one group per context-parallel index)."""
    par = "scheme: cp, cp: 2, dp: 2, micro_batch: 1, activation_checkpointing: true"
    run_and_reconcile(scenario(par, "log_freq: 1", TINY), tmp_path)


def test_context_parallelism_with_tp_inside_reconciles(tt: Any, tmp_path: Path) -> None:
    """cp 2 x tp 2: each TP rank gathers its own K/V heads over the cp ranks; TP moves the rank's s/c
    sequence shard, the loss-parallel all-reduces too (Eq. 5's named term "context-parallel sequence
    shard"); FSDP2 over the cp ranks of each TP rank."""
    par = "scheme: cp, cp: 2, tp: 2, sequence_parallel: true, micro_batch: 1, activation_checkpointing: true"
    run_and_reconcile(scenario(par, "log_freq: 1", TINY_TP), tmp_path)


@pytest.mark.parametrize(
    ("par", "model"),
    [
        ("tp: 2, sequence_parallel: true", TINY_TP),
        ("pp: 2, micro_batches: 2, pipeline: {engine: torch, schedule: 1f1b}", TINY.replace("L: 2", "L: 3")),
    ],
    ids=["hsdp-tp", "hsdp-pp"],
)
def test_hsdp_with_tp_or_its_pipeline_on_8_ranks_reconciles(tt: Any, par: str, model: str, tmp_path: Path) -> None:
    """2 replicas x FSDP2 over 2 x (tp 2, or 2 stages): torchtitan's mesh (pp, dp_replicate, dp_shard, tp);
    each shard's reduce-scatter then all-reduced across the replicas of its TP rank or stage; the token
    count and metrics over every data rank of its TP rank or stage, the gradient norm over its shards."""
    s = f"scheme: fsdp, dp: 2, dp_replicate: 2, {par}, micro_batch: 1, activation_checkpointing: true"
    run_and_reconcile(scenario(s, "log_freq: 1", model), tmp_path)


def test_fsdp2_and_tp_on_4_ranks_reconciles(tt: Any, tmp_path: Path) -> None:
    par = "scheme: fsdp, dp: 2, tp: 2, sequence_parallel: true, micro_batch: 2, activation_checkpointing: true"
    run_and_reconcile(scenario(par, "log_freq: 1", TINY_TP), tmp_path)


def test_a_job_other_than_the_scenarios_stops_the_run_in_one_line(tt: Any, tmp_path: Path) -> None:
    """The config's loss is plain cross-entropy, the scenario says chunked: the ranks stop before training,
    and the launcher reports the rank's one line."""
    from commgate.run.launcher import RunError, launch_local

    s = scenario("scheme: fsdp, dp: 2", "config: llama3_debugmodel_ce_loss, log_freq: 1")
    with pytest.raises(RunError) as err:
        launch_local(s, workdir=tmp_path)
    head = str(err.value).splitlines()[0]
    assert re.match(
        r"tt: rank [01] raised CommgateError: torchtitan config llama3:llama3_debugmodel_ce_loss runs loss "
        r"cross_entropy, the scenario describes torchtitan.loss: chunked: set torchtitan.loss: cross_entropy, or "
        r"take a config that runs chunked",
        head,
    ), head
    assert "Traceback" not in str(err.value)


def test_what_torchtitan_raises_as_it_builds_is_one_line(tt: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan's ``config.build()`` raising (an override naming a CSV schedule that is not there), or its
    ``train_step``, was the rank's traceback (found by an adversarial pass): one line naming the config and the
    overrides, or the step, the traceback in the rank's log; commgate's own one-line errors pass as they are."""
    from commgate.model.trainers.torchtitan import Job

    class Missing:
        def build(self) -> None:
            raise FileNotFoundError("The specified path /x/sched.csv does not exist or is not a file.\nmore")

    class Refused:
        def build(self) -> None:
            raise CommgateError("already one line")

    job = Job.from_block({"config": "llama3_debugmodel", "args": ["--training.max-norm", "0.5"]})
    with pytest.raises(CommgateError) as info:
        tt.build(Missing(), job)
    assert str(info.value) == (
        "torchtitan could not build its trainer from config llama3:llama3_debugmodel with the scenario's overrides "
        "--training.max-norm 0.5: FileNotFoundError: The specified path /x/sched.csv does not exist or is not a "
        "file. (its traceback in the rank's log)"
    )
    assert "Traceback" in capsys.readouterr().err
    with pytest.raises(CommgateError, match=r"^already one line$"):
        tt.build(Refused(), job)

    class Trainer:  # a learning-rate schedule shorter than the run asserting in train_step (torchtitan's own)
        step = 0

        def train_step(self, data: object) -> None:
            raise AssertionError("decay_steps must not be zero to reach this branch")

    workload = object.__new__(tt.TorchtitanWorkload)
    workload.trainer, workload.data = Trainer(), iter(())
    with pytest.raises(CommgateError) as info:
        workload.step(1)
    assert str(info.value) == (
        "torchtitan's train_step (step 1): AssertionError: decay_steps must not be zero to reach this branch (its "
        "traceback in the rank's log)"
    )


def test_a_left_off_entry_is_said_as_a_condition_at_load() -> None:
    """``left_off: [compile, async_tp]`` on a config that enables neither: the warnings said the job compiled its
    blocks and ran async TP, which it does not (found by an adversarial pass); whether it does is known once the
    config is read on the ranks, so load says what the run does where it does."""
    s = scenario("scheme: fsdp, dp: 2", "left_off: [compile, async_tp]")
    said = [w for w in s.warnings if w.startswith("torchtitan.left_off")]
    assert [w.split(", the run leaves it out;")[0] for w in said] == [
        "torchtitan.left_off compile: where the job compiles its blocks (compile.enable)",
        "torchtitan.left_off async_tp: where the job runs async TP (compile.enable_async_tensor_parallel)",
    ]
