"""The per-collective model: exact figures for hand-checkable cases and properties over a grid."""

import itertools
from fractions import Fraction
from typing import Any

import pytest
from commgate.model.collectives import Op
from commgate.model.expectation import Phase, Prediction
from commgate.model.loader import load_document
from commgate.model.predict import predict
from commgate.model.schemes.zero3_fetch import INERT


def scenario(
    model: dict[str, Any] | str = "19M-cpu", deepspeed: dict[str, Any] | None = None, **par: Any
) -> Prediction:
    m = {"preset": model} if isinstance(model, str) else model
    doc = {"schema_version": 1, "name": "t", "model": m, "parallelism": par} | (
        {"deepspeed": deepspeed} if deepspeed else {}
    )
    (s,) = load_document(doc, file="<test>")
    return predict(s)


def rows(p: Prediction, op: Op, phase: Phase | None = None) -> list[Any]:
    return [c for c in p.collectives if c.op is op and (phase is None or c.phase is phase)]


def test_13b_ddp_dp16_reproduces_eqs_1_and_2() -> None:
    p = scenario("13B", scheme="ddp", dp=16)
    assert p.param_count_eq1 == 13_110_159_360
    assert p.paper_volume_elements == 24_581_548_800
    buckets = [c for c in p.steady if c.op is Op.ALL_REDUCE]
    assert sum(c.elements for c in buckets) == 13_111_183_360  # every gradient once per step
    assert {(c.group_size, c.calls, c.dtype, c.from_step) for c in buckets} == {(16, 1, "fp16", 1)}
    # Buckets follow gradient-ready order (reverse registration): the output layer alone passes the 1 MiB
    # first cap; then final norm (2h), the last fc_out bias (h) and weight (h*4h) pass the 25 MiB cap.
    h = 5120
    assert buckets[0].bytes_per_call == 50304 * h * 2
    assert buckets[1].bytes_per_call == (2 * h + h + h * 4 * h) * 2
    assert all(c.unexplained_bytes == 0 for c in p.comparison())


def test_ddp_bucket_and_broadcast_chunking() -> None:
    from commgate.model.schemes.ddp import buckets_by_size, coalesced_chunks

    assert buckets_by_size([3, 3, 3, 3, 3], [4, 7]) == [6, 9]  # a bucket closes once it reaches its cap
    assert buckets_by_size([10, 1], [4]) == [10, 1]
    assert coalesced_chunks([("fp32", 3)] * 3, 5) == [("fp32", 6), ("fp32", 3)]  # closed once it reaches it
    assert coalesced_chunks([("fp32", 4), ("int64", 8), ("fp32", 4)], 100) == [("fp32", 8), ("int64", 8)]


def test_the_bucket_assignment_is_torchs() -> None:
    """``ddp.bucket_assignment`` against torch's own ``_compute_bucket_assignment_by_size`` on random
    tensors of mixed dtypes, sizes and limits."""
    import random

    import torch
    import torch.distributed as dist
    from commgate.model.schemes.ddp import bucket_assignment

    rng = random.Random(7)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
    for _ in range(200):
        drawn = [(rng.choice(list(dtypes)), rng.randint(1, 40)) for _ in range(rng.randint(1, 12))]
        tensors = [torch.empty(n, dtype=dtypes[d]) for d, n in drawn]
        limits = [rng.randint(1, 200) for _ in range(rng.randint(1, 3))]
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        ours = bucket_assignment(
            [(d, t.numel() * t.element_size()) for (d, _), t in zip(drawn, tensors, strict=True)], limits
        )
        assert [idx for _, idx in ours] == expected, (drawn, limits)


def test_ddp_finding_unused_parameters_keeps_its_initial_buckets() -> None:
    """DDP with ``find_unused_parameters`` (Hugging Face's Trainer turns it on; commgate's own workloads do not):
    the same construction, no bucket rebuild, and from the first step on the initial buckets (torch's
    assignment in registration order, 1 MiB first) and the used-parameter map (one int32 per parameter)."""
    import torch
    import torch.distributed as dist
    from commgate.model.expectation import Context
    from commgate.model.schemes.ddp import DistributedDataParallel

    (s,) = load_document(
        {"schema_version": 1, "name": "t", "model": {"preset": "19M-cpu"}, "parallelism": {"scheme": "ddp", "dp": 2}},
        file="<test>",
    )
    ctx = Context(scenario=s)
    plain, found = DistributedDataParallel().collectives(ctx), DistributedDataParallel(True).collectives(ctx)
    assert [r for r in found if r.phase is Phase.INIT] == [r for r in plain if r.phase is Phase.INIT]
    assert not [r for r in found if r.once and r.at_step is not None]  # no first iteration, no rebuild
    (used,) = [r for r in found if r.dtype == "int32"]
    assert (used.op, used.elements, used.phase, used.paper_term) == (
        Op.ALL_REDUCE,
        len(ctx.trainable),
        Phase.BACKWARD,
        None,
    )
    grads = [r for r in found if r.op is Op.ALL_REDUCE and r.dtype == "fp32"]
    tensors = [torch.empty(p.shape) for p in ctx.trainable]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [1 << 20, 25 << 20])
    assert sorted(r.elements for r in grads) == sorted(sum(tensors[i].numel() for i in idx) for idx in expected)
    assert len(grads) > 1 and all(r.paper_term == "Eq. 2" and r.from_step == 0 for r in grads)


