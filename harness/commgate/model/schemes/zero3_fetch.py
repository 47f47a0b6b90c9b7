"""ZeRO-3's parameter fetching as DeepSpeed 0.19's coordinator does it, replayed on the module trace.

``deepspeed/runtime/zero/partitioned_param_coordinator.py`` gathers a module's parameters in the
module's pre-forward and pre-backward hooks and releases them in its post-hooks. Four knobs change what
it gathers, and all four are on by default:

* ``stage3_param_persistence_threshold`` (1e5): parameters of at most this many elements are
  *persistent*. They are gathered again after every optimizer step (one call each) and, once the trace
  is complete, never released.
* ``stage3_prefetch_bucket_size`` (5e7): with a complete trace, every fetch (of any module, also one
  without parameters) then gathers, in one more call, the parameters the trace uses next, up to this many
  elements.
* ``stage3_max_live_parameters`` (1e9): that prefetch takes at most this many elements less those
  gathered in this pass and not released yet (``reset_step`` zeroes the count after every pass, so the
  persistent parameters and those kept across passes do not count; a release of one of those lowers it).
* ``stage3_max_reuse_distance`` (1e9): with a complete trace, a module's release keeps the parameters
  that the trace uses again within this many elements (a small model's forward parameters stay gathered
  for its backward).

The trace: the coordinator records the modules in the order their hooks fetch (the pass after it is
first called records; ``reset_step`` at the start of the next forward completes it). For the built-in
decoder that order is the module tree in pre-order for the forward, and in pre-order with children
reversed for the backward; with activation checkpointing, torch's non-reentrant recompute of a layer
runs between the backward of its last leaf module and the rest (its pre-forward hooks all fire, its
post-forward hooks only for the modules that complete before the recompute stops at the last saved
tensor). A tied output layer reads the word embedding in the model's own forward: an external parameter
of the model from the second pass on. Leaf modules are released right after their own hook; the
embedding's backward release never fires (its input needs no gradient) and is the end-of-backward
release of leftovers.

``passes(ctx)`` replays every pass of the first steps, with the coordinator's state (what is gathered,
the release cache, which is keyed by module and trace position and kept across passes) carried from one
to the next, and returns each pass's gathers.
"""

from __future__ import annotations

import bisect
import collections
import functools
import sys
from dataclasses import dataclass, field, replace

from commgate.model.expectation import Context
from commgate.model.moduletrace import Hook, Module
from commgate.model.scenario import Scenario
from commgate.model.schemes._common import padded
from commgate.model.transformer import ParamTensor

DEFAULTS = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": sys.maxsize,
}
"""DeepSpeed's defaults for the coordinator's knobs (``deepspeed/runtime/zero/config.py``)."""

INERT = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 0,
}
"""Knobs under which each module's parameters are gathered for its use and released right after."""


@dataclass(frozen=True, slots=True)
class Knobs:
    prefetch: int
    max_live: int
    reuse: int
    persistence: int
    model_persistence: int

    @property
    def inert(self) -> bool:
        """Release after use, prefetch nothing, persist nothing: the regime of the paper's Eq. 3."""
        return not (self.prefetch or self.reuse or self.persistence)


def knobs(ctx: Context) -> Knobs:
    """The coordinator's knobs: the scenario's DeepSpeed block over DeepSpeed's defaults ("auto" and
    absent keys take the default)."""
    zo = ctx.scenario.deepspeed_config.get("zero_optimization", {})
    zo = zo if isinstance(zo, dict) else {}

    def get(key: str) -> int:
        value = zo.get(key, DEFAULTS[key])
        return int(DEFAULTS[key] if value == "auto" or value is None else value)

    return Knobs(
        prefetch=get("stage3_prefetch_bucket_size"),
        max_live=get("stage3_max_live_parameters"),
        reuse=get("stage3_max_reuse_distance"),
        persistence=get("stage3_param_persistence_threshold"),
        model_persistence=get("stage3_model_persistence_threshold"),
    )


@functools.cache
def module_tree(params: tuple[ParamTensor, ...]) -> Module:
    """The decoder's modules that run a forward, from its parameters' names: each owner and its
    ancestors (``layers``, a ``ModuleList``, never runs), children in registration order."""
    owned: dict[str, list[ParamTensor]] = {"": []}
    children: dict[str, list[str]] = {"": []}
    for p in params:
        owner = p.name.rsplit(".", 1)[0]
        parent = ""
        parts = owner.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix == "layers":
                continue
            if prefix not in owned:
                owned[prefix], children[prefix] = [], []
                children[parent].append(prefix)
            parent = prefix
        owned[owner].append(p)

    def build(name: str) -> Module:
        return Module(name, tuple(owned[name]), tuple(build(k) for k in children[name]))

    return build("")


