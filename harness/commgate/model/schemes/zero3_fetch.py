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
to the next, and returns each pass's gathers. Alike layers are not each replayed where that is exact: the
recording pass repeats the first layer's gathers (``_Pass.repeat``), and a later pass shifts one layer's
segment through the layers after it (``_Pass.periodic``).
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import sys
from dataclasses import dataclass, field, fields, replace
from typing import TypeVar

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


@dataclass(frozen=True, slots=True)
class Run:
    """Hooks that repeat layer by layer: one segment of ``length`` hooks a layer from ``start``, segment ``i``
    the first one's hooks with layer ``layers[i]``'s modules in place of layer ``layers[0]``'s."""

    start: int
    length: int
    layers: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.length * len(self.layers)


@dataclass(frozen=True, slots=True, eq=False)
class Layers:
    """The decoder's layers, when they are alike (the same modules, the same parameters' shapes): what a
    pass's hooks and the recording pass's gathers repeat layer by layer (``Run``)."""

    modules: tuple[tuple[Module, ...], ...]
    """Each layer's modules in pre-order (the layer's own module first)."""
    params: tuple[tuple[ParamTensor, ...], ...]
    """Each layer's parameters, in the order of its modules."""
    where: dict[int, tuple[int, int]]
    """A layer's module (by ``id``) -> its layer and its index in the layer's ``modules``."""
    index: dict[str, int]
    """A layer's parameter (by name) -> its index in its layer's ``params``."""
    names: frozenset[str]
    """Every layer's parameters."""


def _subtree(m: Module, out: list[Module]) -> list[Module]:
    out.append(m)
    for c in m.children:
        _subtree(c, out)
    return out


def layers_of(root: Module) -> Layers | None:
    """The root's layers (``layers.<i>`` children, in order) if there are two or more and they are alike:
    the same module names past their ``layers.<i>`` prefix, holding the same parameters (names past the
    prefix, shapes and kinds)."""
    found = [c for c in root.children if _is_layer(c)]
    if len(found) < 2:
        return None
    modules = [_subtree(c, []) for c in found]
    params = [[p for m in mods for p in m.params] for mods in modules]

    def look(i: int) -> tuple[list[object], ...]:
        cut = len(found[i].name)
        return (
            [m.name[cut:] for m in modules[i]],
            [len(m.params) for m in modules[i]],
            [p.name[cut:] for p in params[i]],
            [(p.shape, p.shard, p.block, p.expert, p.frozen) for p in params[i]],
        )

    first = look(0)
    if any(look(i) != first for i in range(1, len(found))):
        return None
    return Layers(
        modules=tuple(map(tuple, modules)),
        params=tuple(map(tuple, params)),
        where={id(m): (j, k) for j, mods in enumerate(modules) for k, m in enumerate(mods)},
        index={p.name: k for ps in params for k, p in enumerate(ps)},
        names=frozenset(p.name for ps in params for p in ps),
    )


class HookList(list[Hook]):
    """A pass's hooks, with where they repeat layer by layer (``runs``) and where the end-of-backward
    releases of leftovers begin (``leftovers_from``)."""

    runs: tuple[Run, ...] = ()
    layers: Layers | None = None
    leftovers_from: int | None = None