def test_13b_zero3_reproduces_eq_3() -> None:
    # the paper's regime: each module's parameters gathered for its use and released (the coordinator inert)
    p = scenario("13B", scheme="zero3", dp=16, deepspeed={"zero_optimization": INERT})
    assert p.paper_volume_elements == 36_872_323_200
    gathers = [c for c in p.steady if c.op is Op.ALL_GATHER]
    # every module's parameters are gathered in the forward and again in the backward
    assert sum(c.elements * c.calls for c in gathers) == 2 * p.param_count
    assert {c.op for c in p.steady} == {Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE}
    assert sum(c.elements for c in p.steady if c.op is Op.REDUCE_SCATTER) == p.param_count


def test_13b_zero3_on_deepspeeds_defaults_gathers_less_than_eq_3() -> None:
    p = scenario("13B", scheme="zero3", dp=16)
    inert = scenario("13B", scheme="zero3", dp=16, deepspeed={"zero_optimization": INERT})
    gathered = sum(c.bytes_per_step for c in p.steady if c.op is Op.ALL_GATHER)
    # every parameter is gathered at least once a step (the optimizer step partitions them all), fewer
    # than twice: the reuse distance (1e9 elements) keeps the last layers' parameters for the backward
    eq3_regime = sum(c.bytes_per_step for c in inert.steady if c.op is Op.ALL_GATHER)
    assert p.param_count * p.scenario.model.itemsize <= gathered < eq3_regime
    (term,) = [r for r in p.residuals if r.name == "ZeRO-3 prefetch, reuse and persistence"]
    assert term.bytes < 0 and all(c.unexplained_bytes == 0 for c in p.comparison())


def test_deepspeed_zero1_and_zero2_send_half_again_what_ddp_sends() -> None:
    # DeepSpeed all-reduces the gradients (2N(d-1)/d) and all-gathers the parameters (N(d-1)/d); Eq. 2
    # assumes reduce-scatter + all-gather, i.e. the same volume as DDP. The norm all-reduce adds 2*4 B.
    ddp = scenario(scheme="ddp", dp=4)
    ddp_volume = sum(c.paper_bytes_per_step for c in ddp.steady)
    for scheme in ("zero1", "zero2"):
        z = scenario(scheme=scheme, dp=4)
        assert sum(c.paper_bytes_per_step for c in z.steady) == ddp_volume * 3 / 2 + 2 * 4 * Fraction(3, 4)
        (named,) = [r for r in z.residuals if r.name == "gradients all-reduced, not reduce-scattered"]
        assert named.bytes == ddp_volume / 2


def test_tensor_parallel_calls_per_step() -> None:
    p = scenario(scheme="tp", tp=2, activation_checkpointing=True, micro_batches=3)
    L, bsh, bs = 6, 128 * 64, 128
    activations = [c for c in p.steady if c.elements == bsh]
    assert sum(c.calls for c in activations if c.phase is Phase.FORWARD) == (2 * L + 1) * 3
    # backward: 2 per layer, 1 recomputed per layer (checkpointing stops early), 1 for the output layer
    assert sum(c.calls for c in activations if c.phase is Phase.BACKWARD) == (3 * L + 1) * 3
    assert sum(c.calls for c in p.steady if c.elements == bs) == 3 * 3  # vocab-parallel cross-entropy
    init = [c for c in p.collectives if c.once]
    # DTensor scatters the sharded parameters: embedding and output layer (V*h each), and per layer the
    # fused QKV (3h*h + 3h), attention output (h*h), MLP input (4h*h + 4h) and output (h*4h) weights
    h = 64
    per_layer = 3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h
    assert sum(c.elements for c in init if c.op is Op.SCATTER) == 2 * 1024 * h + L * per_layer


