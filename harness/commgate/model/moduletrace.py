"""A module trace: the modules of a model with their own parameters, and the hooks a forward and
backward fire on them in order (what DeepSpeed's ZeRO-3 coordinator sees). Built for the built-in decoder
by ``commgate.model.schemes.zero3_fetch.pass_hooks`` and for a user's module on the meta device by
``commgate.model.usermodule``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from commgate.model.transformer import ParamTensor


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    params: tuple[ParamTensor, ...]
    """The module's own parameters (not its children's), in registration order."""
    children: tuple[Module, ...] = ()


class Hook(NamedTuple):
    """One hook firing (immutable; a named tuple, as ``pass_hooks`` makes thousands per pass list and a
    frozen dataclass's construction costs three times as much)."""

    module: Module
    fetch: bool
    """Pre-hook (fetch) or post-hook (release)."""
    backward: bool
    """In the backward pass (a recompute's forward hooks included)."""
    trace: bool = True
    """A step of the coordinator's trace (False: a read of an external parameter outside the hooks)."""
    leftover: bool = False
    """The end-of-backward release of a module whose backward release never fired."""
    recompute: bool = False
    """A forward hook of activation checkpointing's recompute, in the backward."""
