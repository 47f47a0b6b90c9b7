"""Hugging Face ``transformers.Trainer`` on commgate's ranks (trainer ``hf``): the job built as its user
builds it (``TrainingArguments`` with the user's DeepSpeed JSON, ``"auto"`` and all; the model from its
``config.json`` with ``AutoModelForCausalLM.from_config`` after them; ``Trainer``) and trained by
``Trainer.train()`` itself for ``warmup_steps + steps`` optimizer steps over random token ids, each step
labelled as commgate labels its own; then checked against the scenario (``verify``).

The workarounds a CPU gloo run needs (transformers 5.23.0, accelerate 1.15.0, DeepSpeed 0.19.8), each
tested in ``tests/test_hf.py`` so that the test fails when upstream changes:

* W1, the rank's environment: accelerate decides on a distributed run from ``LOCAL_RANK``/``WORLD_SIZE``
  in the environment, not from the process group (``accelerate/state.py:800-808``); without them Trainer
  trains undistributed, sending nothing. commgate's launcher sets them (``commgate.run.launcher``), and
  ``_environment`` for a rank started otherwise.
* W2, ``use_cpu``: without it a CPU-only host finds no accelerator and no backend (``state.py:800-815``):
  DDP silently unwrapped, DeepSpeed's batch size resolved for one rank. ``TrainingArguments(use_cpu=True)``
  (``commgate.model.trainers.hf.fixed_arguments``); it does not drop DeepSpeed, since Trainer builds its
  ``Accelerator`` without ``cpu`` (``trainer.py:741-746``).
* W3, ``ACCELERATE_USE_CPU=true`` in the environment (``accelerate launch --cpu``): accelerate forces
  ``cpu`` (``state.py:915-916``) and keeps DeepSpeed only without it (``state.py:974``), so the job runs as
  DDP. Not worked around, caught: ``verify`` fails the run, naming it (the user's job would drop it too).
* W4, ZeRO-3 under ``use_cpu``: accelerate's CPU path skips ``deepspeed.comm.init_distributed``
  (``state.py:201``, ``:209-215``), and ``deepspeed.zero.Init`` (entered by ``from_config``,
  ``modeling_utils.py:1435-1447``) then sizes the world as 1 (``deepspeed/runtime/config.py:456-472``).
  ``_join_deepspeed`` initialises DeepSpeed's comm, which adopts the capturing group (``comm/comm.py:878-881``).
* W5, an FSDP plugin under ``use_cpu`` is dropped silently (``AcceleratorState.__init__``,
  ``state.py:986-1016``, keeps it for GPU types only; the job would train as DDP): ``_keep_fsdp_plugin``
  wraps exactly that function, for the run only, and does on a ``MULTI_CPU`` rank what its GPU branch does
  (``state.py:1013-1016``: the type ``FSDP``, the plugin's mixed precision, the plugin kept; and ``:1037``,
  the type in ``PartialState``'s shared state too, which every later ``AcceleratorState()`` copies back:
  without it accelerate's ``no_sync`` and ``clip_grad_norm_`` take their non-FSDP paths). It patches
  only the source it was written against (``W5_SOURCE``, a digest of the function's source), else the run
  fails naming it; ``verify`` fails a run that used FSDP the scenario does not say, or lost it.
* W6, DeepSpeed's CPU ops are compiled on first use (minutes each): its shared-memory comm op
  (``comm/torch.py:207``; commgate's forkserver loads it, ``commgate.run.deepspeed_ops``), and a config
  optimizer's FusedAdam (``runtime/engine.py:2384-2409``) unless its params say ``"torch_adam": true``
  (``engine.py:2378-2382``), as the default suite's configs do.
* W7, step labels: Trainer fetches a step's micro-batches, and all-gathers their token count, before
  ``on_step_begin`` (``trainer.py:1873`` vs ``:1894``): the step begins in ``get_batch_samples``.

And the phases: Trainer's ``training_step`` runs DeepSpeed's ``engine.backward`` and ``engine.step`` after
autograd returns (``accelerate/utils/deepspeed.py:264-281``), labelled ``backward`` and ``optimizer`` as
commgate's own ZeRO workload labels them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from commgate.core.errors import CommgateError
from commgate.model.scenario import ITEMSIZE, Scenario
from commgate.model.schemes import SCHEMES
from commgate.model.trainers.hf import arguments, build, finite, path
from commgate.model.usermodule import describe
from commgate.run.interpose import phase
from commgate.run.steps import Steps

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _environment(rank: int, world_size: int) -> None:
    """W1: what accelerate reads to decide on a distributed CPU run, where the launcher did not set it."""
    for key, value in (
        ("RANK", rank),
        ("LOCAL_RANK", rank),
        ("WORLD_SIZE", world_size),
        ("LOCAL_WORLD_SIZE", world_size),
    ):
        os.environ.setdefault(key, str(value))


def _join_deepspeed() -> None:
    """W4: DeepSpeed's comm over the capturing process group, before ``zero.Init`` needs it."""
    import deepspeed

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def tokens(vocab: int, s: int, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of ``s`` random token ids, each its own labels (Trainer's causal-LM loss shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (s,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class _Labels(TrainerCallback):  # type: ignore[misc]
    """Trainer's hooks as commgate's step labels: a step ends where the next begins (``get_batch_samples``,
    W7) and the last with the epoch, whose end (``_finalize_training``'s ``store_flos``) is in no window."""

    def __init__(self) -> None:
        self.steps: Steps | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        from commgate.run import interpose

        if interpose.RECORDER is not None:
            interpose.RECORDER.phase = "forward"

    on_step_end = on_step_begin  # logging, after the optimizer: outside backward and optimizer

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.steps is not None:
            self.steps.close() if state.global_step >= state.max_steps else self.steps.end()


@contextlib.contextmanager
def _engine_phases() -> Iterator[None]:
    """DeepSpeed's ``engine.backward`` and ``engine.step`` labelled ``backward`` and ``optimizer`` (put back
    after: a torchrun rank runs commgate's own ZeRO workload next in the same process)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    saved = {name: DeepSpeedEngine.__dict__[name] for name in ("backward", "step")}

    def labelled(name: str, label: str) -> Any:
        method = saved[name]

        def call(self: Any, *a: Any, **k: Any) -> Any:
            with phase(label):
                return method(self, *a, **k)

        return call

    try:
        DeepSpeedEngine.backward = labelled("backward", "backward")
        DeepSpeedEngine.step = labelled("step", "optimizer")
        yield
    finally:
        for name, method in saved.items():
            setattr(DeepSpeedEngine, name, method)


W5_SOURCE = "e5c18cb49fc98393"
"""The first 16 hex digits of the SHA-256 of ``accelerate.state.AcceleratorState.__init__``'s source
(accelerate 1.15.0), which ``_keep_fsdp_plugin`` patches."""


def source_digest(fn: Any) -> str:
    import hashlib
    import inspect

    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _keep_fsdp_plugin() -> Iterator[None]:
    """W5: ``AcceleratorState.__init__`` keeping an FSDP plugin on a ``MULTI_CPU`` rank as its GPU branch
    keeps it (``state.py:1013-1016``); put back after."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    saved = AcceleratorState.__dict__["__init__"]
    if (digest := source_digest(saved)) != W5_SOURCE:
        raise CommgateError(
            f"trainer hf: W5: accelerate's AcceleratorState.__init__ is not the one the workaround was written "
            f"for (source digest {digest}, expected {W5_SOURCE}: accelerate 1.15.0); check state.py's FSDP "
            "branch and update commgate.run.trainers.hf._keep_fsdp_plugin"
        )

    def __init__(self: Any, *a: Any, fsdp_plugin: Any = None, **k: Any) -> None:
        saved(self, *a, fsdp_plugin=fsdp_plugin, **k)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type  # state.py:1037, as there

    try:
        AcceleratorState.__init__ = __init__
        yield
    finally:
        AcceleratorState.__init__ = saved


class HFTrainerJob:
    """``commgate.run.workloads.OwnLoop``: built once per rank (the arguments, the model, the Trainer: the
    init phase), then ``run`` trains and verifies."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.s, block = scenario, scenario.trainer_config
        # the meta read first: while a ZeRO-3 TrainingArguments lives, from_config builds under zero.Init
        self.inventory = [(p.name, p.shape) for p in describe(scenario).params]
        _environment(rank, scenario.world_size)
        self.deepspeed = SCHEMES[scenario.parallelism.scheme].deepspeed
        ds = str(path(scenario.file, block["deepspeed"])) if "deepspeed" in block else None
        if ds is not None:
            _join_deepspeed()
        self.dir = tempfile.TemporaryDirectory(prefix="commgate-hf-")
        steps = scenario.warmup_steps + scenario.steps
        kwargs = arguments(block, steps) | {"use_cpu": device.type == "cpu"}  # W2 on CPU ranks
        self.args = TrainingArguments(output_dir=self.dir.name, deepspeed=ds, **kwargs)
        torch.manual_seed(self.args.seed)
        self.model = build(scenario)  # after the arguments, as a user builds it: ZeRO-3 partitions it as built
        self.partitioned = all(hasattr(p, "ds_id") for p in self.model.parameters())
        par = scenario.parallelism
        n = steps * par.micro_batch * par.micro_batches * scenario.world_size  # one epoch of exactly `steps`
        data = tokens(self.model.config.vocab_size, scenario.model.s, n, self.args.seed)
        self.labels = _Labels()
        self.fsdp = bool(self.args.fsdp_plugin_args)
        with _keep_fsdp_plugin() if self.fsdp and device.type == "cpu" else contextlib.nullcontext():  # W5
            self.trainer = Trainer(model=self.model, args=self.args, train_dataset=data, callbacks=[self.labels])

    def run(self, steps: Steps) -> None:
        trainer, fetch = self.trainer, self.trainer.get_batch_samples

        def get_batch_samples(*a: Any, **k: Any) -> Any:  # W7: the step begins as its batches are fetched
            steps.begin(trainer.state.global_step)
            return fetch(*a, **k)

        self.labels.steps = steps
        trainer.get_batch_samples = get_batch_samples
        try:
            with _engine_phases() if self.deepspeed else contextlib.nullcontext():
                trainer.train()
            steps.close()
            verify(self)
        finally:
            _forget()

    def step(self, k: int) -> float:  # pragma: no cover - an OwnLoop is run, never stepped
        raise NotImplementedError


def _forget() -> None:
    """accelerate's singletons and transformers' DeepSpeed config reference, gone (a torchrun rank runs the
    next scenario in this process)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()


def verify(job: HFTrainerJob) -> None:
    """The job was what its scenario says, or a one-line ``CommgateError`` naming every difference: DeepSpeed
    (or DDP, with the predicted ``find_unused_parameters``) as expected, the DeepSpeed config Trainer handed
    ``deepspeed.initialize`` equal to the one resolved before the run, the parameters those read off the
    model on the meta device, in the scenario's dtype, partitioned as built under ZeRO-3."""
    problems = _engine(job) + _inventory(job)
    if problems:
        raise CommgateError(f"trainer hf: the job was not what scenario {job.s.id} says: " + "; ".join(problems))


def _engine(job: HFTrainerJob) -> list[str]:
    t, s = job.trainer, job.s
    kind = str(getattr(t.accelerator.distributed_type, "value", t.accelerator.distributed_type))
    if t.is_fsdp_enabled or job.fsdp:
        return _fsdp(job, kind)
    if job.deepspeed and not t.is_deepspeed_enabled:
        cause = os.environ.get("ACCELERATE_USE_CPU")
        why = (
            f": ACCELERATE_USE_CPU={cause} in the rank's environment makes accelerate drop DeepSpeed "
            "(accelerate/state.py:915-916, 974); unset it (TrainingArguments.use_cpu runs CPU ranks)"
            if cause and cause.lower() in ("1", "true", "yes")
            else ""
        )
        return [f"it ran without DeepSpeed (accelerate's {kind}, {type(t.model_wrapped).__name__}){why}"]
    if job.deepspeed:
        return _config(t, s)
    from torch.nn.parallel import DistributedDataParallel

    ddp = t.model_wrapped
    if not isinstance(ddp, DistributedDataParallel):
        return [f"it ran without DistributedDataParallel (accelerate's {kind}, {type(ddp).__name__})"]
    want = s.trainer_config["training_args"]["ddp_find_unused_parameters"]
    if ddp.find_unused_parameters != want:
        return [f"DDP ran with find_unused_parameters={ddp.find_unused_parameters}, the model has {want}"]
    return []


def _fsdp(job: HFTrainerJob, kind: str) -> list[str]:
    """FSDP2 as the scenario says: accelerate's plugin kept (W5), version 2, the model wrapped by
    ``fully_shard``, its resharding and mixed precision those the scenario was predicted with."""
    from torch.distributed.fsdp import FSDPModule

    t, s = job.trainer, job.s
    if not job.fsdp:
        return [f"it ran FSDP (accelerate's {kind}), which the scenario does not say"]
    if not t.is_fsdp_enabled:
        return [f"it ran without FSDP (accelerate's {kind}, {type(t.model_wrapped).__name__}): W5 did not hold"]
    plugin, f = t.accelerator.state.fsdp_plugin, s.parallelism.fsdp
    problems = []
    if plugin.fsdp_version != 2 or not isinstance(t.model_wrapped, FSDPModule):
        problems.append(f"it ran FSDP version {plugin.fsdp_version} ({type(t.model_wrapped).__name__}), not FSDP2")
    checkpointing = bool(s.trainer_config["training_args"]["fsdp_config"].get("activation_checkpointing"))
    if bool(plugin.activation_checkpointing) != checkpointing:
        problems.append(
            f"FSDP2 ran with activation_checkpointing={plugin.activation_checkpointing}, not {checkpointing}"
        )
    if bool(plugin.reshard_after_forward) != bool(f.reshard_after_forward):
        problems.append(f"FSDP2 ran with reshard_after_forward={plugin.reshard_after_forward}, the scenario's {f}")
    policy = plugin.mixed_precision_policy
    ran = [str(getattr(policy, k, None)).removeprefix("torch.") for k in ("param_dtype", "reduce_dtype")]
    want = [{"bf16": "bfloat16", "fp32": "float32"}.get(str(d), "None") for d in (f.param_dtype, f.reduce_dtype)]
    if ran != want:
        problems.append(f"FSDP2 ran with (param_dtype, reduce_dtype) {ran}, the scenario's {want}")
    return problems


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix.removesuffix("."): d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _config(t: Any, s: Scenario) -> list[str]:
    """The DeepSpeed config Trainer handed ``deepspeed.initialize`` against the resolution of the scenario."""
    runtime = _flat(json.loads(json.dumps(finite(t.accelerator.deepspeed_config), default=str)))
    offline = _flat(s.deepspeed_config)
    differ = sorted(k for k in runtime.keys() | offline.keys() if runtime.get(k) != offline.get(k))
    return [
        f"deepspeed.{k} is {runtime.get(k, '(absent)')!r} in the run, {offline.get(k, '(absent)')!r} as resolved "
        "before it"
        for k in differ[:5]
    ]


def _inventory(job: HFTrainerJob) -> list[str]:
    problems = []
    wrapped = "._checkpoint_wrapped_module"  # torch's checkpoint_wrapper (FSDP2's activation checkpointing)
    run = [(n.replace(wrapped, ""), tuple(getattr(p, "ds_shape", p.shape))) for n, p in job.model.named_parameters()]
    if run != job.inventory:
        first = next((f"{a} vs {b}" for a, b in zip(run, job.inventory, strict=False) if a != b), "their count")
        problems.append(f"the model's parameters differ from those read on the meta device ({first})")
    dtypes = {getattr(p, "ds_tensor", p).dtype for p in job.model.parameters()}  # ZeRO-3: the partition's
    want = TORCH_DTYPES[job.s.model.dtype]
    if dtypes != {want}:
        problems.append(
            f"its parameters are {sorted(map(str, dtypes))}, the scenario's {want} ({ITEMSIZE[job.s.model.dtype]} B)"
        )
    if job.s.parallelism.zero.stage == 3 and not job.partitioned:
        problems.append("the model was not built under deepspeed.zero.Init (transformers' ZeRO-3 construction)")
    return problems