def test_pipeline_sends_b_s_h_per_micro_batch_each_way() -> None:
    p = scenario(scheme="pp", pp=3, micro_batches=4, micro_batch=2)
    sends = [c for c in p.steady if c.op is Op.SEND]
    assert len(sends) == 4  # 2 boundaries x (activations, gradients)
    assert all(c.elements == 2 * 128 * 64 and c.calls == 4 and c.group_size == 2 for c in sends)
    assert {g for c in sends for g in c.groups} == {(0, 1), (1, 2), (1, 0), (2, 1)}
    assert len([c for c in p.steady if c.op is Op.RECV]) == 4
    once = {c.source for c in p.collectives if c.once and c.op is Op.SEND}
    assert len(once) == 4  # warm-up and tensor metadata across each boundary


def test_tied_embeddings_across_pipeline_stages_sync_their_gradient() -> None:
    p = scenario({"preset": "19M-cpu", "tied_embeddings": True}, scheme="pp", pp=2)
    (tied,) = [c for c in rows(p, Op.ALL_REDUCE) if "tied" in c.source]
    assert tied.groups == ((0, 1),) and tied.elements == 1024 * 64 and tied.paper_term is None


def test_moe_all_to_all_size_by_hand() -> None:
    # b*s = 128 tokens, 4 experts, capacity factor 1, top-1: capacity ceil(128/4) = 32; [E, C, h] = 4*32*64
    p = scenario(scheme="moe", dp=4, moe={"experts": 4, "ep": 2, "every": 2})
    a2a = rows(p, Op.ALL_TO_ALL)
    assert {c.elements for c in a2a} == {4 * 32 * 64}
    assert sum(c.calls for c in a2a) == 4 * 3  # 3 MoE layers, 2 forward + 2 backward each
    assert {c.groups for c in a2a} == {((0, 1), (2, 3))}
    expert = [c for c in rows(p, Op.ALL_REDUCE) if c.axis == "edp"]
    assert expert and expert[0].groups == ((0, 2), (1, 3))


def test_size_one_expert_data_parallel_group_sends_nothing() -> None:
    p = scenario(scheme="moe", dp=2, moe={"experts": 2, "ep": 2})
    (edp,) = [c for c in rows(p, Op.ALL_REDUCE) if c.axis == "edp"]
    assert edp.group_size == 1 and edp.wire_bytes_per_step == 0


def test_zero_plus_plus_options() -> None:
    p = scenario(scheme="zero++", dp=8, zero={"hpz": 4, "qwz": True, "qgz": True})
    fwd, bwd, grad = p.steady
    assert fwd.dtype == "int8" and fwd.bytes_per_call == fwd.elements
    assert bwd.axis == "hpz" and bwd.group_size == 4
    assert grad.op is Op.ALL_TO_ALL and grad.bytes_per_call == (grad.elements + 1) // 2


GRID = [
    dict(scheme="ddp", dp=2),
    dict(scheme="ddp", dp=7),
    dict(scheme="zero1", dp=4),
    dict(scheme="zero2", dp=3),
    dict(scheme="zero3", dp=4),
    dict(scheme="zero1", dp=5),  # partition padding
    dict(scheme="zero3", dp=7),
    dict(scheme="zero++", dp=8, zero={"hpz": 2}),
    dict(scheme="zero++", dp=4, zero={"qwz": True, "qgz": True}),
    dict(scheme="tp", tp=2),
    dict(scheme="tp", tp=4, dp=2, activation_checkpointing=True, micro_batches=3),
    dict(scheme="pp", pp=2),
    dict(scheme="pp", pp=2, dp=3, micro_batches=5, micro_batch=2),
    dict(scheme="3d", dp=2, tp=2, pp=2, micro_batches=2),
    dict(scheme="3d", dp=3, tp=4, pp=2, zero={"stage": 1}),
    dict(scheme="moe", dp=4, moe={"experts": 4, "ep": 2}),
    dict(scheme="moe", dp=8, moe={"experts": 8, "ep": 8, "top_k": 2}),
]
MODELS = [
    "19M-cpu",
    "13B",
    {"preset": "125M-cpu", "tied_embeddings": True},
    {"preset": "1.3B-cpu", "position": "rotary", "x": 8, "dtype": "fp16"},
]


@pytest.mark.parametrize(("model", "par"), list(itertools.product(MODELS, GRID)))
def test_every_byte_against_the_paper_is_a_named_term(model: Any, par: dict[str, Any]) -> None:
    p = scenario(model, **par)
    assert p.paper_terms, "every scheme maps to at least one paper equation"
    for c in p.comparison():
        assert c.unexplained_bytes == 0, (c.term.equation, [(r.name, r.bytes) for r in c.residuals])
    assert all(r.name and r.detail for r in p.residuals)


