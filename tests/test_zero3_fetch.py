"""ZeRO-3's parameter coordinator, replayed (``commgate.model.schemes.zero3_fetch``): the module trace is
DeepSpeed's, the knobs do what DeepSpeed's code does with them, and real runs reconcile under DeepSpeed's
defaults and under drawn knobs, for ZeRO-3 and ZeRO++."""

from __future__ import annotations

from pathlib import Path

import pytest
from commgate.judge.reconcile import reconcile
from commgate.model.expectation import Context
from commgate.model.loader import load_text
from commgate.model.predict import predict
from commgate.model.schemes.zero3_fetch import DEFAULTS, INERT, knobs, module_tree, pass_hooks, passes, persistent

# The module order DeepSpeed 0.19.8's coordinator recorded for the built-in decoder (L=2), read from
# PartitionedParameterCoordinator.__submodule_order after two steps (one rank, gloo).
LAYER = "layers.{i} layers.{i}.input_norm layers.{i}.attention layers.{i}.attention.qkv layers.{i}.attention.dense " \
    "layers.{i}.post_attention_norm layers.{i}.mlp layers.{i}.mlp.fc_in layers.{i}.mlp.fc_out"  # fmt: skip
FORWARD = "root embed embed.word embed.position " + " ".join(LAYER.format(i=i) for i in (0, 1)) + " final_norm head"
BACKWARD_TAIL = "embed embed.position embed.word"


def backward_layer(i: int, checkpointed: bool) -> str:
    head = f"layers.{i} layers.{i}.mlp layers.{i}.mlp.fc_out"
    recompute = " " + LAYER.format(i=i) if checkpointed else ""
    rest = (
        f"layers.{i}.mlp.fc_in layers.{i}.post_attention_norm layers.{i}.attention layers.{i}.attention.dense "
        f"layers.{i}.attention.qkv layers.{i}.input_norm"
    )
    return f"{head}{recompute} {rest}"


def scenario(model: str, par: str = "", ds: str = "{}", steps: int = 3) -> str:
    return (
        f"schema_version: 1\nname: z\nmodel: {model}\nparallelism: {{scheme: zero3, dp: 2{par}}}\n"
        f"steps: {steps}\nwarmup_steps: 0\ndeepspeed: {{zero_optimization: {ds}}}\n"
    )


SMALL = "{L: 2, h: 16, a: 2, V: 64, s: 16, x: 2}"


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointing"])
def test_the_module_trace_is_deepspeeds(checkpointed: bool) -> None:
    (s,) = load_text(scenario(SMALL, f", activation_checkpointing: {str(checkpointed).lower()}"))
    hooks = pass_hooks(module_tree(Context(scenario=s).params), checkpointed=checkpointed)
    traced = " ".join(h.module.name or "root" for h in hooks if h.fetch and h.trace)
    backward = " ".join(["root head final_norm", backward_layer(1, checkpointed), backward_layer(0, checkpointed)])
    assert traced == f"{FORWARD} {backward} {BACKWARD_TAIL}"


def test_inert_knobs_gather_every_module_in_each_forward_and_backward() -> None:
    (s,) = load_text(scenario(SMALL, ds=str(INERT).replace("'", "")))
    ctx = Context(scenario=s)
    assert knobs(ctx).inert
    owners = {p.name.rsplit(".", 1)[0] for p in ctx.params}
    for gathers in passes(ctx, 3):
        assert sum(1 for g in gathers if not g.backward) == len(owners)
        assert sum(1 for g in gathers if g.backward) == len(owners)
        assert not any(g.prefetch for g in gathers)


def test_deepspeed_defaults_keep_a_small_model_gathered() -> None:
    (s,) = load_text(scenario(SMALL).replace("deepspeed: {zero_optimization: {}}\n", ""))
    ctx = Context(scenario=s)
    assert knobs(ctx) == knobs(ctx).__class__(
        prefetch=DEFAULTS["stage3_prefetch_bucket_size"],
        max_live=DEFAULTS["stage3_max_live_parameters"],
        reuse=DEFAULTS["stage3_max_reuse_distance"],
        persistence=DEFAULTS["stage3_param_persistence_threshold"],
        model_persistence=DEFAULTS["stage3_model_persistence_threshold"],
    )
    # every tensor is below 1e5 elements: persistent, gathered in the recording pass only
    assert persistent(ctx.params, knobs(ctx)) == {p.name for p in ctx.params}
    first, *later = passes(ctx, 3)
    assert first and not any(later)