def pass_hooks(root: Module, *, checkpointed: bool, external: tuple[ParamTensor, ...] = ()) -> list[Hook]:
    """One forward and backward of the decoder, hook by hook. ``external``: parameters the model reads
    in its own forward (a tied output layer's word embedding) that the recorded trace does not list yet:
    gathered on the read, then the model's own."""
    out: list[Hook] = []
    owner = replace(root, params=root.params + external)

    def forward(m: Module, *, backward: bool, stop_at: Module | None = None) -> bool:
        """Pre-order fetches, post-order releases; False where a recompute stopped (no more hooks)."""
        out.append(Hook(m, True, backward, recompute=backward))
        if m is stop_at:
            return False
        for c in m.children:
            if not forward(c, backward=backward, stop_at=stop_at):
                return False
        if m is root and external:
            out.append(Hook(Module("", external), True, backward, trace=False, recompute=backward))
        out.append(Hook(owner if m is root else m, False, backward, recompute=backward))
        return True

    leftovers: list[Module] = []

    def backward(m: Module) -> None:
        out.append(Hook(m, True, True))
        kids = list(reversed(m.children))
        if checkpointed and _is_layer(m):
            path = [kids[0]]  # from the layer's last child down to its last leaf, whose backward recomputes
            while path[-1].children:
                path.append(path[-1].children[-1])
            out.extend(Hook(c, True, True) for c in path)
            forward(m, backward=True, stop_at=_leaves(m)[-1])
            out.append(Hook(path[-1], False, True))
            for parent in reversed(path[:-1]):
                for c in reversed(parent.children[:-1]):
                    backward(c)
                out.append(Hook(parent, False, True))
            kids = kids[1:]
        for c in kids:
            backward(c)
        if m.name.startswith("embed") or not m.name:
            leftovers.append(m)  # its input needs no gradient: its backward release never fires
        else:
            out.append(Hook(m, False, True))

    forward(root, backward=False)
    backward(owner)
    out += [Hook(m, False, True, leftover=True) for m in reversed(leftovers)]
    return out


def _is_layer(m: Module) -> bool:
    return m.name.startswith("layers.") and m.name.count(".") == 1


def _leaves(m: Module) -> list[Module]:
    return [m] if not m.children else [leaf for c in m.children for leaf in _leaves(c)]


@dataclass(frozen=True, slots=True)
class Gather:
    """One all-gather call of the coordinator (its parameters coalesced)."""

    params: tuple[ParamTensor, ...]
    backward: bool
    prefetch: bool
    recompute: bool
    secondary: bool = False
    """ZeRO++ hpZ: from the secondary partition, within hpz ranks."""
    numel: int = field(init=False, compare=False)
    """Elements gathered (unpadded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(p.numel for p in self.params))

    def padded(self, over: int) -> int:
        """Elements gathered, each parameter padded to a multiple of ``over`` (its partitions)."""
        return self.numel if over == 1 else sum(padded(p.numel, over) for p in self.params)


@dataclass
class _State:
    """The coordinator and the parameters' status, carried from pass to pass."""

    knobs: Knobs
    persistent: frozenset[str]
    available: set[str] = field(default_factory=set)
    active: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    n_available: int = 0
    release_cache: dict[tuple[str, int], frozenset[str]] = field(default_factory=dict)
    order: list[Module] | None = None
    """The recorded module trace (None until complete)."""
    trace: _Trace | None = None
    """``order`` indexed for the release's look-ahead (made at its first use)."""
    hpz: bool = False
    secondary: set[str] = field(default_factory=set)
    """ZeRO++ hpZ: parameters with a secondary partition (made when a gathered parameter is released;
    dropped after each optimizer step, ``invalidate_secondary_tensor``)."""


def persistent(params: tuple[ParamTensor, ...], k: Knobs) -> frozenset[str]:
    """``mark_persistent_parameters``: in registration order, each parameter of at most ``persistence``
    elements while the persistent total stays within ``model_persistence``."""
    out, total = set(), 0
    for p in params:
        if p.numel + total > k.model_persistence:
            continue
        if p.numel <= k.persistence:
            out.add(p.name)
            total += p.numel
    return frozenset(out)