def pass_hooks(
    root: Module, *, checkpointed: bool, external: tuple[ParamTensor, ...] = (), layers: Layers | None = None
) -> HookList:
    """One forward and backward of the decoder, hook by hook. ``external``: parameters the model reads
    in its own forward (a tied output layer's word embedding) that the recorded trace does not list yet:
    gathered on the read, then the model's own. Alike layers (``layers_of``): each layer's hooks after the
    first layer's in each direction are the first's with its modules in place (``HookList.runs``; ``layers``:
    the root's, if known)."""
    out = HookList()
    owner = replace(root, params=root.params + external)
    table = layers if layers is not None else layers_of(root)
    segments: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    """In the forward (False) and the backward (True): the first layer's hooks (where they start and end)."""
    copies: dict[bool, list[tuple[int, tuple[object, ...]]]] = {}
    """The first layer's hooks as (index of the module in its layer, the hook's other fields)."""
    order: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    """The layers in the order their hooks come, and where each one's start, in the forward and the backward."""

    def layer(c: Module, backward: bool) -> None:
        """Layer ``c``'s hooks in the forward or the backward: the first layer's built, the others copied."""
        assert table is not None
        j, start = table.where[id(c)][0], len(out)
        if not segments[backward]:
            if backward:
                hooks_backward(c)
            else:
                forward(c, backward=False)
            segments[backward].append((start, len(out)))
            where = table.where
            copies[backward] = [(where[id(h.module)][1], tuple(h[1:])) for h in out[start:]]
        else:
            mods, make = table.modules[j], tuple.__new__
            out.extend([make(Hook, (mods[k], *rest)) for k, rest in copies[backward]])
        order[backward].append((j, start))

    def forward(m: Module, *, backward: bool, stop_at: Module | None = None) -> bool:
        """Pre-order fetches, post-order releases; False where a recompute stopped (no more hooks)."""
        out.append(Hook(m, True, backward, recompute=backward))
        if m is stop_at:
            return False
        for c in m.children:
            if table is not None and m is root and _is_layer(c):
                layer(c, False)
            elif not forward(c, backward=backward, stop_at=stop_at):
                return False
        if m is root and external:
            out.append(Hook(Module("", external), True, backward, trace=False, recompute=backward))
        out.append(Hook(owner if m is root else m, False, backward, recompute=backward))
        return True

    leftovers: list[Module] = []

    def hooks_backward(m: Module) -> None:
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
                    hooks_backward(c)
                out.append(Hook(parent, False, True))
            kids = kids[1:]
        for c in kids:
            if table is not None and m is owner and _is_layer(c):
                layer(c, True)
            else:
                hooks_backward(c)
        if m.name.startswith("embed") or not m.name:
            leftovers.append(m)  # its input needs no gradient: its backward release never fires
        else:
            out.append(Hook(m, False, True))

    forward(root, backward=False)
    hooks_backward(owner)
    out.leftovers_from = len(out)
    out += [Hook(m, False, True, leftover=True) for m in reversed(leftovers)]
    out.layers = table
    runs = []
    for b in (False, True):
        if len(order[b]) < 2:
            continue
        start, end = segments[b][0]
        length = end - start
        if all(at == start + i * length for i, (_, at) in enumerate(order[b])):
            runs.append(Run(start, length, tuple(j for j, _ in order[b])))
    out.runs = tuple(runs)
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

    def moved(self, params: tuple[ParamTensor, ...]) -> Gather:
        """This call with other parameters of the same sizes (another layer's): made without summing them,
        its fields set through their slots (a frozen dataclass's ``__init__`` costs twice as much)."""
        out = object.__new__(Gather)
        params_, backward, prefetch, recompute, secondary, numel = _SETTERS
        params_(out, params)
        backward(out, self.backward)
        prefetch(out, self.prefetch)
        recompute(out, self.recompute)
        secondary(out, self.secondary)
        numel(out, self.numel)
        return out

    def padded(self, over: int) -> int:
        """Elements gathered, each parameter padded to a multiple of ``over`` (its partitions)."""
        return self.numel if over == 1 else sum(padded(p.numel, over) for p in self.params)


Kind = tuple[bool, bool, bool, bool, int]
"""A gather's kind and size: backward, recompute, prefetch, secondary, elements padded."""


class PassGathers(list[Gather]):
    """One pass's gathers, with their tallies (``tally``) kept once made: the named terms' variants of a
    scenario tally the same pass again (the recording pass they share, one or both paddings)."""

    __slots__ = ("_tallies",)

    def tally(self, over: int) -> collections.Counter[Kind]:
        """Calls by kind and size, each parameter padded to a multiple of ``over``. Made once per ``over``:
        a pass's gathers are final once it is replayed."""
        tallies: dict[int, collections.Counter[Kind]] = getattr(self, "_tallies", None) or {}
        if over not in tallies:
            counts: collections.Counter[Kind] = collections.Counter()
            for g in self:
                counts[g.backward, g.recompute, g.prefetch, g.secondary, g.padded(over)] += 1
            tallies[over] = counts
            self._tallies = tallies
        return tallies[over]


