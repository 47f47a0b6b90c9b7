"""torchtitan 0.3.0's own ``Trainer`` on a rank, under the gate (``trainer: torchtitan``).

When the workload is built, ``commgate.run.rank.run_rank`` has made the default process group through the
capturing backend; torchtitan's ``init_distributed`` reuses an initialised group
(``distributed/utils.py:466-472``) and every mesh it makes with ``init_device_mesh`` is a commgate group
too, so every call is seen. Construction (torchtitan's ``ConfigManager`` -> ``Trainer``) is the init
phase; ``step(k)`` is one ``Trainer.train_step``: the body of ``Trainer.train()`` (``trainer.py:1031-1039``)
without checkpointing, validation and profiling (off in every llama3 config) and ``set_pg_timeouts``.

The job is the scenario's: the config function it names, parsed by torchtitan's own ``ConfigManager`` with
the scenario's parallelism, batch, sequence, precision and checkpointing as torchtitan's overrides, and a
model of the scenario's dimensions built with torchtitan's own llama3 builders where the config's own
model differs. After parsing and after building, ``check_config`` and ``check_built`` compare what
torchtitan made with the scenario and stop the run in one line if they differ: commgate never gates a
job other than the one the scenario describes.

Workarounds for torch 2.13 on CPU (paths under ``torchtitan/`` unless they start with ``torch/``); none edits
torchtitan's files, each is applied only where its condition holds, and ``tests/test_torchtitan.py`` holds
a test of each that fails when upstream changes so that it is no longer needed or no longer works:

* P1 ``device_type`` (``tools/utils.py:54-60``): ``_get_available_device_type() or "cuda"`` at import
  falls back to CUDA on a CPU torch, then ``trainer.py:301`` calls ``set_device``, and
  ``components/metrics.py:39-50,62,92`` CUDA's memory calls: the module is imported with torch's probe
  answering the rank's device and, on CPU, a device module that answers those calls.
* P2 ``triton`` (``distributed/minimal_async_ep/kernels.py:10``), imported by every import of
  ``torchtitan.trainer`` (``trainer.py:55`` -> ``models/common/token_dispatcher.py:17``): where triton is
  not installed, a stand-in for that module with the names ``minimal_async_ep/api.py:30-39`` imports
  (CUDA expert-parallel kernels a dense llama3 never calls; saves the 999 MB wheel).
* P3 flex attention's CPU backward (``models/common/attention.py:277-280`` compiles it;
  ``torch/nn/attention/flex_attention.py:2075-2083`` refuses CPU inputs that need a gradient): on CPU
  flex runs eagerly, its device check skipped for CPU tensors only (the eager operator differentiates on
  CPU: within 2.1e-6 of SDPA on torchtitan's block-causal mask).
* P4 ``PREMUL_SUM`` (``distributed/fsdp.py:27-41,316`` sets ``set_gradient_divide_factor(1.0)``;
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:840-851`` then reduces with
  ``PREMUL_SUM(1.0)``, which gloo lacks): on CPU (gloo) FSDP2 is told to reduce with SUM, then divide by
  1.0. Same message, dtype and size: nothing commgate records changes.
* P5 ``set_pg_timeouts`` (``distributed/utils.py:586,595``: ``barrier(device_ids=["cpu"])``,
  ``torch.distributed.set_timeout``, absent in torch 2.13), called by ``Trainer.train()`` after its
  first step: not needed, the gate drives ``train_step``; its test keeps watch.
* P6 (speed) ``create_block_mask`` compiled at import (``models/common/attention.py:622``): on CPU the
  first step would compile it with inductor's C++ backend (5-50 s); it runs eagerly, building the same
  mask (no collective changes).
* P7 the pipeline's ``step`` (``trainer.py:856``: ``pp_schedule.step(arg_mbs=...)``, a torch newer than
  2.13): ``microbatch_step`` gives the schedule a ``step`` that takes torchtitan's micro-batches and does
  what torch 2.13's own ``step`` does after splitting a batch.
* P8 FSDP2's CPU offload (``training.enable_cpu_offload``: ``distributed/fsdp.py:173-174`` builds
  ``CPUOffloadPolicy()``, which pins host memory, ``torch/.../_fsdp_param.py:1044-1045``; pinning needs an
  accelerator): on CPU torchtitan's policy is built with FSDP2's own ``pin_memory=False``.
* And not a patch: ``--parallelism.spmd_backend partial_dtensor``, since the default ``spmd_types`` fails in
  torch 2.13's ``fully_shard`` (``distributed/fsdp.py:195`` -> ``torch/.../_fsdp_param.py:346``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import json
import os
import random
import sys
import tempfile
import traceback
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commgate.core.errors import CommgateError, first_line
from commgate.model.expectation import Context
from commgate.model.importer import TitanJob
from commgate.model.scenario import ModelSpec, Scenario
from commgate.model.schemes.fsdp import pipeline_order
from commgate.model.trainers.torchtitan import LEFT_OFF_WHY, Job, stages
from commgate.run import interpose
from commgate.run.capture import RUN_DIR

if TYPE_CHECKING:
    import torch

APPLIED: list[str] = []
"""The workarounds this process applied, in order (each once)."""


# ------------------------------------------------------------------------------------ workarounds


class CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the CUDA-style calls torchtitan makes on its device module
    (``components/metrics.py:39-50,62,92``; ``trainer.py:301`` ``set_device``)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> Any:
        return types.SimpleNamespace(total_memory=1 << 40, name="cpu")

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


CPU_CALLS = ("get_device_name", "get_device_properties", "memory_stats", "reset_peak_memory_stats", "empty_cache")
"""What ``CpuDeviceModule`` adds to ``torch.cpu``."""


def device_type(device: str) -> None:
    """P1: import ``torchtitan.tools.utils`` with torch's probe answering ``device`` (and, for the CPU, the
    device module ``CpuDeviceModule``), then restore torch's functions; nothing to do where torch's own
    probe already answers ``device``."""
    tu: Any = importlib.import_module("torch._utils")  # torch's probe, untyped
    loaded = sys.modules.get("torchtitan.tools.utils")
    if loaded is not None:  # a scenario before this one in the process (torchrun)
        if loaded.device_type != device:
            raise CommgateError(
                f"torchtitan was imported for device {loaded.device_type!r} before this {device!r} run; "
                "run torchtitan scenarios of one device per process"
            )
        return
    if (tu._get_available_device_type() or "cuda") == device:
        return
    probe, get_module = tu._get_available_device_type, tu._get_device_module
    cpu = CpuDeviceModule("commgate_torchtitan_cpu")
    tu._get_available_device_type = lambda: device
    tu._get_device_module = lambda device_type=None: (
        cpu if device == "cpu" and device_type in (None, "cpu") else get_module(device_type)
    )
    try:
        importlib.import_module("torchtitan.tools.utils")
    finally:
        tu._get_available_device_type, tu._get_device_module = probe, get_module
    APPLIED.append(f"P1 torchtitan device_type {device!r}")


EP_KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
EP_KERNELS = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)  # fmt: skip
"""The names ``minimal_async_ep/api.py:30-39`` imports from the kernels module."""


def without_triton() -> None:
    """P2: where triton cannot be imported, stand in for the one module on the trainer's import path that
    needs it; its kernels raise if ever called."""
    if EP_KERNELS_MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(EP_KERNELS_MODULE)

    def needs_triton(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torchtitan's MinimalAsyncEP kernels need triton and CUDA (commgate stood in for them)")

    for name in EP_KERNELS:
        setattr(stub, name, needs_triton)
    sys.modules[EP_KERNELS_MODULE] = stub
    APPLIED.append("P2 minimal_async_ep.kernels without triton")


def eager_flex_on_cpu() -> None:
    """P3: flex attention runs eagerly, and its device check lets CPU inputs that need a gradient through
    (other devices are checked as before)."""
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common.attention import FlexAttention

    if getattr(fa._validate_device, "commgate", False):
        return
    validate = fa._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            validate(query, key, value)

    validate_device.commgate = True  # type: ignore[attr-defined]
    fa._validate_device = validate_device
    FlexAttention._compiled_flex_attn = fa.flex_attention
    APPLIED.append("P3 eager flex attention, CPU backward")


def sum_reduction() -> None:
    """P4: torchtitan's ``disable_fsdp_gradient_division`` (looked up by ``apply_fsdp_to_decoder`` as a
    module global) also forces FSDP2 to reduce with SUM, which gloo has."""
    from torchtitan.distributed import fsdp

    original = fsdp.disable_fsdp_gradient_division
    if getattr(original, "commgate", False):
        return

    def divide_by_one_and_sum(model: Any) -> None:
        original(model)
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    divide_by_one_and_sum.commgate = True  # type: ignore[attr-defined]
    fsdp.disable_fsdp_gradient_division = divide_by_one_and_sum
    APPLIED.append("P4 FSDP2 reduce-scatters with SUM")


def unpinned_offload() -> None:
    """P8: torchtitan's CPU offload (``training.enable_cpu_offload``) builds FSDP2's ``CPUOffloadPolicy()``
    (``distributed/fsdp.py:173-174``), whose default ``pin_memory=True`` pins each shard
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py:1044-1045``), which a torch without an accelerator
    refuses ("Cannot access accelerator device"); on CPU the policy is made with FSDP2's own ``pin_memory=False``
    (pinning host memory only speeds copies to an accelerator: no collective changes)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torchtitan.distributed import fsdp

    if fsdp.CPUOffloadPolicy is not CPUOffloadPolicy:
        return
    fsdp.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=False)
    APPLIED.append("P8 FSDP2 CPU offload unpinned")


