"""Sequence parallelism with tensor parallelism (``parallelism.sequence_parallel``): each of TP's
all-reduces becomes an all-gather and a reduce-scatter of the same message, so Eq. 5's volume is unchanged
in twice the calls; what is not in Eq. 5 is listed. The real runs: ``scenarios/tp-sequence-parallel.yaml``
and the generator's draws."""

from __future__ import annotations

from collections import Counter

import pytest
from commgate.core.errors import ScenarioError
from commgate.model.collectives import Op
from commgate.model.expectation import Phase
from commgate.model.loader import load_text
from commgate.model.predict import predict


def scenario(extra: str = "", scheme: str = "tp", model: str = "{preset: 13B}") -> str:
    return f"schema_version: 1\nname: s\nmodel: {model}\nparallelism: {{scheme: {scheme}, tp: 8{extra}}}\n"


@pytest.mark.parametrize("extra", ["", ", activation_checkpointing: true", ", micro_batches: 4, dp: 2"])
def test_the_volume_of_eq_5_in_all_gathers_and_reduce_scatters(extra: str) -> None:
    (tp,) = load_text(scenario(extra))
    (sp,) = load_text(scenario(extra + ", sequence_parallel: true"))
    a, b = predict(tp), predict(sp)
    (ca,) = [c for c in a.comparison() if c.term.equation == "Eq. 5"]
    (cb,) = [c for c in b.comparison() if c.term.equation == "Eq. 5"]
    assert all(c.unexplained_bytes == 0 for c in b.comparison()) and cb.term == ca.term
    checkpointed = "checkpointing" in extra
    # the same Eq. 5 volume, unless the early stop of the recompute cuts differently (3 units, not 2)
    assert (cb.model_bytes == ca.model_bytes) != checkpointed
    bsh = 2048 * 5120 * 2  # b*s*h in fp16: every TP message, all-reduce or all-gather or reduce-scatter
    ops = Counter(c.op for c in b.collectives if c.paper_term == "Eq. 5" for _ in range(c.calls))
    assert ops[Op.ALL_GATHER] >= ops[Op.REDUCE_SCATTER] > 0
    assert {c.bytes_per_call for c in b.collectives if c.paper_term == "Eq. 5"} == {bsh}
    layers_ar = [c for c in a.collectives if c.op is Op.ALL_REDUCE and "row-parallel" in c.source]
    layers_ag = [c for c in b.collectives if c.op is Op.ALL_GATHER and "attention and MLP inputs" in c.source]
    assert sum(c.calls for c in layers_ar) == sum(c.calls for c in layers_ag)  # one for one, per layer


def test_norm_gradients_are_all_reduced_where_they_are_resolved() -> None:
    """A norm parameter is replicated while its gradient comes from sequence shards (Partial): alone,
    AdamW resolves it at each of its 3 reads; under DDP the hand-over to the local shard does, once."""
    (alone,) = load_text(scenario(", sequence_parallel: true", model="{preset: 19M-cpu}"))
    (ddp,) = load_text(scenario(", sequence_parallel: true, dp: 2", model="{preset: 19M-cpu}"))
    norms = 6 * 4 + 2  # two LayerNorms (weight, bias) per layer and the final one
    for s, phase, calls in ((alone, Phase.OPTIMIZER, 3 * norms), (ddp, Phase.BACKWARD, norms)):
        rows = [c for c in predict(s).collectives if "norm-parameter" in c.source]
        assert {c.phase for c in rows} == {phase} and sum(c.calls for c in rows) == calls
        assert {c.elements for c in rows} == {64} and all(c.paper_term is None for c in rows)


@pytest.mark.parametrize(
    ("extra", "scheme", "message"),
    [
        (", sequence_parallel: true, dp: 2", "ddp", "sequence parallelism runs inside tensor parallelism"),
        (", sequence_parallel: true, pp: 2", "3d", "not modelled under DeepSpeed's pipeline engine yet"),
    ],
)
def test_what_sequence_parallelism_refuses_is_one_line(extra: str, scheme: str, message: str) -> None:
    text = scenario(extra, scheme).replace("tp: 8, ", "tp: 8, " if scheme != "ddp" else "")
    if scheme == "ddp":
        text = text.replace("tp: 8", "tp: 1")
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(text)
    assert "\n" not in str(info.value)