_SETTERS = tuple(Gather.__dict__[f.name].__set__ for f in fields(Gather))
"""Each field's slot setter, in field order (``Gather.moved``)."""
assert [f.name for f in fields(Gather)] == ["params", "backward", "prefetch", "recompute", "secondary", "numel"]


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
    queued: tuple[tuple[ParamTensor, int], ...] | None = None
    """``order``'s parameters with their positions, the queue a pass starts with (made at its first use)."""
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
def _builtin_layers(params: tuple[ParamTensor, ...]) -> Layers | None:
    return layers_of(module_tree(params))


@functools.cache
def _builtin_hooks(params: tuple[ParamTensor, ...], checkpointed: bool, tied: bool) -> tuple[HookList, HookList]:
    root = module_tree(params)
    table = _builtin_layers(params)
    if not tied:
        only = pass_hooks(root, checkpointed=checkpointed, layers=table)
        return only, only
    external = tuple(p for p in params if p.name == "embed.word.weight")
    first = pass_hooks(root, checkpointed=checkpointed, external=external, layers=table)
    later = pass_hooks(replace(root, params=external), checkpointed=checkpointed, layers=table)
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


def passes(ctx: Context, steps: int) -> list[PassGathers]:
    """The coordinator's gathers in each forward-and-backward pass of the first ``steps`` steps (m passes
    a step; the optimizer's re-gathering of the persistent parameters after each step not included)."""
    return _passes(ctx.scenario, steps)


@functools.lru_cache(maxsize=64)
def _passes(scenario: Scenario, steps: int) -> list[PassGathers]:
    ctx = Context(scenario=scenario)
    par = scenario.parallelism
    k = knobs(ctx)
    state = _State(knobs=k, persistent=persistent(ctx.params, k), hpz=par.zero.hpz > 1)
    if state.hpz:  # the engine's initial partitioning made every parameter's secondary partition
        state.secondary = {p.name for p in ctx.params}
    first, later = hooks(ctx)
    out: list[PassGathers] = []
    seen: dict[tuple[object, ...], tuple[PassGathers, _State]] = {}
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
            out.append(_one_pass(state, later, *_repeats(later)))
            if len(state.release_cache) == key[3]:
                seen[key] = (out[-1], _snapshot(state))
    return out


def _recording_pass(ctx: Context, state: _State, first: list[Hook]) -> PassGathers:
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


def _repeats(hooks: list[Hook]) -> tuple[tuple[Run, ...], Layers | None]:
    """Where a pass's hooks repeat layer by layer, and the layers (none known for a plain list)."""
    return (hooks.runs, hooks.layers) if isinstance(hooks, HookList) else ((), None)


def _leftovers_from(hooks: list[Hook]) -> int:
    """Where the end-of-backward releases of leftovers begin (they close the pass)."""
    if isinstance(hooks, HookList) and hooks.leftovers_from is not None:
        return hooks.leftovers_from
    cut = len(hooks)
    while cut and hooks[cut - 1].leftover:
        cut -= 1
    assert not any(h.leftover for h in hooks[:cut]), "leftover releases only close a pass"
    return cut


@functools.lru_cache(maxsize=64)
def _builtin_recording(
    params: tuple[ParamTensor, ...], checkpointed: bool, tied: bool, hpz: bool
) -> tuple[PassGathers, _State]:
    """The built-in decoder's recording pass up to the releases of leftovers: its gathers and the state it
    leaves (the same under any knobs)."""
    first, _ = _builtin_hooks(params, checkpointed, tied)
    unused = Knobs(prefetch=0, max_live=0, reuse=0, persistence=0, model_persistence=0)
    state = _State(knobs=unused, persistent=frozenset(), hpz=hpz)
    if hpz:
        state.secondary = {p.name for p in params}
    return _one_pass(state, first[: _leftovers_from(first)], first.runs, first.layers), state


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


def _one_pass(
    state: _State, hooks: list[Hook], runs: tuple[Run, ...] = (), layers: Layers | None = None
) -> PassGathers:
    """One pass of ``hooks`` from ``state``; ``runs``: where they repeat layer by layer (of ``layers``)."""
    # reset_step zeroes the count of gathered elements after every pass, whatever stays gathered (the
    # persistent parameters, what a release kept): the prefetch's live budget counts this pass's only
    state.n_available = 0
    return _Pass(state).run(hooks, runs, layers)