def eager_block_mask() -> None:
    """P6: the block mask is made eagerly instead of compiled by inductor at the first step."""
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    if attention._compiled_create_block_mask is create_block_mask:
        return
    attention._compiled_create_block_mask = create_block_mask
    APPLIED.append("P6 eager create_block_mask")


def optimizer_phase() -> None:
    """Label the optimizer part of ``train_step`` (``trainer.py:939-949``: the gradient norm's all-reduces,
    the optimizer's step, then the logging steps' metrics) as commgate's ``optimizer`` phase, until the next
    step begins."""
    from torchtitan.distributed import utils

    clip = utils.clip_grad_norm_
    if getattr(clip, "commgate", False):
        return

    def labelled(*args: Any, **kwargs: Any) -> Any:
        if (rec := interpose.RECORDER) is not None:
            rec.phase = "optimizer"
        return clip(*args, **kwargs)

    labelled.commgate = True  # type: ignore[attr-defined]
    utils.clip_grad_norm_ = labelled


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
"""The environment a CPU rank's torchtitan imports its Hugging Face libraries in: nothing fetched."""


def preload() -> None:
    """What a CPU rank's config parse imports for seconds (torchtitan's trainer, its Hugging Face datasets, Llama
    3's models and config registry), imported in the ranks' forkserver (``commgate.run.preload``) as a rank
    imports them: offline (``prepare``'s environment, put back after: a rank of another job is forked from the
    same process), P2 and P1 for the CPU first. The patches ``prepare`` applies to a run are not applied."""
    from commgate.core import env

    with env.defaults(OFFLINE):
        without_triton()
        device_type("cpu")
        importlib.import_module("torchtitan.trainer")
        importlib.import_module("torchtitan.models.llama3.config_registry")  # its datasets, through validate.py


