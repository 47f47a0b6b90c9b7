"""torch FSDP2 (``scheme: fsdp``): the per-collective model by hand, the paper comparison exact at full
size, and what the scenario rules refuse. The real runs are the default suite's two FSDP scenarios and the
random draws of ``tests/test_generated.py``."""

from __future__ import annotations

import pytest
from commgate.core.errors import ScenarioError
from commgate.model.collectives import Op
from commgate.model.expectation import Phase
from commgate.model.loader import load_text
from commgate.model.predict import predict

HEAD = "schema_version: 1\nname: f\nmodel: {preset: 19M-cpu}\n"


def fsdp(extra: str = "", dp: int = 2, head: str = HEAD) -> str:
    return head + f"parallelism: {{scheme: fsdp, dp: {dp}{extra}}}\n"


def test_each_group_is_gathered_padded_on_dim_0_and_reduce_scattered_once() -> None:
    """19M-cpu (h=64, ffn=256, V=1024, s=128) on d=3: a block's parameters padded row by row to a
    multiple of 3, gathered in its forward and again in its backward; the root's not again."""
    (s,) = load_text(fsdp(dp=3))
    p = predict(s)
    h, ffn, V, s_ = 64, 256, 1024, 128
    pad = lambda rows: -(-rows // 3) * 3  # noqa: E731
    block = (
        pad(3 * h) * h + pad(3 * h)  # fused QKV weight and bias
        + pad(h) * h + pad(h)  # attention output
        + pad(ffn) * h + pad(ffn) + pad(h) * ffn + pad(h)  # MLP
        + 4 * pad(h)  # two LayerNorms
    )  # fmt: skip
    root = pad(V) * h + pad(s_) * h + 2 * pad(h) + pad(V) * h  # embeddings, final norm, head
    rows = {(c.op, c.phase, c.elements): c.calls for c in p.collectives}
    assert rows[(Op.ALL_GATHER, Phase.FORWARD, block)] == 1 and rows[(Op.ALL_GATHER, Phase.BACKWARD, block)] == 1
    assert rows[(Op.ALL_GATHER, Phase.FORWARD, root)] == 1 and (Op.ALL_GATHER, Phase.BACKWARD, root) not in rows
    assert rows[(Op.REDUCE_SCATTER, Phase.BACKWARD, root)] == 1
    assert sum(c.calls for c in p.collectives if c.op is Op.REDUCE_SCATTER) == 6 + 1  # L blocks and the root
    assert all(c.bytes_per_call == 4 * c.elements and c.group_size == 3 for c in p.collectives)


@pytest.mark.parametrize(
    "extra",
    [
        "",
        ", fsdp: {reshard_after_forward: true}",
        ", fsdp: {reshard_after_forward: false}",
        ", micro_batches: 3",
        ", micro_batches: 3, fsdp: {reshard_after_backward: false, reshard_after_forward: true}",
        ", fsdp: {param_dtype: bf16, reduce_dtype: fp32}",
        ", micro_batches: 2, fsdp: {param_dtype: bf16}",
    ],
)
def test_13b_on_16_ranks_matches_eq_3_after_named_terms(extra: str) -> None:
    (s,) = load_text(fsdp(extra, dp=16, head="schema_version: 1\nname: f\nmodel: {preset: 13B, dtype: fp32}\n"))
    (c,) = predict(s).comparison()
    assert c.term.equation == "Eq. 3" and c.unexplained_bytes == 0
    names = {r.name for r in c.residuals}
    assert ("mixed precision" in names) == ("dtype" in extra)
    assert ("forward all-gathers per micro-batch" in names) == ("micro_batches" in extra and "backward" not in extra)


def test_reshard_after_forward_sets_the_backward_gathers() -> None:
    def gathers(extra: str) -> int:
        (s,) = load_text(fsdp(extra))
        return sum(c.calls for c in predict(s).collectives if c.op is Op.ALL_GATHER and c.phase is Phase.BACKWARD)

    assert (gathers(""), gathers(", fsdp: {reshard_after_forward: true}")) == (6, 7)  # the root too, once set
    assert gathers(", fsdp: {reshard_after_forward: false}") == 0
    assert gathers(", micro_batches: 2") == 12


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEAD + "parallelism: {scheme: ddp, dp: 2, fsdp: {param_dtype: bf16}}\n", "FSDP2 options need scheme 'fsdp'"),
        (fsdp(", fsdp: {param_dtype: fp16}"), "parallelism.fsdp.param_dtype"),
        (fsdp(", fsdp: {reshard_after_forward: 1.5}"), "parallelism.fsdp.reshard_after_forward"),
        (fsdp(dp=1), "needs dp >= 2"),
    ],
)
def test_what_fsdp_refuses_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert "\n" not in str(info.value)


