"""The built-in decoder handed to commgate as a user's module (``model: {module: "user_gpt:build"}``):
its prediction through the meta-device hook must equal the built-in model's (``tests/test_usermodule.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from commgate.model.scenario import ModelSpec, Scenario
from commgate.run.workloads.gpt import GPT, batch


def spec() -> ModelSpec:
    tied = os.environ.get("USER_GPT_TIED") == "1"
    return ModelSpec(L=2, h=16, a=2, V=64, s=16, x=2, tied_embeddings=tied)


def build(scenario: Scenario) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    m, par = spec(), scenario.parallelism
    model = GPT(m, checkpointing=par.activation_checkpointing)
    return model, lambda seed: (batch(m, par.micro_batch, seed=seed),)


def frozen(scenario: Scenario) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    """The decoder with every parameter frozen: nothing to train."""
    model, inputs = build(scenario)
    model.requires_grad_(False)
    return model, inputs