def prepare(device: str) -> None:
    """Everything before torchtitan's config is parsed, each workaround where it is needed."""
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    without_triton()
    device_type(device)
    if device == "cpu":
        eager_flex_on_cpu()
        sum_reduction()
        eager_block_mask()
        unpinned_offload()
    optimizer_phase()


# ------------------------------------------------------------------------------------------ assets

WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "with", "as", "on", "by", "at", "from", "his", "her",
    "which", "are", "an", "be", "this", "model", "data", "train", "step", "rank", "tensor", "shard", "gather",
    "reduce", "scatter", "layer", "block", "weight", "grad", "norm",
)  # fmt: skip
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def make_assets(where: Path, vocab: int) -> tuple[Path, Path]:
    """(tokenizer directory, data directory) made under ``where``: a byte-level BPE tokenizer of ``vocab``
    tokens (its ``tokenizer_config.json`` naming BOS and EOS), trained here on generated text, and that text
    as c4-like JSONL for torchtitan's ``c4_test`` loader (``hf_datasets/text_datasets.py:44-48``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = where / "tokenizer", where / "c4_local"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 600))) + "." for _ in range(400)]
    (data_dir / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS], initial_alphabet=alphabet)
    )
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok_dir, data_dir


# --------------------------------------------------------------------------------------------- job


def overrides(scenario: Scenario, job: Job, *, tokenizer: Path, data: Path, dump: Path) -> list[str]:
    """torchtitan's command line for the scenario's job: the config, the run's own assets, the scenario's
    parallelism, batch, sequence, precision, logging and checkpointing, then ``torchtitan.args``."""
    par, m = scenario.parallelism, scenario.model
    sp = (
        "--parallelism.enable-sequence-parallel"
        if par.sequence_parallel
        else "--parallelism.no-enable-sequence-parallel"
    )
    seed = ["--debug.seed", str(job.seed)] if job.seed is not None else []
    pipeline, micro_batches = [], 1
    if par.pp > 1:  # the scenario's schedule (llama3_debugmodel's own is Interleaved1F1B, config_registry.py:60)
        micro_batches = par.micro_batches
        pipeline = [
            "--parallelism.pipeline_parallel_microbatch_size", str(par.micro_batch),
            "--parallelism.pipeline_parallel_schedule", PP_SCHEDULES[par.pipeline.schedule],
            "--training.disable_cuda_graphs",  # else Trainer.Config refuses PP (trainer.py:179-187)
        ]  # fmt: skip
    return [
        "--module", job.module, "--config", job.config,
        "--hf_assets_path", str(tokenizer), "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(data),
        "--dump_folder", str(dump),
        "--parallelism.spmd_backend", "partial_dtensor",
        "--parallelism.data_parallel_shard_degree", str(par.dp),
        "--parallelism.data_parallel_replicate_degree", str(par.dp_replicate),
        "--parallelism.tensor_parallel_degree", str(par.tp),
        sp,
        "--parallelism.fsdp_reshard_after_forward", job.fsdp_reshard_after_forward,
        "--parallelism.pipeline_parallel_degree", str(par.pp),
        "--parallelism.context_parallel_degree", str(par.cp),
        *pipeline,
        "--training.local_batch_size", str(par.micro_batch * micro_batches),
        "--training.global_batch_size", str(global_batch(scenario, job)),
        "--training.seq_len", str(m.s),
        "--training.dtype", "float32",
        "--training.mixed_precision_param", job.mixed_precision_param,
        "--metrics.log_freq", str(job.log_freq),
        *seed,
        *(["--training.enable_cpu_offload"] if job.cpu_offload else []),
        *job.args,
        f"activation-checkpoint:{job.ac(par.activation_checkpointing)}",
    ]  # fmt: skip


PP_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zero-bubble": "InterleavedZeroBubble",
}
"""The scenario's schedule -> torchtitan's ``parallelism.pipeline_parallel_schedule``."""


def microbatch_step(schedule: Any) -> None:
    """P7: torchtitan 0.3.0 steps its pipeline with micro-batches it split itself,
    ``pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=, return_outputs=)``
    (``trainer.py:856-863``), a signature of torch after 2.13; torch 2.13's ``step(*args, target=, ...)``
    splits a whole batch itself and takes those names for model inputs ("Expecting 4 arg_mbs but got 1").
    The schedule's ``step`` is given what torch 2.13's own does after its split (``schedules.py:761-772``
    for one stage a rank, ``1955-1972`` for several), then ``_step_microbatches`` with torchtitan's
    micro-batches: the same calls, in the same order."""
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    whole = schedule.step

    def step(
        *args: Any,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        loss_kwargs: Any = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole(*args, losses=losses, loss_kwargs=loss_kwargs, return_outputs=return_outputs, **kwargs)
        if isinstance(schedule, PipelineScheduleSingle):
            stages, grad = [schedule._stage], schedule._has_backward
        elif isinstance(schedule, PipelineScheduleMulti):
            stages, grad = schedule._stages, schedule._has_backward and schedule._backward_requires_autograd
        else:
            raise CommgateError(f"torchtitan built a {type(schedule).__name__}, a schedule commgate does not step")
        if grad and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation")
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        return None

    schedule.step = step
    APPLIED.append(f"P7 {type(schedule).__name__}.step(arg_mbs=...)")


@contextlib.contextmanager
def float8_disabled() -> Iterator[list[Any]]:
    """While it lasts, torchtitan's float8 converter is built disabled (``Float8LinearConverter.convert``
    returns the model config unchanged when ``enabled`` is false, ``components/quantization/float8.py``):
    a config function that converts its model to float8 (``llama3_405b``) parses on a CPU, where the
    converter itself refuses to be built (no SM89 GPU, ``float8.py:86-96``). Yields the converters' configs
    built meanwhile: what the config asked for."""
    from torchtitan.components.quantization import Float8LinearConverter

    built: list[Any] = []
    init = Float8LinearConverter.__init__

    def disabled(self: Any, config: Any) -> None:
        self.config, self.enabled = config, False
        built.append(config)

    Float8LinearConverter.__init__ = disabled
    try:
        yield built
    finally:
        Float8LinearConverter.__init__ = init


def read(argv: list[str], where: str) -> tuple[Any, bool]:
    """(torchtitan's ``Trainer.Config`` of ``argv`` through its own ``ConfigManager``, whether the config
    converts its model to float8 (left unconverted)); one line if torchtitan cannot build it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchtitan.config import ConfigManager

    said = io.StringIO()
    try:
        with warnings.catch_warnings():
            # what torchtitan's imports warn of (deprecations in torch and its dependencies), not the job's
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            with float8_disabled() as float8, contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                return ConfigManager().parse_args(argv), bool(float8)
    except (Exception, SystemExit) as exc:  # tyro exits on a bad flag, having printed why
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, SystemExit) and (words := _parser_said(said.getvalue())):
            what = f"{exc.code}: {words}"  # it said "SystemExit: 2", the parser's words lost (adversarial pass)
        raise CommgateError(f"torchtitan could not build config {where}: {type(exc).__name__}: {what}") from None