def test_hsdp_gathers_within_a_replica_and_all_reduces_the_shard_across_replicas() -> None:
    """dp_replicate=3 x dp=2 on the (replicate, shard) mesh: ranks 2r, 2r+1 shard one replica; each rank's
    reduce-scattered shard is all-reduced with the same shard of the other replicas."""
    (s,) = load_text(fsdp(", dp_replicate: 3"))
    p = predict(s)
    assert s.world_size == 6
    shard = {c.groups for c in p.collectives if c.op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)}
    assert shard == {((0, 1), (2, 3), (4, 5))}
    reduce = [c for c in p.collectives if c.op is Op.ALL_REDUCE]
    assert {c.groups for c in reduce} == {((0, 2, 4), (1, 3, 5))} and len(reduce) == 7  # every group's shard
    scatters = {c.source.split(", ", 1)[1]: c.elements for c in p.collectives if c.op is Op.REDUCE_SCATTER}
    assert all(c.elements * 2 == scatters[c.source.split(", ", 1)[1]] for c in reduce)
    (c,) = p.comparison()
    assert c.unexplained_bytes == 0 and "HSDP replica all-reduce" in {r.name for r in c.residuals}


def test_replicas_are_fsdp_only() -> None:
    with pytest.raises(ScenarioError, match=r"parallelism\.dp_replicate: 2: replicas of a sharded model are HSDP"):
        load_text(HEAD + "parallelism: {scheme: zero3, dp: 2, dp_replicate: 2}\n")
    with pytest.raises(ScenarioError, match=r"world_size: 4 != dp_replicate\*dp\*tp\*pp = 3\*2\*1\*1 = 6"):
        load_text(fsdp(", dp_replicate: 3") + "world_size: 4\n")