def hooks(ctx: Context) -> tuple[list[Hook], list[Hook]]:
    """The hooks of the recording pass and of every later one: the built-in decoder's (``pass_hooks``),
    or a user's module's as measured on the meta device (``commgate.model.usermodule``)."""
    par, model = ctx.scenario.parallelism, ctx.scenario.model
    if model.module:
        from commgate.model.usermodule import describe

        measured = describe(ctx.scenario)
        return list(measured.first), list(measured.later)
    return _builtin_hooks(ctx.params, par.activation_checkpointing, model.tied_embeddings)


@functools.cache
def _builtin_hooks(params: tuple[ParamTensor, ...], checkpointed: bool, tied: bool) -> tuple[list[Hook], list[Hook]]:
    root = module_tree(params)
    if not tied:
        only = pass_hooks(root, checkpointed=checkpointed)
        return only, only
    external = tuple(p for p in params if p.name == "embed.word.weight")
    first = pass_hooks(root, checkpointed=checkpointed, external=external)
    later = pass_hooks(replace(root, params=external), checkpointed=checkpointed)
    return first, later


def traced(ctx: Context) -> tuple[int, int]:
    """The recorded trace's length in modules and in parameters (what ``reset_step`` checks across ranks)."""
    par, model = ctx.scenario.parallelism, ctx.scenario.model
    if model.module:
        return _traced(hooks(ctx)[1])
    return _builtin_traced(ctx.params, par.activation_checkpointing, model.tied_embeddings)


@functools.cache
def _builtin_traced(params: tuple[ParamTensor, ...], checkpointed: bool, tied: bool) -> tuple[int, int]:
    return _traced(_builtin_hooks(params, checkpointed, tied)[1])


def _traced(later: list[Hook]) -> tuple[int, int]:
    fetched = [h.module for h in later if h.fetch and h.trace]
    return len(fetched), sum(len(m.params) for m in fetched)


def passes(ctx: Context, steps: int) -> list[list[Gather]]:
    """The coordinator's gathers in each forward-and-backward pass of the first ``steps`` steps (m passes
    a step; the optimizer's re-gathering of the persistent parameters after each step not included)."""
    return _passes(ctx.scenario, steps)


@functools.lru_cache(maxsize=64)
def _passes(scenario: Scenario, steps: int) -> list[list[Gather]]:
    ctx = Context(scenario=scenario)
    par = scenario.parallelism
    k = knobs(ctx)
    state = _State(knobs=k, persistent=persistent(ctx.params, k), hpz=par.zero.hpz > 1)
    if state.hpz:  # the engine's initial partitioning made every parameter's secondary partition
        state.secondary = {p.name for p in ctx.params}
    first, later = hooks(ctx)
    out: list[list[Gather]] = []
    seen: dict[tuple[object, ...], tuple[list[Gather], _State]] = {}
    for step in range(steps):
        for micro in range(par.micro_batches):
            if step == 0 and micro == 0:
                start = _key(state)
                out.append(_recording_pass(ctx, state, first))
                state.order = [h.module for h in later if h.fetch and h.trace]  # reset_step: the trace is complete
                if k.inert and not state.hpz and first is later:
                    # nothing prefetched or kept: a complete pass from the same state is the recording one
                    seen[start] = (out[-1], _snapshot(state))
                continue
            if micro == 0:  # the optimizer step partitioned everything, then gathered the persistent ones
                state.available = set(state.persistent)
                state.secondary.clear()
            # a pass is a function of the state it starts from (and of the release cache, filled by the
            # first complete pass): a pass starting where an earlier one did repeats it, and ends as it did
            key = _key(state)
            if key in seen:
                gathers, end = seen[key]
                out.append(gathers)
                _restore(state, end)
                continue
            out.append(_one_pass(state, later))
            if len(state.release_cache) == key[3]:
                seen[key] = (out[-1], _snapshot(state))
    return out


def _recording_pass(ctx: Context, state: _State, first: list[Hook]) -> list[Gather]:
    """The recording pass from ``state`` (nothing gathered yet), its gathers returned. Until the trace is
    complete nothing is prefetched or kept for reuse and every release releases, so the knobs act only in
    the end-of-backward release of leftovers (the persistent parameters stay): the built-in decoder's pass
    up to those is replayed once per parameter list, switches and hpZ (``_builtin_recording``), and shared
    by the named terms' variants of a scenario (other knobs, other micro-batch counts)."""
    par, model = ctx.scenario.parallelism, ctx.scenario.model
    if model.module:
        return _one_pass(state, first)
    gathers, before = _builtin_recording(ctx.params, par.activation_checkpointing, model.tied_embeddings, state.hpz)
    _restore(state, before)
    _one_pass(state, first[_leftovers_from(first) :])  # the leftovers' releases gather nothing
    return gathers