def _parser_said(text: str) -> str:
    """What tyro printed as it refused the arguments, on one line: its box's text from its title on (what
    torchtitan printed before it, a config's own warnings, left out), without the box drawing, separators,
    usage lines, or a title the next line repeats (``Unrecognized options: --optimizer.lrr, 1e-4``)."""
    lines: list[str] = []
    for line in text.splitlines():
        words = " ".join(line.strip(" │╭╮╰╯─━┃┏┓┗┛\t").split())
        helptext = words.startswith(("usage:", "For full helptext")) or words.endswith("--help")
        if not words.strip("-=─━ ") or helptext:
            continue
        lines.append(words)
    titled = [i for i, w in enumerate(lines) if any(k in w.lower() for k in ("unrecognized", "error", "invalid"))]
    lines = lines[titled[0] :] if titled else lines
    kept = [w for w, after in zip(lines, [*lines[1:], ""], strict=True) if not after.startswith(w)]
    return "; ".join(kept)[:400]


def build(config: Any, job: Job) -> Any:
    """torchtitan's ``Trainer`` of ``config``; what torchtitan raises as it builds it (an override naming a
    file that is not there: ``--parallelism.pipeline_parallel_schedule_csv``) in one line naming the config and
    the overrides, its traceback in the rank's log (it was the rank's traceback: an adversarial pass)."""
    args = " ".join(job.args) or "(no torchtitan.args)"
    with one_line(f"torchtitan could not build its trainer from config {job.module}:{job.config} with the "
                  f"scenario's overrides {args}"):  # fmt: skip
        return config.build()


@contextlib.contextmanager
def one_line(doing: str) -> Iterator[None]:
    """What torchtitan raises inside (not commgate's own one-line errors) as one line, ``doing: Type: its first
    line``; its traceback printed to the rank's log."""
    try:
        yield
    except CommgateError:
        raise
    except Exception as exc:
        traceback.print_exc()
        raise CommgateError(
            f"{doing}: {type(exc).__name__}: {first_line(exc)} (its traceback in the rank's log)"
        ) from None