def test_2d_gathers_each_ranks_tensor_parallel_shard_over_data_parallel_ranks() -> None:
    """FSDP2 over dp with DTensor TP inside: TP's all-reduces run over the tensor-parallel pairs, FSDP2's
    gathers over the data-parallel pairs, of each rank's shard (row-parallel weights split on dim 1, so
    their dim 0 is padded whole; column-parallel ones on dim 0)."""
    (s,) = load_text(fsdp(", tp: 2"))
    p = predict(s)
    tp = {c.groups for c in p.collectives if c.axis == "tp"}
    dp = {c.groups for c in p.collectives if c.axis == "dp"}
    assert tp == {((0, 1), (2, 3))} and dp == {((0, 2), (1, 3))}
    h, ffn = 64, 256
    block = (3 * h // 2) * h + 3 * h // 2 + h * (h // 2) + h + (ffn // 2) * h + ffn // 2 + h * (ffn // 2) + h + 4 * h
    assert any(c.op is Op.ALL_GATHER and c.elements == block for c in p.collectives)
    assert all(c.unexplained_bytes == 0 for c in p.comparison())
    assert "tensor/pipeline sharding" in {r.name for c in p.comparison() for r in c.residuals}
    (bf16,) = load_text(fsdp(", tp: 2, fsdp: {param_dtype: bf16}"))
    assert {c.dtype for c in predict(bf16).collectives if c.axis == "tp" and c.elements == 128 * 64} == {"bf16"}
    with pytest.raises(ScenarioError, match="HSDP with tensor parallelism is not modelled yet"):
        load_text(fsdp(", tp: 2, dp_replicate: 2"))


@pytest.mark.parametrize(
    ("fsdp_opts", "micro_batches", "dtype"),
    [
        ("{}", 1, "fp32"),
        ("{param_dtype: bf16}", 2, "bf16"),
        ("{param_dtype: bf16, reduce_dtype: fp32}", 1, "bf16"),  # resolved as computed, then cast to reduce
        ("{param_dtype: bf16, reduce_dtype: fp32}", 2, "fp32"),  # accumulated in reduce_dtype, then resolved
        ("{reduce_dtype: bf16}", 2, "bf16"),
    ],
)
def test_2d_sequence_parallel_norm_gradients_are_resolved_once_a_step_in_their_dtype(
    fsdp_opts: str, micro_batches: int, dtype: str
) -> None:
    """Under FSDP2 a sequence-parallel norm's Partial gradient is all-reduced once a step, when FSDP2
    takes it to reduce: in the compute dtype, or in reduce_dtype where micro-batches accumulated it so
    (``FSDPParam.to_accumulated_grad_if_needed``)."""
    extra = f", tp: 2, sequence_parallel: true, micro_batches: {micro_batches}, fsdp: {fsdp_opts}"
    (s,) = load_text(fsdp(extra))
    rows = [c for c in predict(s).collectives if "norm-parameter" in c.source]
    assert {(c.dtype, c.phase) for c in rows} == {(dtype, Phase.BACKWARD)}
    assert sum(c.calls for c in rows) == 6 * 4 + 2  # once a step, whatever the micro-batches


def test_activation_checkpointing_under_fsdp2_adds_no_collective() -> None:
    (plain,) = load_text(fsdp(", tp: 2"))
    (ac,) = load_text(fsdp(", tp: 2, activation_checkpointing: true"))
    fsdp_rows = lambda s: [(c.op, c.elements, c.calls) for c in predict(s).collectives if c.axis == "dp"]  # noqa: E731
    assert fsdp_rows(plain) == fsdp_rows(ac)
    recompute = [c for c in predict(ac).collectives if "recompute" in c.source]
    assert recompute and all(c.axis == "tp" for c in recompute)  # only TP's recomputed all-reduce


def test_an_int_reshard_after_forward_gathers_the_backward_within_that_many_ranks() -> None:
    """reshard_after_forward: 2 on d=4: the forward gathers over the 4 ranks, the backward within pairs
    (torch's post-forward mesh, ``mesh.view(-1, 2)``); the difference to Eq. 3 is a named term."""
    (s,) = load_text(fsdp(", fsdp: {reshard_after_forward: 2}", dp=4))
    p = predict(s)
    backward = {c.groups for c in p.collectives if c.op is Op.ALL_GATHER and c.phase is Phase.BACKWARD}
    assert backward == {((0, 1), (2, 3))}
    assert {c.groups for c in p.collectives if c.phase is Phase.FORWARD} == {((0, 1, 2, 3),)}
    (c,) = p.comparison()
    assert c.unexplained_bytes == 0 and "post-forward reshard to fewer ranks" in {r.name for r in c.residuals}
    with pytest.raises(ScenarioError, match=r"reshard_after_forward: 3: an int must divide dp=4"):
        load_text(fsdp(", fsdp: {reshard_after_forward: 3}", dp=4))
    with pytest.raises(ScenarioError, match=r"reshard_after_forward: 2: an int with tensor parallelism hangs"):
        load_text(fsdp(", tp: 2, fsdp: {reshard_after_forward: 2}", dp=4))
