"""Emulated ranks (``emulate: true``, ``commgate run --emulate``; ``commgate.run.emulate``): rank 0 runs the
real framework code alone at the declared world size, its peers emulated by an inner backend that completes
every call at once; the capture (rank 0's calls) reconciles with the model's rows rank 0 issues, each call
standing for its group's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commgate.core.errors import ScenarioError
from commgate.judge.baseline import Baseline
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.pipeline import Options, run_scenario
from commgate.run.emulate import EmulatedBackend
from commgate.run.launcher import launch_local
from commgate.run.runners import LocalRanks


def scenario(par: str, model: str = "{preset: 19M-cpu}", extra: str = "emulate: true\n") -> str:
    return f"schema_version: 1\nname: e\nmodel: {model}\nparallelism: {par}\nsteps: 2\n{extra}"


def test_calls_complete_at_once_with_the_peers_holding_what_this_rank_holds() -> None:
    b = EmulatedBackend(rank=2, size=4)
    out = torch.zeros(8)
    work = b._allgather_base(out, out[4:6].fill_(3.0))  # in place: the input is this rank's slot of the output
    assert work.is_completed() and out.tolist() == [3.0] * 8
    (value,) = work.get_future().value()  # what DDP's communication hooks read
    assert value is out
    shard = torch.empty(2)
    b._reduce_scatter_base(shard, torch.arange(8.0))
    assert shard.tolist() == [4.0, 5.0]  # rank 2's slice
    grads = torch.ones(3)
    assert b.allreduce([grads]).get_future().value() == [grads] and grads.tolist() == [1.0] * 3


@pytest.mark.parametrize(
    ("par", "world"),
    [
        ("{scheme: ddp, dp: 1024}", 1024),
        ("{scheme: zero3, dp: 64}", 64),
        ("{scheme: zero++, dp: 64, zero: {hpz: 8}}", 64),
        ("{scheme: zero2, dp: 128, micro_batches: 2}", 128),
        ("{scheme: moe, dp: 64, moe: {experts: 64, ep: 64}}", 64),
        ("{scheme: pp, pp: 2, dp: 32, micro_batches: 4, zero: {stage: 1}}", 64),
        ("{scheme: 3d, pp: 2, tp: 2, dp: 16, micro_batches: 2}", 64),
        ("{scheme: fsdp, dp: 256, fsdp: {param_dtype: bf16}}", 256),
        ("{scheme: fsdp, dp: 16, tp: 4}", 64),
        ("{scheme: tp, tp: 4, dp: 16}", 64),
        ("{scheme: cp, cp: 4, dp: 16}", 64),
    ],
    ids=[
        "ddp-1024",
        "zero3-64",
        "zeropp-hpz8-64",
        "zero2-128",
        "moe-ep64",
        "deepspeed-pp2-dp32",
        "deepspeed-3d-64",
        "fsdp-256",
        "fsdp-tp4-dp16",
        "tp4-dp16",
        "cp4-dp16",
    ],
)
def test_an_emulated_run_reconciles_to_zero_at_the_declared_world_size(par: str, world: int, tmp_path: Path) -> None:
    (s,) = load_text(scenario(par))
    capture = launch_local(s, workdir=tmp_path)
    # rank 0 alone, or data-parallel index 0 of every pipeline stage and tensor shard, over gloo among them
    started = (
        (0,)
        if s.parallelism.pp == 1
        else tuple(sorted({0, world // 2} | ({1, world // 2 + 1} if s.parallelism.tp > 1 else set())))
    )
    assert capture.world_size == world and capture.ranks == started and capture.backend == "emulated"
    assert {c.rank for c in capture.calls} == set(started) and capture.calls
    rec = reconcile(predict(s), capture)
    assert not rec.mismatches, rec.mismatches
    assert rec.keys and all(k.measured_calls > 0 for k in rec.keys)
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted
    assert Baseline.from_run(capture, rec, {"hardware": "h", "date": ""}).latency == {}  # timings are no latencies


def test_pipeline_stages_run_for_real_around_an_emulated_data_parallel_axis(tmp_path: Path) -> None:
    """FSDP2 x TP x PP at 64 ranks: the 4 ranks of data-parallel index 0 (2 stages x 2 tensor shards) run, their
    tensor-parallel all-reduces and stage sends over gloo among themselves, FSDP2 over 16 emulated."""
    (s,) = load_text(
        scenario(
            "{scheme: fsdp, pp: 2, tp: 2, dp: 16, micro_batches: 4, pipeline: {engine: torch, schedule: 1f1b}}",
            "{preset: 19M-cpu, L: 4, s: 32}",
        )
    )
    capture = launch_local(s, workdir=tmp_path)
    assert capture.ranks == (0, 1, 32, 33)
    rec = reconcile(predict(s), capture)
    assert rec.ok and not rec.mismatches
    sends = {(c.rank, c.peer) for c in capture.calls if c.op == "send"}
    assert sends == {(0, 32), (1, 33), (32, 0), (33, 1)}


def test_the_gate_judges_communication_not_latency(tmp_path: Path) -> None:
    (s,) = load_text(scenario("{scheme: zero1, dp: 64}"))
    options = Options(baseline_dir=tmp_path, update_baselines=True)
    first = run_scenario(s, LocalRanks(), options)
    again = run_scenario(s, LocalRanks(), Options(baseline_dir=tmp_path))
    assert first is not None and again is not None
    assert (tmp_path / "emulated" / "e.json").exists()
    assert again.status == "passed", again.summary()
    assert "latency not judged: an emulated run (rank 0 of 64)" in again.latency_note
    assert "rank 0 run, the others emulated" in again.summary() and "(rank 0's view)" in again.summary()


@pytest.mark.parametrize(
    ("par", "extra", "message"),
    [
        ("{scheme: ddp, dp: 8}", "backend: nccl\n", "an emulated run exchanges nothing, on CPU"),
        ("{scheme: ddp, dp: 8}", "workload: commgate.run.workloads.probes:paths\n", "your own workload"),
    ],
)
def test_what_cannot_be_emulated_is_one_line(par: str, extra: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=r"emulate: true: " + message) as info:
        load_text(scenario(par, extra="emulate: true\n" + extra))
    assert "\n" not in str(info.value)


def test_run_emulate_skips_what_it_cannot_emulate(tmp_path: Path) -> None:
    for name, extra in (("d", ""), ("w", "workload: commgate.run.workloads.probes:paths\n")):
        text = scenario("{scheme: ddp, dp: 512}", extra=extra).replace("name: e", f"name: {name}")
        (tmp_path / f"{name}.yaml").write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "commgate", "run", "--emulate", str(tmp_path), "--report-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED  d (ddp, 512 ranks, rank 0 run, the others emulated" in run.stdout
    assert "not emulated: your own workload runs on real ranks only" in run.stdout


def test_a_large_group_is_shown_by_its_ends_and_count() -> None:
    from commgate.model.layout import group_text

    assert group_text(tuple(range(1024))) == "[0, 1, ..., 1023] (1024 ranks)"
    assert group_text(tuple(range(1, 256, 4))) == "[1, 5, ..., 253] (64 ranks)"
    assert group_text((0, 1, 2)) == "[0, 1, 2]"
    assert group_text((0, 1, 2, 3, 4, 5, 6, 7, 9)) == "[0, 1, 2, 3, 4, 5, 6, 7, 9]"  # uneven: every rank


def test_the_page_marks_an_emulated_run(tmp_path: Path) -> None:
    (s,) = load_text(scenario("{scheme: ddp, dp: 256}"))
    result = run_scenario(s, LocalRanks(), Options(baseline_dir=tmp_path, gate=False))
    assert result is not None and result.status == "passed"
    from commgate.report.htmlreport import page

    doc = {"created": "", "environment": {}, "summary": {"passed": 1}, "scenarios": [result.document()]}
    assert "<td>256 (emulated: 1 run)</td>" in page(doc, {})


def test_the_memory_estimate_follows_how_the_model_is_built() -> None:
    """FSDP2 keeps 1/dp of everything; emulated it is built on the meta device (the README's 6.7B run: 6.69 GiB
    for all its processes), else whole first."""
    from commgate.run.budget import GIB, per_rank

    text = scenario("{scheme: fsdp, dp: 256}", "{preset: 6.7B, s: 16, dtype: fp32}")
    (emulated,) = load_text(text)
    (real,) = load_text(text.replace("emulate: true\n", ""))
    assert per_rank(emulated, 0).total < 10 * GIB < 24 * GIB < per_rank(real, 0).params


def test_the_memory_estimate_counts_what_fsdp2_and_zero3_hold_gathered() -> None:
    """An 8B Llama 3 of 4 layers, emulated at dp 8 in fp32: its rank held 12.5 GiB under FSDP2 and 12.7 GiB
    under ZeRO-3, where the estimate (one layer counted as gathered) said 5.9 GiB, so a machine with 8 GiB
    would have started it and had it killed. FSDP2 keeps its root group (embeddings and head, 2 x 128,256 x
    4,096 elements) gathered through the pass, copied out of its all-gather output, and the gradients of as
    much; DeepSpeed's coordinator keeps up to ``stage3_max_live_parameters`` gathered (1e9 elements by
    default), and the estimate follows the knob."""
    from commgate.run.budget import GIB, per_rank

    model = "{preset: llama3-8B, L: 4, s: 16, dtype: fp32}"
    root = 2 * 128_256 * 4_096 * 4  # bytes
    (fsdp,) = load_text(scenario("{scheme: fsdp, dp: 8}", model))
    got = per_rank(fsdp, 0)
    assert got.params >= 2 * root and got.grads >= root and got.total > 12.5 * GIB
    (tp,) = load_text(scenario("{scheme: fsdp, dp: 8, tp: 2}", model))
    assert per_rank(tp, 0).total > 8.2 * GIB

    (zero3,) = load_text(scenario("{scheme: zero3, dp: 8}", model))
    got = per_rank(zero3, 0)
    assert got.params >= 1e9 * 4 and got.total > 12.7 * GIB
    few = "deepspeed: {zero_optimization: {stage3_max_live_parameters: 1000000, stage3_max_reuse_distance: 0}}\n"
    (knobbed,) = load_text(scenario("{scheme: zero3, dp: 8}", model, "emulate: true\n" + few))
    assert per_rank(knobbed, 0).params < got.params - 3 * GIB


def test_fsdp_with_tensor_parallelism_emulated_is_built_on_the_meta_device_too() -> None:
    """torchtitan's 2-D (Llama 3 70B, dp 512 x tp 8): emulated, no tensor shard of it is built, let alone the
    whole model (280 GB), which a run that is not emulated builds before DTensor and FSDP2 keep their shards;
    the memory estimate counts what each way builds."""
    from commgate.model.schemes.fsdp import built_on_meta
    from commgate.run.budget import GIB, per_rank

    text = scenario("{scheme: fsdp, dp: 512, tp: 8}", "{preset: llama3-70B, s: 16, dtype: fp32}")
    (emulated,) = load_text(text)
    (real,) = load_text(text.replace("emulate: true\n", ""))
    (staged,) = load_text(text.replace("tp: 8", "tp: 8, pp: 2, micro_batches: 2, pipeline: {engine: torch}"))
    assert built_on_meta(emulated) and not built_on_meta(real) and not built_on_meta(staged)
    assert per_rank(emulated, 0).total < 16 * GIB
    assert per_rank(real, 0).params >= 70e9 * 4 and per_rank(staged, 0).params >= 70e9 * 4
    # DDP with tensor parallelism (scheme tp) builds the whole model first, emulated or not
    (ddp_tp,) = load_text(text.replace("scheme: fsdp", "scheme: tp"))
    assert per_rank(ddp_tp, 0).params >= 70e9 * 4


def test_commgate_run_emulate_skips_a_trainers_scenario_whose_file_would_be_refused() -> None:
    """``emulate: true`` in a trainer's scenario is refused at load; ``commgate run --emulate`` set it after the
    load and ran the trainer emulated all the same (found by an adversarial pass): it is skipped saying why."""
    import dataclasses

    from commgate.run.workloads import skip_reason

    text = "schema_version: 1\nname: m\ntrainer: megatron\nmodel: {L: 2, h: 32, a: 4, V: 128, s: 16}\n"
    text += "parallelism: {scheme: ddp, dp: 2}\n"
    (s,) = load_text(text)
    assert skip_reason(s, gpus=False) is None
    why = skip_reason(dataclasses.replace(s, emulate=True), gpus=False)
    assert why == "not emulated: megatron's ranks all run (an emulated megatron run is not supported yet)"
    with pytest.raises(ScenarioError, match=r"\$.emulate: true: megatron's ranks all run"):
        load_text(text + "emulate: true\n")


REUSE = """
import torch
from commgate.run import stamps