def _leftovers_from(hooks: list[Hook]) -> int:
    """Where the end-of-backward releases of leftovers begin (they close the pass)."""
    cut = len(hooks)
    while cut and hooks[cut - 1].leftover:
        cut -= 1
    assert not any(h.leftover for h in hooks[:cut]), "leftover releases only close a pass"
    return cut


@functools.lru_cache(maxsize=64)
def _builtin_recording(
    params: tuple[ParamTensor, ...], checkpointed: bool, tied: bool, hpz: bool
) -> tuple[list[Gather], _State]:
    """The built-in decoder's recording pass up to the releases of leftovers: its gathers and the state it
    leaves (the same under any knobs)."""
    first, _ = _builtin_hooks(params, checkpointed, tied)
    unused = Knobs(prefetch=0, max_live=0, reuse=0, persistence=0, model_persistence=0)
    state = _State(knobs=unused, persistent=frozenset(), hpz=hpz)
    if hpz:
        state.secondary = {p.name for p in params}
    return _one_pass(state, first[: _leftovers_from(first)]), state


def _restore(state: _State, end: _State) -> None:
    """``state``'s gathered, secondary and active sets made copies of ``end``'s (a pass's end reused)."""
    state.available, state.secondary = set(end.available), set(end.secondary)
    state.active = collections.defaultdict(set, {n: set(a) for n, a in end.active.items() if a})


def _snapshot(state: _State) -> _State:
    """A copy of the gathered, secondary and active sets (the release cache and trace shared)."""
    end = replace(state, available=set(state.available), secondary=set(state.secondary))
    end.active = collections.defaultdict(set, {n: set(a) for n, a in state.active.items() if a})
    return end


def _key(state: _State) -> tuple[object, ...]:
    """What a pass's gathers depend on besides the hooks: the state it starts from, and how much of the
    release cache is filled."""
    return (
        frozenset(state.available),
        frozenset(state.secondary),
        frozenset((n, frozenset(a)) for n, a in state.active.items() if a),
        len(state.release_cache),
    )


def _one_pass(state: _State, hooks: list[Hook]) -> list[Gather]:
    # reset_step zeroes the count of gathered elements after every pass, whatever stays gathered (the
    # persistent parameters, what a release kept): the prefetch's live budget counts this pass's only
    state.n_available = 0
    return _Pass(state).run(hooks)


NEVER = -(10**10)
"""The trace position a parameter not fetched yet in this pass was last fetched for."""


