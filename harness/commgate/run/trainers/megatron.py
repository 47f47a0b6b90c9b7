"""Megatron-core 0.16.1 on commgate's ranks (trainer ``megatron``): its own ``GPTModel`` (the local layer
spec; this rank's pipeline stage of it), its ``DistributedDataParallel``, ``get_megatron_optimizer`` and the schedule of
``get_forward_backward_func``, built and stepped as Megatron's ``examples/run_simple_mcore_train_loop.py``
does (and ``megatron/training`` wires ``no_sync_func``, ``finalize_model_grads_func``, ``grad_sync_func``
and ``param_sync_func``); then checked against the scenario (``check_built``).

The CPU workarounds (paths under ``megatron/core/``), each applied only on a CPU rank and only while
Megatron builds or steps (``workarounds``), each tested in ``tests/test_megatron.py`` so that the test
fails when upstream changes under it:

* W1, the RNG tracker: ``model_parallel_cuda_manual_seed`` (``tensor_parallel/random.py:423``) stores
  ``torch.cuda.get_rng_state()`` (``random.py:235,238``) and ``fork()`` swaps states through
  ``_get_cuda_rng_state``/``_set_cuda_rng_state`` (``random.py:55,72-110``): the CPU generator's state.
* W2, ``torch.cuda.current_device()`` as the CPU device: the buffers of ``utils.py:631``
  (GlobalMemoryBuffer), ``tensor_parallel/mappings.py:141,181``, ``tensor_parallel/layers.py:552`` and
  ``distributed/param_and_grad_buffer.py:800,806``.
* W3, ``torch.zeros``/``torch.tensor`` with ``device="cuda"`` made on the CPU: the token count of
  ``pipeline_parallel/schedules.py:596``, the optimizer's ``optimizer/optimizer.py:481,485,907``,
  ``optimizer/clip_grads.py:103,174`` and ``utils.py:1207`` (``local_multi_tensor_l2_norm``).
* W4, ``Tensor.cuda()`` as the tensor itself: the tied embedding's sync at construction
  (``models/common/language_module/language_module.py:244``; tied embeddings across pipeline stages).
* W5, ``torch.cuda.synchronize()`` as nothing: ``pipeline_parallel/p2p_communication.py:398`` (pipeline
  stages).
* W6, ``Tensor.type()`` of a CPU tensor answering ``torch.cuda.*Tensor``: the string checks of
  ``optimizer/optimizer.py:671,690``, ``optimizer/distrib_optimizer.py:361,420,582`` and
  ``optimizer/clip_grads.py:167``.
* W7, sequence parallelism with the local spec's torch LayerNorm: ``transformer/torch_norm.py:32``
  asserts ``not config.sequence_parallel`` (apex and Transformer Engine are the only sequence-parallel
  norms); the norm is built from a copy of the config without it and its parameters marked
  ``sequence_parallel`` as apex's ``FusedLayerNorm`` marks them, so that ``finalize_model_grads``
  all-reduces their gradients over the tensor-parallel ranks (``distributed/finalize_model_grads.py:376``)
  as on a GPU.

Phases: the schedule's forward is ``forward``, autograd ``backward``; ``finalize_model_grads`` (the
gradient reduction the schedule issues after the last backward, and the sequence-parallel norms') is
labelled ``backward`` and the optimizer's step ``optimizer``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario
from commgate.model.trainers.megatron import Job, param_shapes
from commgate.run.interpose import phase

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
APPLIED: list[str] = []
"""The workarounds applied on this rank (printed once the job is built)."""


def _cuda(device: Any) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def made(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return made


def _type_string(original: Callable[..., Any]) -> Callable[..., Any]:
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu":
            return str(original(self)).replace("torch.", "torch.cuda.", 1)
        return original(self, *args, **kwargs)

    return type_


def _sp_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def new(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    return new


def _patches() -> list[tuple[Any, str, Any, str]]:
    """(owner, attribute, replacement, workaround) of each CPU workaround."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    def itself(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    return [
        (torch.cuda, "get_rng_state", get_state, "W1"),
        (torch.cuda, "set_rng_state", set_state, "W1"),
        (mrandom, "_get_cuda_rng_state", get_state, "W1"),
        (mrandom, "_set_cuda_rng_state", set_state, "W1"),
        (torch.cuda, "current_device", lambda: torch.device("cpu"), "W2"),
        (torch, "zeros", _on_cpu(torch.zeros), "W3"),
        (torch, "tensor", _on_cpu(torch.tensor), "W3"),
        (torch.Tensor, "cuda", itself, "W4"),
        (torch.cuda, "synchronize", lambda *a, **k: None, "W5"),
        (torch.Tensor, "type", _type_string(torch.Tensor.type), "W6"),
        (WrappedTorchNorm, "__new__", staticmethod(_sp_norm(WrappedTorchNorm.__new__)), "W7"),
    ]


def preload() -> None:
    """What ``_build`` imports, imported in the ranks' forkserver (``commgate.run.preload``): Megatron-core's
    model, DDP, optimizer and schedules (and what they import: wandb). No workaround is applied: each is a
    patch of a run."""
    import megatron.core.distributed
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.pipeline_parallel
    import megatron.core.tensor_parallel  # noqa: F401


_ABSENT = object()


@contextlib.contextmanager
def workarounds(device: torch.device) -> Iterator[None]:
    """W1-W7 (the module's docstring) while Megatron builds or steps on a CPU rank, put back after (a rank
    may run another trainer's job next in the same process)."""
    if device.type != "cpu":
        yield
        return
    saved = []
    for owner, name, replacement, label in _patches():
        saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, replacement)
        if label not in APPLIED:
            APPLIED.append(label)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _finalize_labelled(finalize: Callable[..., Any]) -> Callable[..., Any]:
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with phase("backward"):
            return finalize(*args, **kwargs)

    return labelled