m = stamps.build()
assert m is not None, "the extension did not build"
m.reuse_memory(1 << 20)
m.reuse_memory(1 << 30)  # once only: the first threshold holds
MB = 1 << 20
xs = [torch.empty(3 * MB, dtype=torch.uint8) for _ in range(3)]
for x in xs:
    x.fill_(7)
assert m.reuse_stats() == [0, 3, 0, 9 * MB, 0, 9 * MB], m.reuse_stats()
del xs, x
assert m.reuse_stats() == [0, 3, 0, 0, 9 * MB, 9 * MB], m.reuse_stats()  # kept, not given back
ys = [torch.empty(3 * MB, dtype=torch.uint8) for _ in range(2)]
assert m.reuse_stats() == [2, 3, 0, 6 * MB, 3 * MB, 9 * MB], m.reuse_stats()  # reused by size
z = torch.empty(5 * MB, dtype=torch.uint8)  # a new size: the block kept longest goes first (6 + 3 + 5 > 9)
assert m.reuse_stats() == [2, 4, 1, 11 * MB, 0, 11 * MB], m.reuse_stats()
small = torch.ones(1000)  # under the threshold: torch's own allocator's, freed by it
storage = torch.UntypedStorage(10)
storage.resize_(3 * MB)
storage.resize_(10)
del small, storage
try:
    torch.empty(1 << 50, dtype=torch.uint8)