@dataclass
class _Pass:
    """One forward-and-backward pass of the coordinator from ``state``: its gathers, the recorded trace
    still ahead (``__param_queue``), where each parameter was last fetched for
    (``__most_recent_step_id_param_fetched_for``; absent: ``NEVER``) and the trace position (``__step_id``)."""

    state: _State
    gathers: list[Gather] = field(default_factory=list)
    queue: collections.deque[tuple[ParamTensor, int]] = field(init=False)
    recent: dict[str, int] = field(default_factory=dict)
    step_id: int = 0

    def __post_init__(self) -> None:
        self.queue = collections.deque((p, i) for i, mod in enumerate(self.state.order or ()) for p in mod.params)

    def run(self, hooks: list[Hook]) -> list[Gather]:
        fetch, release = self.fetch, self.release
        for hook in hooks:
            if hook.fetch:
                fetch(hook)
            elif hook.module.params:
                release(hook)
        return self.gathers

    def gather(self, ps: tuple[ParamTensor, ...], hook: Hook, prefetch: bool) -> None:
        state = self.state
        available = state.available
        todo = tuple(p for p in ps if p.name not in available)
        if not todo:
            return
        if state.secondary:  # one call each (all_gather_coalesced per process group)
            for second in (True, False):
                part = tuple(p for p in todo if (p.name in state.secondary) == second)
                if part:
                    self.gathers.append(Gather(part, hook.backward, prefetch, hook.recompute, second))
            state.n_available += sum(p.numel for p in todo)
        else:
            call = Gather(todo, hook.backward, prefetch, hook.recompute)
            self.gathers.append(call)
            state.n_available += call.numel
        available.update(p.name for p in todo)

    def fetch(self, hook: Hook) -> None:
        """``fetch_sub_module``: the module's own parameters, then (once the trace is recorded) the queue
        advanced past them and what the prefetch budget allows of the trace ahead."""
        mod, params = hook.module, hook.module.params
        if params:
            self.gather(params, hook, False)
        if not hook.trace:
            return
        active, name = self.state.active, mod.name
        for p in params:
            active[p.name].add(name)
        if self.state.order is not None:
            if params:
                self.advance(params)
            self.prefetch(hook)
        self.step_id += 1

    def advance(self, params: tuple[ParamTensor, ...]) -> None:
        """Pop the queue's entries for the parameters this module fetches now (those not fetched for this
        position already)."""
        recent, step_id, queue = self.recent, self.step_id, self.queue
        due = sum(1 for p in params if recent.get(p.name, NEVER) < step_id)
        popped: set[str] = set()
        while queue and len(popped) < due:
            p, used = queue.popleft()
            recent[p.name] = used
            popped.add(p.name)

    def prefetch(self, hook: Hook) -> None:
        k, state, queue, recent = self.state.knobs, self.state, self.queue, self.recent
        if k.prefetch <= 0 or not queue:
            return
        budget, chosen, numel = min(k.max_live - state.n_available, k.prefetch), {}, 0
        available = state.available
        while queue and numel < budget:
            p, used = queue.popleft()
            name = p.name
            if recent.get(name, NEVER) < used:
                recent[name] = used
            if name not in available and name not in chosen:
                chosen[name] = p
                numel += p.numel
        if chosen:
            self.gather(tuple(chosen.values()), hook, True)

    def release(self, hook: Hook) -> None:
        """``release_sub_module``: the module's parameters no other active module holds, unless reused soon
        (``__params_to_release``); hpZ keeps a secondary partition of each."""
        state, mod = self.state, hook.module
        if hook.leftover:
            released = frozenset(p.name for p in mod.params if p.name not in state.persistent)
        elif state.order is not None:
            released = _to_release(state, mod, self.step_id, self.recent)
        else:
            released = frozenset(p.name for p in mod.params)
        active, available, name = state.active, state.available, mod.name
        for p in mod.params:
            owners = active[p.name]
            owners.discard(name)
            if not owners and p.name in released and p.name in available:
                available.discard(p.name)
                state.n_available -= p.numel
                if state.hpz:
                    state.secondary.add(p.name)


@dataclass(frozen=True, slots=True)
class _Trace:
    """The recorded trace indexed for ``__params_to_release``'s look-ahead: the elements of the trace before
    each position, and the positions at which each parameter is used."""

    starts: tuple[int, ...]
    """``starts[i]``: the elements of the modules at positions ``0 .. i - 1`` (one more entry than modules)."""
    uses: dict[str, list[int]]

    @classmethod
    def of(cls, order: list[Module]) -> _Trace:
        starts: list[int] = [0]
        uses: dict[str, list[int]] = collections.defaultdict(list)
        for i, mod in enumerate(order):
            starts.append(starts[-1] + sum(p.numel for p in mod.params))
            for p in mod.params:
                if not uses[p.name] or uses[p.name][-1] != i:
                    uses[p.name].append(i)
        return cls(tuple(starts), dict(uses))

    def reused(self, name: str, step_id: int, reuse: int) -> bool:
        """Whether the modules the look-ahead traverses from ``step_id`` use ``name``: those at positions
        ``step_id, step_id + 1, ...`` while fewer than ``reuse`` elements lie before them (from ``step_id``)."""
        if step_id >= len(self.starts) - 1:
            return False
        end = bisect.bisect_left(self.starts, self.starts[step_id] + reuse, lo=step_id)
        at = self.uses.get(name, ())
        i = bisect.bisect_left(at, step_id)
        return i < len(at) and at[i] < end


def _to_release(state: _State, mod: Module, step_id: int, recent: dict[str, int]) -> frozenset[str]:
    """``__params_to_release``, cached by module and trace position for the rest of the run (as
    DeepSpeed's ``lru_cache`` does): the module's parameters, less the persistent ones, those fetched for a
    later position, and those the trace uses again within ``stage3_max_reuse_distance`` elements."""
    key = (mod.name, step_id)
    if key not in state.release_cache:
        assert state.order is not None
        reuse = state.knobs.reuse
        if state.trace is None and reuse > 0:
            state.trace = _Trace.of(state.order)
        trace = state.trace
        state.release_cache[key] = frozenset(
            p.name
            for p in mod.params
            if p.name not in state.persistent
            and recent.get(p.name, NEVER) <= step_id
            and not (trace is not None and trace.reused(p.name, step_id, reuse))
        )
    return state.release_cache[key]