def parse(scenario: Scenario, job: Job, argv: list[str]) -> Any:
    """The scenario's job as torchtitan's config: float8 only where ``torchtitan.left_off`` names it (the run
    and the model leave it out)."""
    args = " ".join(job.args) or "(no torchtitan.args)"
    config, float8 = read(argv, f"{job.module}:{job.config} with the scenario's overrides {args}")
    if float8 and "float8" not in job.left_off:
        raise CommgateError(
            f"torchtitan config {job.module}:{job.config} {LEFT_OFF_WHY['float8'][0]} ({LEFT_OFF_WHY['float8'][1]}): "
            "list float8 in torchtitan.left_off to run without it"
        )
    # the scenario's loss_chunks is given, not only described (tests/trainer_gen.py found loss_chunks != 8
    # refused by check_config: "make them agree", with no way to set it). Not as a flag: a config whose loss
    # is not chunked has no --loss.num_chunks, and must reach check_config's one line about its loss
    if _chunked(config) and job.loss == "chunked" and not any(a.startswith("--loss.num_chunks") for a in job.args):
        config.loss.num_chunks = job.loss_chunks
    return config


def _chunked(config: Any) -> bool:
    from torchtitan.components.loss import ChunkedLossWrapper

    return isinstance(config.loss, ChunkedLossWrapper.Config)


def model_dims(config: Any) -> dict[str, Any]:
    """The dimensions of a llama3 model config, in commgate's names."""
    layer = config.layers[0]
    attention = layer.attention
    return {
        "L": len(config.layers),
        "h": config.dim,
        "a": attention.n_heads,
        "kv_heads": attention.n_kv_heads or attention.n_heads,
        "ffn_hidden": layer.feed_forward.w1.out_features,
        "V": config.vocab_size,
        "tied_embeddings": config.enable_weight_tying,
    }


def scenario_dims(m: ModelSpec) -> dict[str, Any]:
    return {
        "L": m.L,
        "h": m.h,
        "a": m.a,
        "kv_heads": m.kv,
        "ffn_hidden": m.ffn,
        "V": m.V,
        "tied_embeddings": m.tied_embeddings,
    }


def converted(config: Any) -> list[str]:
    """The linear layers a model converter (float8, MX, NVFP4) replaced: their config classes' names."""
    from torchtitan.models.common import Linear

    return sorted(
        {type(c).__qualname__ for _, c, _, _ in config.traverse(Linear.Config) if type(c) is not Linear.Config}
    )


def with_scenario_model(config: Any, scenario: Scenario, job: Job) -> None:
    """Replace the config's model by one of the scenario's dimensions, built with torchtitan's own llama3
    builders (the config's RoPE kept), where the config's own model differs; a model converted to another
    linear layer (MX, NVFP4) stops the run."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    own = config.model_spec.model
    where = f"torchtitan config {job.module}:{job.config}"
    if not isinstance(own, Llama3Model.Config):
        raise CommgateError(f"{where} builds {type(own).__qualname__}; commgate models torchtitan's llama3 model only")
    if swapped := converted(own):  # (float8's converter was built disabled: MX, NVFP4)
        raise CommgateError(f"{where} converts linear layers ({', '.join(swapped)}): not modelled, nor run on a CPU")
    if model_dims(own) == scenario_dims(scenario.model):
        return  # the config's own model, unchanged
    m = scenario.model
    rope = dataclasses.replace(own.layers[0].attention.rope, dim=m.h // m.a)
    config.model_spec.model = Llama3Model.Config(
        dim=m.h,
        vocab_size=m.V,
        tok_embeddings=Embedding.Config(num_embeddings=m.V, embedding_dim=m.h, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=m.h, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=m.h, out_features=m.V, param_init=_output_linear_init(m.h)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=m.L, dim=m.h, n_heads=m.a, n_kv_heads=m.kv, hidden_dim=m.ffn, rope=rope,
            attn_backend="flex",
        ),
        enable_weight_tying=m.tied_embeddings,
    )  # fmt: skip
    config.model_spec.flavor = f"commgate L={m.L} h={m.h} a={m.a} kv={m.kv} ffn={m.ffn} V={m.V}"
    loss = getattr(config.loss, "loss_fn", config.loss)
    if hasattr(loss, "global_vocab_size"):
        loss.global_vocab_size = m.V


def leave_off(config: Any, job: Job) -> None:
    """Turn off what ``torchtitan.left_off`` names; what the config enables that it does not name stops the
    run (a CPU run cannot compile flex attention nor run async TP)."""
    on = {"compile": config.compile.enable, "async_tp": config.compile.enable_async_tensor_parallel}
    for what, enabled in on.items():
        if enabled and what not in job.left_off:
            raise CommgateError(
                f"torchtitan config {job.module}:{job.config} {LEFT_OFF_WHY[what][0]} ({LEFT_OFF_WHY[what][1]}): "
                f"list {what} in torchtitan.left_off to run without it"
            )
    if "async_tp" in job.left_off:
        config.compile.enable_async_tensor_parallel = False
    if "compile" in job.left_off:
        config.compile.enable = False


def text_loader(config: Any, where: str) -> None:
    """Stop where the config reads its data with another loader than ``HuggingFaceTextDataLoader`` (the run
    makes a local text dataset for it, ``make_assets``; ``sft_debugmodel``'s ``ChatDataLoader`` reads chat
    samples the run does not make)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    if not isinstance(config.dataloader, HuggingFaceTextDataLoader.Config):
        kind = type(config.dataloader).__qualname__
        raise CommgateError(
            f"torchtitan config {where} reads its data with {kind}; the run makes a text dataset for "
            "HuggingFaceTextDataLoader only: a config of the llama3 pretraining family"
        )