except RuntimeError as exc:
    assert "not enough memory: you tried to allocate 1125899906842624 bytes" in str(exc), exc
else:
    raise AssertionError("a petabyte was allocated")
del ys, z
kept = m.reuse_stats()[4]
assert kept == 11 * MB, m.reuse_stats()
import resource  # the kernel refuses a new mapping: the kept blocks are given back, and it is tried again

with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped - 8 * MB, resource.RLIM_INFINITY))
w = torch.empty(2 * MB, dtype=torch.uint8)
assert m.reuse_stats()[4] == 0 and m.reuse_stats()[3] == 2 * MB, m.reuse_stats()
print("ok")
"""


def test_an_emulated_rank_keeps_freed_large_blocks_and_maps_no_more_than_it_held_live() -> None:
    """The emulated rank's allocator (``emulate.reuse_memory``, in commgate's extension): a freed block of at least
    the threshold is kept and handed to the next request of its size; a new size first gives back the blocks
    kept longest, so that live and kept together never pass the most that was live at once; below the
    threshold, torch's own allocator's blocks stay its own; where the kernel refuses a new mapping, the kept
    blocks are given back first, and a request past all memory is torch's one-line "not enough memory". In a
    process of its own: the allocator stays for the process's life."""
    done = subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_an_emulated_rank_computes_with_the_reusing_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every emulated rank installs it as it takes its device; a gloo rank does not."""
    from commgate.run import rank

    calls: list[bool] = []
    monkeypatch.setattr(rank, "reuse_memory", lambda: calls.append(True) or True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert rank._device("gloo", 0) == torch.device("cpu") and not calls
    assert rank._device("emulated", 0) == torch.device("cpu") and calls == [True]