@pytest.mark.parametrize("scheme", ["tp", "pp"])
def test_model_parallel_volume_is_linear_in_sequence_length(scheme: str) -> None:
    par = {"scheme": scheme, scheme: 2}
    v = [
        sum(
            c.bytes_per_step
            for c in scenario({"preset": "19M-cpu", "s": s}, **par).steady
            if c.paper_term in ("Eq. 4", "Eq. 5")
        )
        for s in (128, 256, 512)
    ]
    assert v[1] == 2 * v[0] and v[2] == 4 * v[0]


def test_data_parallel_volume_does_not_depend_on_sequence_length_without_learned_positions() -> None:
    v = {
        s: scenario({"preset": "19M-cpu", "s": s, "position": "rotary"}, scheme="ddp", dp=2).job_bytes_per_step()
        for s in (128, 512)
    }
    assert v[128] == v[512]


@pytest.mark.parametrize("scheme", ["ddp", "zero1", "zero3"])
def test_per_rank_wire_bytes_grow_with_dp(scheme: str) -> None:
    wire = [sum(c.wire_bytes_per_step for c in scenario(scheme=scheme, dp=d).steady) for d in (2, 3, 4, 8, 16)]
    assert wire == sorted(wire) and len(set(wire)) == len(wire)


@pytest.mark.parametrize("par", GRID[:12], ids=lambda d: d["scheme"])
def test_traffic_matrix_conserves_the_wire_bytes(par: dict[str, Any]) -> None:
    p = scenario(**par)
    tm = p.traffic_matrix()
    assert sum(tm.values()) == p.job_wire_bytes_per_step()
    assert all(src != dst for src, dst in tm)


def test_pipeline_point_to_point_traffic_only_between_adjacent_stages() -> None:
    p = scenario(scheme="pp", pp=3)
    pairs = {g for c in p.collectives if c.op in (Op.SEND, Op.RECV) for g in c.groups}
    assert pairs == {(0, 1), (1, 2), (1, 0), (2, 1)}


def test_message_size_histogram_counts_every_call_of_every_rank() -> None:
    p = scenario(scheme="3d", dp=2, tp=2, pp=2, micro_batches=2)
    assert sum(p.message_sizes().values()) == sum(c.calls * c.participant_count for c in p.steady)


def test_once_per_run_rows_are_not_a_per_step_volume() -> None:
    p = scenario(scheme="ddp", dp=4)
    once = [c for c in p.collectives if c.once]
    assert {c.when for c in once} == {"init", "step 0", "step 1"}
    assert p.job_bytes_per_step() == 4 * p.param_count * 4  # 4 ranks each all-reduce every fp32 gradient


def test_calls_in_a_window() -> None:
    p = scenario(scheme="ddp", dp=2)
    steps = range(1, 4)
    first = next(c for c in p.collectives if c.when == "step 0")
    bucket = next(c for c in p.collectives if c.when == "steps >= 1")
    init = next(c for c in p.collectives if c.when == "init")
    assert (first.calls_in(steps), first.calls_in(range(0, 2)), first.calls_in(None)) == (0, 1, 0)
    assert (bucket.calls_in(range(0, 4)), bucket.calls_in(None)) == (3, 0)
    assert (init.calls_in(None), init.calls_in(steps)) == (1, 0)


def test_paper_volume_is_additive_in_3d() -> None:
    p = scenario(scheme="3d", dp=2, tp=2, pp=2)
    assert p.paper_volume_elements == sum((t.elements for t in p.paper_terms), Fraction(0))
    assert [t.equation for t in p.paper_terms] == ["Eq. 5", "Eq. 4", "Eq. 2"]


def test_a_row_sized_is_the_row_replaced() -> None:
    """``ExpectedCollective.sized`` copies the row's fields one by one: every field, as ``replace`` does."""
    import dataclasses

    from commgate.model.expectation import ExpectedCollective

    row = ExpectedCollective(
        op=Op.REDUCE_SCATTER,
        axis="hpz",
        groups=((0, 1), (2, 3)),
        dtype="bf16",
        elements=7,
        calls=3,
        phase=Phase.BACKWARD,
        source="s",
        paper_term="Eq. 3",
        once=True,
        at_step=2,
        from_step=1,
        overlaps=True,
    )
    sized = row.sized(11)
    assert sized == dataclasses.replace(row, elements=11)
    assert {f.name: getattr(sized, f.name) for f in dataclasses.fields(row)} == dataclasses.asdict(row) | {
        "elements": 11
    }