def global_batch(scenario: Scenario, job: Job) -> int:
    """``training.global_batch_size``: the data ranks' local batches (the pipeline's micro-batches, or one),
    times the accumulation steps (without a pipeline ``micro_batches``, under one the job's own)."""
    par = scenario.parallelism
    per_step = par.micro_batch * par.micro_batches * par.dp * par.dp_replicate
    return per_step * (job.gradient_accumulation_steps if par.pp > 1 else 1)


def check_config(config: Any, scenario: Scenario, job: Job) -> None:
    """Stop in one line where the parsed job is not the scenario's (a config function, or torchtitan.args,
    that sets what the scenario gives)."""
    par, m = scenario.parallelism, scenario.model
    text_loader(config, f"{job.module}:{job.config}")
    chunked = _chunked(config)
    got = {
        "activation_checkpoint": ac_mode(config) or type(config.activation_checkpoint).__qualname__,
        "loss": "chunked" if chunked else type(config.loss).__qualname__,
        "loss.num_chunks": config.loss.num_chunks if chunked else None,
    }
    want: dict[str, tuple[object, str]] = {
        "parallelism.data_parallel_shard_degree": (par.dp, "parallelism.dp"),
        "parallelism.tensor_parallel_degree": (par.tp, "parallelism.tp"),
        "parallelism.pipeline_parallel_degree": (par.pp, "parallelism.pp"),
        "parallelism.context_parallel_degree": (par.cp, "parallelism.cp"),
        "parallelism.data_parallel_replicate_degree": (par.dp_replicate, "parallelism.dp_replicate"),
        "parallelism.enable_sequence_parallel": (par.sequence_parallel, "parallelism.sequence_parallel"),
        "parallelism.fsdp_reshard_after_forward": (
            job.fsdp_reshard_after_forward,
            "torchtitan.fsdp_reshard_after_forward",
        ),
        "training.enable_cpu_offload": (job.cpu_offload, "torchtitan.cpu_offload"),
        "training.local_batch_size": (
            par.micro_batch * (par.micro_batches if par.pp > 1 else 1),
            "parallelism.micro_batch x micro_batches",
        ),
        "training.global_batch_size": (
            global_batch(scenario, job),
            "parallelism.micro_batch x micro_batches x dp x dp_replicate (x torchtitan.gradient_accumulation_steps)",
        ),
        "training.seq_len": (m.s, "model.s"),
        **(
            {
                "parallelism.pipeline_parallel_schedule": (
                    PP_SCHEDULES[par.pipeline.schedule],
                    "parallelism.pipeline.schedule",
                ),
                "parallelism.pipeline_parallel_microbatch_size": (par.micro_batch, "parallelism.micro_batch"),
            }
            if par.pp > 1
            else {}
        ),
        "training.dtype": ("float32", "model.dtype fp32"),
        "training.mixed_precision_param": (job.mixed_precision_param, "torchtitan.mixed_precision_param"),
        "training.mixed_precision_reduce": ("float32", "the model's reduce dtype"),
        "activation_checkpoint": (job.ac(par.activation_checkpointing), "torchtitan.activation_checkpoint"),
        "loss": ("chunked" if job.loss == "chunked" else "CrossEntropyLoss.Config", "torchtitan.loss"),
        "loss.num_chunks": (job.loss_chunks if chunked else None, "torchtitan.loss_chunks"),
        "metrics.log_freq": (job.log_freq, "torchtitan.log_freq"),
        "debug.seed": (job.seed, "torchtitan.seed"),
    }
    for key, (value, field) in want.items():
        built = got[key] if key in got else _attribute(config, key)
        if built != value and key == "loss":  # in the scenario's words (it said 'CrossEntropyLoss.Config': found
            # by an adversarial pass), and where the other loss is
            runs = "chunked" if built == "chunked" else "cross_entropy"
            raise CommgateError(
                f"torchtitan config {job.module}:{job.config} runs loss {runs}, the scenario describes "
                f"torchtitan.loss: {job.loss}: set torchtitan.loss: {runs}, or take a config that runs {job.loss} "
                f"(torchtitan's {job.module} configs ending in _ce_loss run cross_entropy)"
            )
        if built != value:
            raise CommgateError(
                f"torchtitan config {job.module}:{job.config} runs {key} = {built!r}, the scenario describes "
                f"{value!r} ({field}): make them agree"
            )