def test_prefetch_and_reuse_gather_each_parameter_once_a_pass() -> None:
    (s,) = load_text(scenario(SMALL, ds="{stage3_param_persistence_threshold: 0}"))
    ctx = Context(scenario=s)
    first, *later = passes(ctx, 3)
    assert len(first) > 2
    for gathers in later:
        # the model's fetch (no parameters of its own) prefetches everything within 5e7 elements; all of
        # it is reused in the backward, which then gathers nothing
        (g,) = gathers
        assert g.prefetch and not g.backward and {p.name for p in g.params} == {p.name for p in ctx.params}


def test_a_live_limit_bounds_the_prefetch() -> None:
    def prefetched(ds: str) -> list[int]:
        (s,) = load_text(scenario(SMALL, ds=ds))
        return [sum(p.numel for p in g.params) for g in passes(Context(scenario=s), 2)[1] if g.prefetch]

    unlimited = prefetched("{stage3_param_persistence_threshold: 0}")
    limited = prefetched("{stage3_param_persistence_threshold: 0, stage3_max_live_parameters: 3000}")
    # a prefetch stops once it passes what may still go live (3000 less what is gathered): by less than
    # one parameter (the largest has 64 x 16 elements)
    assert max(limited) < max(unlimited) and all(n < 3000 + 64 * 16 for n in limited)


def test_the_named_term_carries_the_difference_to_eq3() -> None:
    (s,) = load_text(scenario(SMALL, ds="{stage3_param_persistence_threshold: 0}"))
    p = predict(s)
    (term,) = [r for r in p.residuals if r.name == "ZeRO-3 prefetch, reuse and persistence"]
    assert term.bytes < 0  # the backward's gathers are saved
    assert all(c.unexplained_bytes == 0 for c in p.comparison())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("hpz", [False, True], ids=["zero3", "hpz"])
def test_the_shared_recording_pass_is_each_scenarios_own(tied: bool, hpz: bool) -> None:
    """The built-in decoder's recording pass is replayed once and shared by scenarios whose knobs differ
    (``_builtin_recording``): it is what each scenario's own replay from nothing gathered gives, and the
    state it leaves (the persistent parameters kept by the leftovers' release) is each one's own."""
    from commgate.model.schemes import zero3_fetch as z

    model = SMALL.replace("}", f", tied_embeddings: {str(tied).lower()}}}")
    knobs_drawn = ["{}", "{stage3_param_persistence_threshold: 0}", "{stage3_param_persistence_threshold: 300}"]
    for ds in knobs_drawn:
        text = scenario(model, ", activation_checkpointing: true, micro_batches: 2", ds)
        if hpz:
            text = text.replace("scheme: zero3, dp: 2", "scheme: zero++, dp: 4, zero: {hpz: 2}")
        (s,) = load_text(text)
        ctx = Context(scenario=s)
        k = knobs(ctx)
        own = z._State(knobs=k, persistent=persistent(ctx.params, k), hpz=hpz)
        if hpz:
            own.secondary = {p.name for p in ctx.params}
        first, _ = z.hooks(ctx)
        expected = z._one_pass(own, first)
        shared = z._State(knobs=k, persistent=own.persistent, hpz=hpz)
        if hpz:
            shared.secondary = {p.name for p in ctx.params}
        assert z._recording_pass(ctx, shared, first) == expected
        assert z._key(shared) == z._key(own)
        assert passes(ctx, 1)[0] == expected
    assert z._builtin_recording.cache_info().hits >= len(knobs_drawn) - 1