NEVER = -(10**10)
"""The trace position a parameter not fetched yet in this pass was last fetched for."""


@dataclass
class _Pass:
    """One forward-and-backward pass of the coordinator from ``state``: its gathers, the recorded trace
    still ahead (``__param_queue``), where each parameter was last fetched for
    (``__most_recent_step_id_param_fetched_for``; absent: ``NEVER``) and the trace position (``__step_id``)."""

    state: _State
    gathers: PassGathers = field(default_factory=PassGathers)
    queue: collections.deque[tuple[ParamTensor, int]] = field(init=False)
    recent: dict[str, int] = field(default_factory=dict)
    step_id: int = 0

    def __post_init__(self) -> None:
        state = self.state
        if state.order is not None and state.queued is None:
            state.queued = tuple([(p, i) for i, mod in enumerate(state.order) for p in mod.params])
        self.queue = collections.deque(state.queued or ())

    def run(self, hooks: list[Hook], runs: tuple[Run, ...] = (), layers: Layers | None = None) -> PassGathers:
        done = 0
        if layers is not None:  # the recording pass: see ``repeat``; a later one: ``periodic``
            through = self.repeat if self.state.order is None else self.periodic
            for r in runs:
                self.hooks(hooks[done : r.start])
                done = through(hooks, r, layers)
        return self.hooks(hooks[done:])

    def repeat(self, hooks: list[Hook], r: Run, layers: Layers) -> int:
        """The recording pass through a run of alike layers, where it ends. Until the trace is complete a
        fetch gathers its module's parameters and a release releases them, and neither reads the trace:
        a layer's hooks touch only that layer's parameters. So where every layer's parameters start alike
        (gathered, held and partitioned alike) and the first layer's end as they started (all released),
        each other layer makes the first one's gathers with its own parameters and leaves the state as it
        was: the first layer is replayed, and the others repeat its gathers (the trace position, read only
        once the trace is complete, is not advanced past them). Anything else: every layer replayed."""
        state, own, index = self.state, layers.params[r.layers[0]], layers.index
        if not self._alike(layers):
            self.hooks(hooks[r.start : r.end])
            return r.end
        before = self._look(own)
        g0 = len(self.gathers)
        self.hooks(hooks[r.start : r.start + r.length])
        template = self.gathers[g0:]
        if self._look(own) != before or any(state.active.get(p.name) for p in own):
            self.hooks(hooks[r.start + r.length : r.end])
            return r.end
        at = [(g, [index[q.name] for q in g.params]) for g in template]
        for j in r.layers[1:]:
            theirs = layers.params[j]
            self.gathers.extend(g.moved(tuple([theirs[k] for k in ks])) for g, ks in at)
        return r.end

    def periodic(self, hooks: list[Hook], r: Run, layers: Layers) -> int:
        """A pass with the trace complete through a run of alike layers, where it ends. The run's segments are
        one layer's hooks copied, and the trace's positions and elements repeat with them: a segment does to
        its layer, and to the layers ahead it prefetches or looks ahead to, what the segment before did to
        its own, shifted by a layer, where it starts from that segment's state shifted by a layer and reads
        nothing past the run. So where segment ``i`` ends in the state it started from, shifted by a layer
        (``_seen``: every layer from ``i`` on), the segments after it are the shift of it, their gathers, the
        release cache they fill and the state they leave (``_Segment.shifts``, ``_place``), up to where what
        they read would leave the run; the rest is replayed. Tried on the first ``TRIES`` segments after the
        first; anything else is replayed."""
        n, length, start = len(r.layers), r.length, r.start
        traced = [h for h in hooks[start : start + length] if h.fetch and h.trace]
        shape = _shape(layers, r, len(traced), sum(len(h.module.params) for h in traced))
        done = start
        if n >= 4 and shape.alike(self.state.persistent):
            first = self.step_id
            fresh = self._rows(shape, 0, 0, n)
            free = [all(o is None and u is None for _, _, o, u in row) for row in fresh]
            self.hooks(hooks[start : start + length])
            done += length
            before = self._seen(shape, fresh, free, first, frame=1, lo=1)
            for i in range(1, min(n - 1, 1 + TRIES)):
                if before is None or self.queue[0][1] < first:
                    break
                counted, left = self.state.n_available, len(self.queue)
                segment = _Segment.replay(self, hooks[done : done + length], shape, i)
                done += length
                after = self._seen(shape, fresh, free, first, frame=i + 1, lo=i)
                if (
                    segment is not None
                    and after is not None
                    and after[1:] == before[:-1]
                    and left - len(self.queue) == shape.entries
                ):
                    grew = self.state.n_available - counted
                    ahead = (first + n * shape.positions - segment.reach) // shape.positions
                    most = min(n - 1 - i, ahead, segment.budgeted(self.state.knobs, grew))
                    if shifted := segment.shifts(self, shape, most):
                        self._place(shape, after, fresh, i, i + 1 + shifted, first)
                        self.state.n_available += shifted * grew
                        done += shifted * length
                        break
                before = None if after is None else after[1:]
        self.hooks(hooks[done : r.end])
        return r.end

    def _rows(self, shape: _Shape, frame: int, lo: int, hi: int) -> list[tuple[_Row, ...]]:
        """Layers ``lo .. hi - 1`` of the run as segment ``frame`` sees them (``_Row``)."""
        state, recent, mslot = self.state, self.recent, shape.mslot
        available, secondary, active = state.available, state.secondary, state.active
        base = self.step_id
        out: list[tuple[_Row, ...]] = []
        for names in shape.names[lo:hi]:
            row: list[_Row] = []
            for name in names:
                owners = active.get(name)
                held = (
                    frozenset((mslot[o][0] - frame, mslot[o][1]) if o in mslot else o for o in owners)
                    if owners
                    else None
                )
                used = recent.get(name)
                row.append(
                    (name in available, name in secondary, held, None if used is None or used < base else used - base)
                )
            out.append(tuple(row))
        return out

    def _seen(
        self, shape: _Shape, fresh: list[tuple[_Row, ...]], free: list[bool], first: int, *, frame: int, lo: int
    ) -> list[tuple[_Row, ...]] | None:
        """Layers ``lo ..`` of the run as segment ``frame`` (about to start) sees them: those the pass has
        reached since the run began (its own hooks, the prefetch and the queue up to its front) read now, the
        others as they were where it began (``fresh``), if those are the same seen from any segment; else
        None."""
        if not self.queue:
            return None
        reached = self._reached(shape, first, frame)
        if not all(free[reached + 1 :]):
            return None
        return self._rows(shape, frame, lo, reached + 1) + fresh[max(lo, reached + 1) :]

    def _place(
        self, shape: _Shape, after: list[tuple[_Row, ...]], fresh: list[tuple[_Row, ...]], i: int, to: int, first: int
    ) -> None:
        """The state where segment ``to`` starts, segments ``i + 1 .. to - 1`` being the shift of segment ``i``:
        each layer they passed is as layer ``i`` was after segment ``i`` (``after[0]``), each layer from ``to``
        on as the layer ``to - i - 1`` layers before it was there (``after[1:]``), each seen from its own
        segment; the queue and the trace position moved on as many segments. A layer not reached yet is
        written only where it differs from how it was when the run began (``fresh``)."""
        state, recent, modules = self.state, self.recent, shape.modules
        available, secondary, active = state.available, state.secondary, state.active
        reached = self._reached(shape, first, i + 1)
        for y in range(i + 1, len(shape.names)):
            row, frame = (after[0], y + 1) if y < to else (after[1 + y - to], to)
            now = fresh[y] if y > reached else None
            if row == now:
                continue
            base = first + frame * shape.positions
            for k, (name, cell) in enumerate(zip(shape.names[y], row, strict=True)):
                if now is not None and cell == now[k]:
                    continue
                gathered, second, held, used = cell
                if gathered:
                    available.add(name)
                else:
                    available.discard(name)
                if second:
                    secondary.add(name)
                else:
                    secondary.discard(name)
                if held:
                    active[name] = {o if isinstance(o, str) else modules[frame + o[0]][o[1]] for o in held}
                else:
                    active.pop(name, None)
                if used is None:
                    recent.pop(name, None)
                else:
                    recent[name] = base + used
        for _ in range((to - i - 1) * shape.entries):
            self.queue.popleft()
        self.step_id = first + to * shape.positions

    def _reached(self, shape: _Shape, first: int, frame: int) -> int:
        """The last layer of the run the pass has reached where segment ``frame`` starts: its own hooks' and
        the queue's (the prefetch and the advance pop it in trace order), from the run's first position on."""
        return min(len(shape.names) - 1, max(frame - 1, (self.queue[0][1] - first) // shape.positions))

    def _look(self, params: tuple[ParamTensor, ...]) -> list[tuple[bool, bool]]:
        """Each parameter gathered or not, and with a secondary partition or not."""
        available, secondary = self.state.available, self.state.secondary
        return [(p.name in available, p.name in secondary) for p in params]

    def _alike(self, layers: Layers) -> bool:
        """Whether every layer's parameters are gathered and partitioned alike, and none is held."""
        state, names = self.state, layers.names
        if any(held and name in names for name, held in state.active.items()):
            return False
        available, secondary = state.available, state.secondary
        if available.isdisjoint(names) and (secondary.isdisjoint(names) or secondary.issuperset(names)):
            return True
        first = self._look(layers.params[0])
        return all(self._look(ps) == first for ps in layers.params[1:])

    def hooks(self, hooks: list[Hook]) -> PassGathers:
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
        missing = [p for p in ps if p.name not in available]
        if not missing:
            return
        todo = tuple(missing)
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

    def prefetch(self, hook: Hook) -> tuple[int, int] | None:
        """The trace ahead gathered up to the budget; the elements chosen and the last one's, if any."""
        state, queue = self.state, self.queue
        k = state.knobs
        budget = min(k.max_live - state.n_available, k.prefetch)
        if budget <= 0 or not queue:
            return None
        chosen: dict[str, ParamTensor] = {}
        numel, available, recent = 0, state.available, self.recent
        last = 0
        while queue and numel < budget:
            p, used = queue.popleft()
            name = p.name
            if recent.get(name, NEVER) < used:
                recent[name] = used
            if name not in available and name not in chosen:
                chosen[name] = p
                last = p.numel
                numel += last
        if chosen:
            self.gather(tuple(chosen.values()), hook, True)
        return numel, last

    def release(self, hook: Hook) -> None:
        """``release_sub_module``: the module's parameters no other active module holds, unless reused soon
        (``__params_to_release``); hpZ keeps a secondary partition of each."""
        state, mod = self.state, hook.module
        if hook.leftover:
            released = frozenset(p.name for p in mod.params if p.name not in state.persistent)
        elif state.order is not None:
            cached = state.release_cache.get((mod.name, self.step_id))
            released = _to_release(state, mod, self.step_id, self.recent) if cached is None else cached
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


_T = TypeVar("_T")

TRIES = 4
"""How many segments of a run ``_Pass.periodic`` tries as the one the rest repeat, before it replays them all."""

_Row = tuple[bool, bool, frozenset[tuple[int, int] | str] | None, int | None]
"""A parameter's state as a segment of its run sees it (``_Pass.periodic``): gathered, with a secondary
partition, the modules holding it (a layer's as its offset from the segment's layer and its index in the
layer; any other by name; None: none) and the trace position it was last fetched for, from the segment's
start (None: none at or after it, which every read of it takes as none at all)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Shape:
    """A run of alike layers, by position in the run: what ``_Pass.periodic`` reads a segment's state by."""

    params: tuple[tuple[ParamTensor, ...], ...]
    names: tuple[tuple[str, ...], ...]
    modules: tuple[tuple[str, ...], ...]
    slot: dict[str, tuple[int, int]]
    """A parameter's name -> its layer's position in the run, its index in the layer."""
    mslot: dict[str, tuple[int, int]]
    """A module's name -> its layer's position in the run, its index in the layer."""
    positions: int
    """Trace positions a segment."""
    entries: int
    """Entries of the trace's parameter queue a segment."""
    persistent: dict[frozenset[str], bool] = field(default_factory=dict)

    def alike(self, persistent: frozenset[str]) -> bool:
        """Whether the persistent parameters are the same ones in every layer."""
        if persistent not in self.persistent:
            first = [n in persistent for n in self.names[0]]
            self.persistent[persistent] = all([n in persistent for n in ns] == first for ns in self.names[1:])
        return self.persistent[persistent]


@functools.lru_cache(maxsize=64)
def _shape(layers: Layers, r: Run, positions: int, entries: int) -> _Shape:
    params = tuple(layers.params[j] for j in r.layers)
    modules = tuple(tuple(m.name for m in layers.modules[j]) for j in r.layers)
    return _Shape(
        params=params,
        names=tuple(tuple(p.name for p in ps) for ps in params),
        modules=modules,
        slot={p.name: (y, k) for y, ps in enumerate(params) for k, p in enumerate(ps)},
        mslot={m: (y, k) for y, ms in enumerate(modules) for k, m in enumerate(ms)},
        positions=positions,
        entries=entries,
    )


@dataclass(frozen=True, slots=True)
class _Segment:
    """Segment ``i`` of a run replayed (``_Pass.periodic``), with what a shift of it repeats: its gathers,
    its releases' look-ups in the release cache, each parameter and module as (layer offset from ``i``,
    index in its layer), and ``reach``, the trace position before which lies all it read."""

    i: int
    gathers: tuple[tuple[Gather, tuple[tuple[int, int], ...]], ...]
    looked: tuple[tuple[int, int, bool, tuple[tuple[int, int], ...]], ...]
    """Each key looked up (the module of the segment's layer, by index, and the trace position from the
    segment's start): found in the cache or not, what it released (the first look-up of each key)."""
    reach: int
    prefetches: tuple[tuple[int, tuple[int, int] | None], ...]
    """Each prefetch's count of gathered elements, and what it chose (``_Pass.prefetch``)."""

    @classmethod
    def replay(cls, p: _Pass, hooks: list[Hook], shape: _Shape, i: int) -> _Segment | None:
        """Segment ``i`` replayed; None where it touched a parameter outside the run."""
        state, slot, mslot = p.state, shape.slot, shape.mslot
        cache, base, made = state.release_cache, p.step_id, len(p.gathers)
        release, read = p.release, []

        def prefetch(hook: Hook) -> None:
            counted = state.n_available
            chose = _Pass.prefetch(p, hook)
            read.append((counted, chose))

        p.prefetch = prefetch  # type: ignore[method-assign]
        keys: list[tuple[tuple[str, int], bool]] = []
        try:
            for hook in hooks:
                if hook.fetch:
                    p.fetch(hook)
                elif hook.module.params:
                    key = (hook.module.name, p.step_id)
                    found = key in cache
                    release(hook)
                    keys.append((key, found))
        finally:
            del p.prefetch
        try:
            gathers = tuple(
                (g, tuple((slot[q.name][0] - i, slot[q.name][1]) for q in g.params)) for g in p.gathers[made:]
            )
            looked: dict[tuple[int, int], tuple[bool, tuple[tuple[int, int], ...]]] = {}
            for (name, at), found in keys:
                layer, k = mslot[name]
                released = tuple(sorted((slot[q][0] - i, slot[q][1]) for q in cache[name, at]))
                if layer != i:
                    return None  # another layer's module
                if (k, at - base) not in looked:
                    looked[k, at - base] = (found, released)
                elif not found or looked[k, at - base][1] != released:
                    return None  # a key looked up again, not as its first look-up left it
        except KeyError:
            return None
        reach = p.queue[0][1] + 1 if p.queue else sys.maxsize
        missed = [at for (_, at), found in keys if not found]
        if missed and state.trace is not None:
            reach = max(reach, state.trace.reach(max(missed), state.knobs.reuse))
        looks = tuple((k, where, found, released) for (k, where), (found, released) in looked.items())
        return cls(i, gathers, looks, max(reach, p.step_id), tuple(read))

    def budgeted(self, k: Knobs, grew: int) -> int:
        """How many shifts of this segment make each prefetch it made, where each segment leaves ``grew`` more
        elements gathered than it found: this pass's gathered elements count against
        ``stage3_max_live_parameters``, so the ``t``-th shift's budget is ``min(max_live - counted - t *
        grew, prefetch)`` where this one's read ``counted``. A prefetch that chose ``numel`` elements, the
        last of them ``last``, chooses the same under any budget above ``numel - last`` and up to ``numel``
        (it stops at the first choice that reaches the budget); one that found no budget, under none."""
        if grew == 0 or k.prefetch <= 0:
            return sys.maxsize
        most = sys.maxsize
        for counted, chose in self.prefetches:
            room = k.max_live - counted  # the budget before the bucket's cap
            if chose is None:  # no budget: it stays none while the count does not fall
                if grew < 0:
                    most = min(most, -room // -grew)
            elif grew > 0:  # the budget falls: it must stay above what came before the last choice
                most = min(most, (room - (chose[0] - chose[1]) - 1) // grew)
            elif k.prefetch > chose[0]:  # it rises: it must stay within what was chosen
                most = min(most, (chose[0] - room) // -grew)
        return most

    def shifts(self, p: _Pass, shape: _Shape, most: int) -> int:
        """The segments ``i + 1 .. i + most`` as shifts of this one, for as many as the release cache agrees
        with (each key found where this one's was, holding what this one's held shifted): their gathers and
        what they add to the cache made. How many. Segment by segment, a key is its layer's module and a
        position in the segment, so no two segments share one."""
        if most <= 0:
            return 0
        cache, step, first = p.state.release_cache, shape.positions, self.i + 1

        def across(table: tuple[tuple[_T, ...], ...], e: int, j: int, count: int) -> list[_T]:
            """Slot (``e``, ``j``) of this segment's frame in each of the next ``count`` segments'."""
            return [row[j] for row in table[first + e : first + e + count]]

        fits, added = most, []
        for k, where, found, released in self.looked:
            start = p.step_id + where
            keys = list(zip(across(shape.modules, 0, k, most), range(start, start + most * step, step), strict=True))
            columns = [across(shape.names, e, j, most) for e, j in released]
            values = list(map(frozenset, zip(*columns, strict=True))) if columns else [frozenset()] * most
            held = list(map(cache.get, keys))
            if found:
                fits = min(fits, next((t for t, (h, v) in enumerate(zip(held, values, strict=True)) if h != v), most))
            else:
                fits = min(fits, next((t for t, h in enumerate(held) if h is not None), most))
                added.append((keys, values))
        for keys, values in added:
            cache.update(zip(keys[:fits], values[:fits], strict=True))
        if fits and self.gathers:
            moved = [
                list(map(g.moved, zip(*[across(shape.params, e, j, fits) for e, j in ks], strict=True)))
                for g, ks in self.gathers
            ]
            p.gathers.extend(itertools.chain.from_iterable(zip(*moved, strict=True)))
        return fits


@dataclass(frozen=True, slots=True)
class _Trace:
    """The recorded trace indexed for ``__params_to_release``'s look-ahead: the elements of the trace before
    each position, and the positions at which each parameter is used."""

    starts: tuple[int, ...]
    """``starts[i]``: the elements of the modules at positions ``0 .. i - 1`` (one more entry than modules)."""
    uses: dict[str, list[int]]

    @classmethod
    def of(cls, order: list[Module]) -> _Trace:
        uses: dict[str, list[int]] = collections.defaultdict(list)
        for i, mod in enumerate(order):
            for p in mod.params:
                at = uses[p.name]
                if not at or at[-1] != i:
                    at.append(i)
        starts = itertools.accumulate([sum([p.numel for p in mod.params]) for mod in order], initial=0)
        return cls(tuple(starts), dict(uses))

    def reach(self, step_id: int, reuse: int) -> int:
        """The position before which lie the modules the look-ahead traverses from ``step_id``."""
        return bisect.bisect_left(self.starts, self.starts[step_id] + reuse, lo=step_id)

    def reused(self, name: str, step_id: int, reuse: int) -> bool:
        """Whether the modules the look-ahead traverses from ``step_id`` use ``name``: those at positions
        ``step_id, step_id + 1, ...`` while fewer than ``reuse`` elements lie before them (from ``step_id``)."""
        if step_id >= len(self.starts) - 1:
            return False
        end = self.reach(step_id, reuse)
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