def ac_mode(config: Any) -> str | None:
    """The activation-checkpointing mode of a parsed config (``none``, ``selective``, ``full``), or None for
    another (``memory-budget``: not modelled)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    modes = {type(None): "none", FullAC.Config: "full", SelectiveAC.Config: "selective"}
    return modes.get(type(config.activation_checkpoint))


def _attribute(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def expected_shapes(m: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The parameters torchtitan's llama3 model of ``m`` holds, with their global shapes."""
    hd = m.h // m.a
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (m.V, m.h)}
    for i in range(m.L):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.qkv_linear.wqkv.weight": ((m.a + 2 * m.kv) * hd, m.h),
            p + "attention.wo.weight": (m.h, m.a * hd),
            p + "feed_forward.w1.weight": (m.ffn, m.h),
            p + "feed_forward.w2.weight": (m.h, m.ffn),
            p + "feed_forward.w3.weight": (m.ffn, m.h),
            p + "attention_norm.weight": (m.h,),
            p + "ffn_norm.weight": (m.h,),
        }
    shapes["norm.weight"] = (m.h,)
    if not m.tied_embeddings:  # tied: lm_head's weight is tok_embeddings' (named once)
        shapes["lm_head.weight"] = (m.V, m.h)
    return shapes


def check_built(trainer: Any, scenario: Scenario, job: Job) -> None:
    """Stop in one line where the trainer torchtitan built is not the scenario's: its meshes, its
    parameters and their shapes, FSDP2's mixed precision, gradient accumulation."""
    import torch

    par, m = scenario.parallelism, scenario.model
    dims = trainer.parallel_dims
    built = {"dp_shard": dims.dp_shard, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp_replicate": dims.dp_replicate}
    wanted = {"dp_shard": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "dp_replicate": par.dp_replicate}
    where = f"torchtitan built {job.module}:{job.config}"
    if built != wanted:
        raise CommgateError(f"{where} with meshes {built}, the scenario describes {wanted}")
    parts = trainer.model_parts
    want = expected_shapes(m)
    if len(parts) != (par.pipeline.virtual_stages if par.pp > 1 else 1):
        raise CommgateError(f"{where} with {len(parts)} model parts on a rank, the scenario describes "
                            f"{par.pipeline.virtual_stages if par.pp > 1 else 1}")  # fmt: skip
    shapes = {
        name.replace("._checkpoint_wrapped_module", ""): tuple(p.shape)
        for part in parts
        for name, p in part.named_parameters()
    }
    # one rank holds the whole model, or (pipelined) its stages' share of it
    if (shapes != want) if par.pp == 1 else not (shapes and shapes.items() <= want.items()):
        diff = sorted(set(shapes.items()) ^ set(want.items()))[:2]
        raise CommgateError(f"{where} with parameters that differ from the scenario's model: {diff} ...")
    if par.pp > 1:
        check_split(parts, scenario, dims.get_mesh("pp").get_local_rank(), where)
        check_order(trainer.pp_schedule, scenario, dims.get_mesh("pp").get_local_rank(), where)
    model = parts[0]
    accumulation = job.gradient_accumulation_steps if par.pp > 1 else par.micro_batches
    if trainer.gradient_accumulation_steps != accumulation:
        field = "torchtitan.gradient_accumulation_steps" if par.pp > 1 else "parallelism.micro_batches"
        raise CommgateError(
            f"{where} with {trainer.gradient_accumulation_steps} gradient-accumulation steps; the scenario "
            f"describes {accumulation} ({field})"
        )
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None)
    want_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[job.mixed_precision_param]
    if policy is None or policy.param_dtype != want_dtype or policy.reduce_dtype != torch.float32:
        raise CommgateError(f"{where} with FSDP2 mixed precision {policy}, the scenario describes {want_dtype} gathers")
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    held = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    offloaded = any(isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy) for g in held)
    if offloaded != job.cpu_offload:
        raise CommgateError(
            f"{where} with FSDP2 CPU offload {'on' if offloaded else 'off'}, the scenario describes "
            f"{'on' if job.cpu_offload else 'off'} (torchtitan.cpu_offload)"
        )


def check_split(parts: list[Any], scenario: Scenario, pp_rank: int, where: str) -> None:
    """Stop where torchtitan split the model into stages other than the model's ``stages`` (this rank's
    parts are stages pp_rank, pp_rank + p, ...: the "loop" style of its schedules)."""
    par = scenario.parallelism
    split = stages(par.pp * par.pipeline.virtual_stages, scenario.model.L)
    for k, part in enumerate(parts):
        names = {name.replace("._checkpoint_wrapped_module", "") for name, _ in part.named_parameters()}
        layers = {n.split(".")[1] for n in names if n.startswith("layers.")}
        held = (
            any(n.startswith("tok_embeddings.") for n in names),
            len(layers),
            any(n.startswith("lm_head.") for n in names),
        )
        st = split[pp_rank + k * par.pp]
        if held != (st.embedding, st.layers, st.head):
            raise CommgateError(
                f"{where} with stage {st.index} holding (embedding, blocks, head) = {held}, the model's split "
                f"of torchtitan's default is {(st.embedding, st.layers, st.head)}: its pipeline_parallel_* split "
                "options are not modelled"
            )