@pytest.mark.parametrize(
    ("model", "par", "ds"),
    [
        (SMALL, "", "{}"),
        (SMALL, ", activation_checkpointing: true, micro_batches: 2", "{stage3_param_persistence_threshold: 0}"),
        (
            "{L: 2, h: 16, a: 2, V: 64, s: 16, x: 2}",
            ", activation_checkpointing: true",
            "{stage3_param_persistence_threshold: 0, stage3_prefetch_bucket_size: 600, stage3_max_reuse_distance: 0}",
        ),
        (
            "{L: 2, h: 32, a: 4, V: 128, s: 16, tied_embeddings: true}",
            ", activation_checkpointing: true",
            "{stage3_param_persistence_threshold: 0, stage3_prefetch_bucket_size: 3000, "
            "stage3_max_live_parameters: 20000, stage3_max_reuse_distance: 5000}",
        ),
        (
            "{architecture: llama, kv_heads: 1, L: 2, h: 16, a: 2, V: 64, s: 16}",
            ", activation_checkpointing: true, micro_batches: 2",
            "{stage3_param_persistence_threshold: 100, stage3_prefetch_bucket_size: 1000, "
            "stage3_max_reuse_distance: 2000}",
        ),
        (
            "{L: 2, h: 32, a: 4, V: 128, s: 16}",
            ", dp: 4, zero: {hpz: 2}, micro_batches: 2",
            "{stage3_param_persistence_threshold: 500, stage3_prefetch_bucket_size: 2000, "
            "stage3_max_reuse_distance: 3000}",
        ),
        (  # persistent biases kept across passes: reset_step's zeroed live count lets the prefetch take more
            "{L: 3, h: 16, a: 2, V: 256, s: 64, x: 4, position: rotary}",
            ", dp: 3, micro_batch: 2, micro_batches: 2, activation_checkpointing: true",
            "{stage3_param_persistence_threshold: 100, stage3_prefetch_bucket_size: 3000, "
            "stage3_max_live_parameters: 2000, stage3_max_reuse_distance: 1000}",
        ),
    ],
    ids=[
        "defaults",
        "reuse-checkpointing-m2",
        "prefetch-no-reuse",
        "tied-live-limit",
        "llama-mixed",
        "zeropp-mixed",
        "live-count-reset",
    ],
)
def test_real_runs_reconcile_under_the_coordinators_knobs(model: str, par: str, ds: str, tmp_path: Path) -> None:
    from commgate.run.launcher import launch_local

    text = scenario(model, par, ds).replace("dp: 2, dp: ", "dp: ")
    if "hpz" in par:
        text = text.replace("scheme: zero3, dp: 4", "scheme: zero++, dp: 4")
    (s,) = load_text(text)
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted


LAYERED = [  # (preset or model, tied, checkpointed, hpz)
    ("{preset: 1.3B}", False, True, False),
    ("{preset: 1.3B}", True, False, False),
    ("{preset: 125M}", True, True, True),
    ("{architecture: llama, kv_heads: 1, L: 5, h: 16, a: 2, V: 64, s: 16}", False, True, True),
    ("{L: 3, h: 16, a: 2, V: 256, s: 64, x: 4, position: rotary}", True, False, False),
]


def _layered(model: str, tied: bool, checkpointed: bool, hpz: bool) -> Context:
    model = model.replace("}", f", tied_embeddings: {str(tied).lower()}}}")
    text = scenario(model, f", activation_checkpointing: {str(checkpointed).lower()}")
    if hpz:
        text = text.replace("scheme: zero3, dp: 2", "scheme: zero++, dp: 4, zero: {hpz: 2}")
    (s,) = load_text(text)
    return Context(scenario=s)


