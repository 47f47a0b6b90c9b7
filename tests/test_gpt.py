"""The torch decoder is the inventory: same tensors, same names, same shapes; it trains."""

import pytest

torch = pytest.importorskip("torch")

from commgate.model.scenario import ModelSpec  # noqa: E402
from commgate.model.transformer import PRESETS, inventory, param_count  # noqa: E402
from commgate.run.workloads.gpt import GPT, batch  # noqa: E402

SPECS = [
    PRESETS["19M-cpu"],
    ModelSpec(L=2, h=16, a=4, V=32, s=8, tied_embeddings=True),
    ModelSpec(L=3, h=16, a=2, V=40, s=8, position="rotary", x=2),
    ModelSpec(L=1, h=8, a=2, V=16, s=4, position="none"),
    PRESETS["tinyllama-1.1B-cpu"],
    ModelSpec(L=2, h=16, a=4, V=32, s=8, architecture="llama", position="rotary", kv_heads=2, ffn_hidden=44),
    ModelSpec(L=1, h=16, a=2, V=24, s=8, architecture="llama", position="rotary", kv_heads=1, tied_embeddings=True),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda m: m.preset or f"{m.architecture}-L{m.L}h{m.h}-{m.position}")
def test_parameters_are_the_inventory(spec: ModelSpec) -> None:
    built = {name: tuple(p.shape) for name, p in GPT(spec).named_parameters()}
    assert built == {p.name: p.shape for p in inventory(spec)}
    assert sum(p.numel() for p in GPT(spec).parameters()) == param_count(spec)


def test_125m_cpu_parameter_count_equals_the_model() -> None:
    m = PRESETS["125M-cpu"]
    assert sum(p.numel() for p in GPT(m).parameters()) == param_count(m)


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda m: m.preset or f"{m.architecture}-{m.position}-kv{m.kv}")
def test_a_training_step_lowers_the_loss(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    model = GPT(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = batch(spec, 2, seed=1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_batches_are_deterministic() -> None:
    m = SPECS[1]
    assert torch.equal(batch(m, 2, seed=3), batch(m, 2, seed=3))
    assert batch(m, 2, seed=3).shape == (2, m.s + 1)