def check_order(schedule: Any, scenario: Scenario, pp_rank: int, where: str) -> None:
    """Stop where the schedule torchtitan built runs this rank's stages' forwards and backwards in another
    order than the model replays (``commgate.model.schemes.fsdp.pipeline_order``: FSDP2's gathers follow it).
    The schedule holds its order (``pipeline_order``: each rank's actions; the gradient reduction, after a
    stage's last backward, left out). Without FSDP2 (one data-parallel rank) the order changes nothing modelled."""
    from torch.distributed.pipelining.schedules import _ComputationType

    order = getattr(schedule, "pipeline_order", None)
    if order is None or scenario.parallelism.data_ranks == 1:
        return
    letter = {t: str(t.value) for t in (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD)}
    letter |= {t: str(t.value) for t in (_ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT)}
    letter[_ComputationType.REDUCE_GRAD] = ""
    ctx = Context(scenario=scenario)
    for k in range(scenario.parallelism.pipeline.virtual_stages):
        stage = pp_rank + k * scenario.parallelism.pp
        ran = "".join(letter.get(a.computation_type, "?") for a in order[pp_rank] if a and a.stage_index == stage)
        if ran != (want := pipeline_order(ctx, stage)):
            raise CommgateError(
                f"{where} with stage {stage} running {ran} (F forward, B backward), the model replays {want}: "
                f"torch's {type(schedule).__name__} changed its order"
            )


def run_dir(rank: int) -> Path:
    """This rank's own directory for what the run makes (the launcher's private directory when it started
    the rank, else a new temporary one)."""
    base = os.environ.get(RUN_DIR)
    where = Path(base) if base else Path(tempfile.mkdtemp(prefix="commgate-torchtitan-"))
    out = where / "torchtitan" / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    return out


class TorchtitanWorkload:
    """torchtitan's own Trainer of the scenario's job; ``step(k)`` is one ``train_step``."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        job = Job.of(scenario)
        os.environ.setdefault("LOCAL_RANK", str(rank))  # tools/utils.py:73-75 requires it
        prepare(device.type)
        where = run_dir(rank)
        tokenizer, data = make_assets(where, min(scenario.model.V, 512))
        argv = overrides(scenario, job, tokenizer=tokenizer, data=data, dump=where / "outputs")
        config = parse(scenario, job, argv)
        check_config(config, scenario, job)
        with_scenario_model(config, scenario, job)
        leave_off(config, job)
        self.trainer = build(config, job)
        if self.trainer.parallel_dims.pp_enabled:
            microbatch_step(self.trainer.pp_schedule)
        check_built(self.trainer, scenario, job)
        self.data: Iterator[Any] = self.trainer.batch_generator(self.trainer.dataloader)
        print(
            f"commgate: torchtitan {job.module}:{job.config}; workarounds: {', '.join(APPLIED) or 'none'}", flush=True
        )

    def step(self, k: int) -> float:
        self.trainer.step += 1  # train() does it before train_step (trainer.py:1036)
        with one_line(f"torchtitan's train_step (step {self.trainer.step})"):
            self.trainer.train_step(self.data)
        return 0.0


def read_config(module: str, config: str) -> TitanJob:
    """A torchtitan 0.3.0 config function's job, as torchtitan's own ``ConfigManager`` builds it (no process
    group, nothing trained): ``commgate import --torchtitan MODULE:CONFIG``."""
    import logging

    where = f"{module}:{config}"
    without_triton()
    device_type("cpu")  # before anything imports torchtitan
    root = logging.getLogger()  # torchtitan's logger: its warnings about the job's assets, absent here
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        cfg, float8 = read(["--module", module, "--config", config], where)
    finally:
        root.setLevel(level)
    from torchtitan.components.loss import ChunkedLossWrapper  # imported by the config by now

    model = cfg.model_spec.model
    if not hasattr(model, "layers") or not hasattr(model, "vocab_size"):
        raise CommgateError(f"torchtitan config {where} builds {type(model).__qualname__}; commgate models llama3 only")
    if swapped := converted(model):  # float8's converter was built disabled; MX, NVFP4, async TP's fused GEMMs
        raise CommgateError(f"torchtitan config {where} converts linear layers ({', '.join(swapped)}): not modelled")
    text_loader(cfg, where)
    dims = model_dims(model)
    par, training = cfg.parallelism, cfg.training
    chunked = isinstance(cfg.loss, ChunkedLossWrapper.Config)
    ac = ac_mode(cfg)
    if ac is None:
        kind = type(cfg.activation_checkpoint).__qualname__
        raise CommgateError(f"torchtitan config {where} checkpoints with {kind}: not modelled")
    return TitanJob(
        source=where,
        config=config,
        module=module,
        model=dims,
        local_batch_size=training.local_batch_size,
        global_batch_size=training.global_batch_size,
        seq_len=training.seq_len,
        dp=par.data_parallel_shard_degree,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        cp=par.context_parallel_degree,
        replicate=par.data_parallel_replicate_degree,
        schedule=par.pipeline_parallel_schedule,
        microbatch_size=par.pipeline_parallel_microbatch_size,
        sequence_parallel=par.enable_sequence_parallel,
        ac=ac,
        loss="chunked" if chunked else "cross_entropy",
        loss_chunks=cfg.loss.num_chunks if chunked else Job().loss_chunks,
        log_freq=cfg.metrics.log_freq,
        mixed_precision_param=training.mixed_precision_param,
        reshard=par.fsdp_reshard_after_forward,
        cpu_offload=training.enable_cpu_offload,
        compile=cfg.compile.enable,
        async_tp=cfg.compile.enable_async_tensor_parallel,
        float8=float8,
        notes=(f"{where}: read by torchtitan's own ConfigManager",),
    )