@pytest.mark.parametrize(("model", "tied", "checkpointed", "hpz"), LAYERED)
def test_each_layers_hooks_are_the_first_layers_with_its_own_modules(
    model: str, tied: bool, checkpointed: bool, hpz: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pass_hooks`` copies the first layer's hooks to the other alike layers (``HookList.runs``): the list
    is the one the recursive walk of every layer makes, module for module."""
    from commgate.model.schemes import zero3_fetch as z

    params = _layered(model, tied, checkpointed, hpz).params
    root = module_tree(params)
    external = tuple(p for p in params if p.name == "embed.word.weight") if tied else ()
    copied = pass_hooks(root, checkpointed=checkpointed, external=external)
    assert len(copied.runs) == 2 and all(len(r.layers) >= 3 for r in copied.runs)
    monkeypatch.setattr(z, "layers_of", lambda root: None)  # every layer walked
    walked = pass_hooks(root, checkpointed=checkpointed, external=external)
    assert not walked.runs
    assert list(copied) == list(walked)
    assert all(a.module is b.module for a, b in zip(copied, walked, strict=True) if a.module.name)  # not the root's


def test_layers_that_differ_are_not_alike() -> None:
    from dataclasses import replace

    from commgate.model.schemes import zero3_fetch as z

    root = module_tree(_layered("{L: 3, h: 16, a: 2, V: 64, s: 16}", False, False, False).params)
    assert z.layers_of(root) is not None
    layers = list(root.children)
    third = next(i for i, m in enumerate(layers) if m.name == "layers.2")
    norm = next(c for c in layers[third].children if c.name.endswith("input_norm"))
    shorter = replace(norm, params=norm.params[:1])  # layer 2's norm without its bias
    kids = tuple(shorter if c is norm else c for c in layers[third].children)
    layers[third] = replace(layers[third], children=kids)
    assert z.layers_of(replace(root, children=tuple(layers))) is None


@pytest.mark.parametrize(("model", "tied", "checkpointed", "hpz"), LAYERED)
def test_the_recording_pass_repeats_the_first_layer_as_a_replay_of_every_layer_does(
    model: str, tied: bool, checkpointed: bool, hpz: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recording pass replays the first layer of each run and repeats it for the others (``_Pass.repeat``):
    the same gathers, in the same order, and the same state after it as a replay of every hook; and where the
    layers do not start alike (one layer's parameter already gathered), every layer is replayed."""
    from commgate.model.schemes import zero3_fetch as z

    ctx = _layered(model, tied, checkpointed, hpz)
    first, _ = z.hooks(ctx)
    assert isinstance(first, z.HookList) and first.layers is not None
    hooks = first[: z._leftovers_from(first)]
    fetched = 0
    fetch = z._Pass.fetch

    def counted(self: z._Pass, hook: object) -> None:
        nonlocal fetched
        fetched += 1
        fetch(self, hook)  # type: ignore[arg-type]

    monkeypatch.setattr(z._Pass, "fetch", counted)

    def start(gathered: set[str]) -> z._State:
        state = z._State(knobs=knobs(ctx), persistent=frozenset(), hpz=hpz)
        state.secondary = {p.name for p in ctx.params} if hpz else set()
        state.available = set(gathered)
        return state

    one_layer = next(p.name for p in ctx.params if p.name.startswith("layers.1."))
    counts = []
    for gathered in (set(), {one_layer}):
        replayed, repeated = start(gathered), start(gathered)
        every = z._one_pass(replayed, hooks)
        every_fetched, fetched = fetched, 0
        assert z._one_pass(repeated, hooks, first.runs, first.layers) == every
        assert z._key(repeated) == z._key(replayed) and repeated.n_available == replayed.n_available
        counts.append(fetched / every_fetched)
        fetched = 0
    # alike, the first layer of each run replayed; not (the forward's layers), the forward replayed whole
    assert counts[0] < 0.5 and counts[0] < counts[1] < 1


def test_a_first_layer_that_ends_otherwise_than_it_started_is_not_repeated() -> None:
    """Where the first layer of a run leaves a parameter held (its release removed from every layer's hooks)
    or partitioned otherwise (hpZ's secondary partitions made by its releases), the other layers are
    replayed, not repeated: the gathers and the state are a replay of every hook's."""
    from commgate.model.schemes import zero3_fetch as z

    ctx = _layered("{L: 4, h: 16, a: 2, V: 64, s: 16}", False, True, True)
    first, _ = z.hooks(ctx)
    assert isinstance(first, z.HookList) and first.layers is not None
    hooks = first[: z._leftovers_from(first)]
    kept = [i for i, h in enumerate(hooks) if not h.fetch and not h.backward and h.module.name.endswith("mlp.fc_in")]
    assert len(kept) == 4
    fewer = [h for i, h in enumerate(hooks) if i not in kept]  # fc_in's forward release never fires
    forward, backward = first.runs
    runs = (
        z.Run(forward.start, forward.length - 1, forward.layers),
        z.Run(backward.start - 4, backward.length, backward.layers),
    )

    fc_in = {p.name for p in ctx.params if ".mlp.fc_in." in p.name}

    def start(secondary: bool, gathered: set[str]) -> z._State:
        state = z._State(knobs=knobs(ctx), persistent=frozenset(), hpz=True)
        state.secondary = {p.name for p in ctx.params} if secondary else set()
        state.available = set(gathered)
        return state

    # held and gathered; held, gathered before (alike) and after, up to the forward's end (the backward's
    # releases would let go of it); partitioned by the releases
    for case, runs_of, secondary, gathered in (
        (fewer, runs, True, set()),
        (fewer[: runs[0].end], runs[:1], True, fc_in),
        (hooks, first.runs, False, set()),
    ):
        replayed, repeated = start(secondary, gathered), start(secondary, gathered)
        assert z._one_pass(repeated, case, runs_of, first.layers) == z._one_pass(replayed, case)
        assert z._key(repeated) == z._key(replayed)


def test_a_pass_is_tallied_once_per_padding() -> None:
    """``PassGathers.tally``: calls by kind and padded size, as counting the gathers gives, made once for each
    padding (the named terms' variants tally the recording pass they share again)."""
    from collections import Counter

    ctx = _layered("{L: 3, h: 16, a: 2, V: 64, s: 16}", False, True, True)
    recording, *_ = passes(ctx, 2)
    for over in (1, 4, 3):
        counted = Counter((g.backward, g.recompute, g.prefetch, g.secondary, g.padded(over)) for g in recording)
        assert recording.tally(over) == counted
        assert recording.tally(over) is recording.tally(over)
    assert recording.tally(1) != recording.tally(3)  # a 16-element bias padded to 18 over 3 partitions