def _tokens(vocab: int, b: int, s: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Random micro-batches of ``b`` sequences of ``s`` tokens (one stream per data-parallel rank, the same
    on every tensor-parallel rank), each with its next-token labels."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    while True:
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        yield {
            "tokens": ids[:, :-1].contiguous(),
            "labels": ids[:, 1:].contiguous(),
            "position_ids": positions,
            "attention_mask": mask,
            "loss_mask": torch.ones(b, s),
        }


def _loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The per-token loss summed with its token count, as Megatron's pretrain_gpt ``loss_func`` returns it."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}


def _forward_step(data: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, functools.partial(_loss, batch["loss_mask"])


def check_built(
    model: Any, scenario: Scenario, job: Job, *, tp_rank: int, tp: int, dp: int, stage: int = 0, pp: int = 1
) -> None:
    """The job Megatron built is the scenario's: its groups' sizes and its parameters, name by name (in
    registration order, the order its gradient buckets follow), on this rank's pipeline stage."""
    where = "megatron-core built the job"
    par = scenario.parallelism
    if (tp, dp, pp) != (par.tp, par.data_ranks, par.pp):
        raise CommgateError(
            f"{where} with tp={tp}, dp={dp}, pp={pp}; the scenario describes tp={par.tp}, dp={par.data_ranks}, "
            f"pp={par.pp}"
        )
    built = [(n.removeprefix("module."), tuple(p.shape), getattr(p, "shared_embedding", False))
             for n, p in model.named_parameters()]  # fmt: skip
    wanted = [(p.name, p.shape, p.shared_embedding) for p in param_shapes(scenario, job, stage)]
    if built != wanted:
        diff = next(
            (f"{b} vs {w}" for b, w in zip(built, wanted, strict=False) if b != w),
            f"{len(built)} vs {len(wanted)} tensors",
        )
        raise CommgateError(
            f"{where} (tensor rank {tp_rank}, stage {stage}) with parameters that differ from the model's: {diff}"
        )


def recompute(scenario: Scenario, job: Job) -> dict[str, Any]:
    """``TransformerConfig``'s recompute fields of the scenario's checkpointing: full, every layer (uniform,
    one layer a checkpoint), or selective (the core attention); none without it."""
    if not scenario.parallelism.activation_checkpointing:
        return {}
    if job.recompute_granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _configs(scenario: Scenario, job: Job) -> tuple[Any, Any, Any]:
    """Megatron's ``TransformerConfig``, ``DistributedDataParallelConfig`` and ``OptimizerConfig`` of the
    scenario's job (no dropout, weights initialised on the CPU: the same on every tensor-parallel degree)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, par = scenario.model, scenario.parallelism
    dtype, bf16 = TORCH_DTYPES[m.dtype], m.dtype == "bf16"
    config = TransformerConfig(
        num_layers=m.L,
        hidden_size=m.h,
        num_attention_heads=m.a,
        num_query_groups=m.kv,
        ffn_hidden_size=m.ffn,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **recompute(scenario, job),
    )
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=job.grad_reduce_in_fp32,
        overlap_grad_reduce=job.overlap_grad_reduce,
        overlap_param_gather=job.overlap_param_gather,
        use_distributed_optimizer=job.use_distributed_optimizer,
        average_in_collective=job.average_in_collective,
        bucket_size=job.bucket_size,
    )
    optimizer = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=bf16,
        params_dtype=dtype,
        use_distributed_optimizer=job.use_distributed_optimizer,
        clip_grad=job.clip_grad,
    )
    return config, ddp, optimizer


class MegatronWorkload:
    """Megatron-core's own job on one rank; ``step(k)`` is one ``get_forward_backward_func`` pass over the
    micro-batches and the optimizer's step."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.s, self.job, self.device = scenario, Job.of(scenario), device
        with workarounds(device):
            self._build(rank)
        print(f"commgate: megatron-core GPTModel (local spec); workarounds: {', '.join(APPLIED) or 'none'}", flush=True)

    def _build(self, rank: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        s, job, par, m = self.s, self.job, self.s.parallelism, self.s.model
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, create_gloo_process_groups=False
        )
        torch.manual_seed(job.seed)
        model_parallel_cuda_manual_seed(job.seed)
        config, ddp_config, optimizer_config = _configs(s, job)
        model: Any = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=m.V,
            max_sequence_length=m.s,
            share_embeddings_and_output_weights=m.tied_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        tp_rank, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_world_size()
        check_built(
            model,
            s,
            job,
            tp_rank=tp_rank,
            tp=ps.get_tensor_model_parallel_world_size(),
            dp=dp,
            stage=ps.get_pipeline_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(),
        )
        if m.dtype == "bf16":  # as megatron/training's get_model wraps it
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = _finalize_labelled(finalize_model_grads)
        if job.overlap_grad_reduce:
            config.grad_sync_func = ddp.start_grad_sync
            if job.overlap_param_gather:
                config.param_sync_func = ddp.start_param_sync
        self.model = ddp
        self.optimizer = get_megatron_optimizer(optimizer_config, [ddp], use_gloo_process_groups=False)
        self.schedule = get_forward_backward_func()
        self.data = _tokens(m.V, par.micro_batch, m.s, job.seed + ps.get_data_parallel_rank())

    def step(self, k: int) -> float:
        par = self.s.parallelism
        with workarounds(self.device):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.schedule(
                forward_step_func=_forward_step,
                data_iterator=self.data,
                model=[self.model],
                num_microbatches=par.micro_batches,
                seq_length=self.s.model.s,
                micro_batch_size=par.micro_batch,
                forward_only=False,
            )
            with phase("optimizer"):
                self.optimizer.step()
        return 0.0
