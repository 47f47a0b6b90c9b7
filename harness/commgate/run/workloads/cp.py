"""Context parallelism with torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``),
as torchtitan runs it: a (dp, cp, tp) device mesh; every micro-batch's inputs, labels and positions split
over the cp ranks by torch's head-tail load balancer, and forward and backward inside ``context_parallel``,
which turns every ``scaled_dot_product_attention`` into torch's ring attention over the cp group; DTensor
tensor parallelism inside (tp > 1); ``DistributedDataParallel`` over the dp x cp ranks, which all hold
partial gradients.

On CPU, torch 2.13's ring dispatches only the CUDA attention kernels (flash, efficient, cuDNN): the CPU
flash kernel has no handler, and DTensor stops with "does not have a sharding strategy registered".
``cpu_ring_attention`` adds the two missing handlers. They call torch's own ring,
``_templated_ring_attention`` and ``_templated_ring_attention_backward``, with the CPU kernel in place of the
CUDA one, so every collective (the K/V rotater, the dK/dV rotation, their buffers and dtypes) is torch's.
The results equal plain attention to within 1e-6 (tests/test_context_parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario
from commgate.run.interpose import optimizer_phase
from commgate.run.workloads.gpt import DTYPES, GPT, batch
from commgate.run.workloads.tp import localize, parallelize

SEQ_DIM = 2
"""The sequence dimension of attention's (batch, heads, seq, head_dim) tensors, which torch's ring shards."""


def _ring() -> Any:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _as_sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A rank's sequence shard as the DTensor the dispatcher hands back (global shape: seq x mesh size)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    stride = torch.empty(shape, dtype=local.dtype, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(SEQ_DIM),), TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _cpu_forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DTensor, DTensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)``
    on sequence-sharded DTensors: torch's ring forward, which returns (out, logsumexp) as the kernel does."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
    mesh, local = info.compute_mesh, dict(info.local_kwargs)
    q, k, v, *rest = info.local_args
    for name, value in zip(("dropout_p", "is_causal"), rest, strict=False):
        local[name] = value
    if local.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism runs causal attention without an explicit mask")
    local.pop("attn_mask", None)
    aten = torch.ops.aten
    out, lse = _ring()._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu, query=q, key=k, value=v, **local
    )
    return _as_sharded(out, mesh), _as_sharded(lse, mesh)


_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")


def _cpu_backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DTensor, ...]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: torch's ring backward."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
    mesh = info.compute_mesh
    named = dict(zip(_BACKWARD_ARGS, info.local_args, strict=False)) | dict(info.local_kwargs)
    named.pop("attn_mask", None)
    grads = _ring()._templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out_name="grad_out",
        **named,
    )
    return tuple(_as_sharded(g, mesh) for g in grads[:3])


def cpu_ring_attention() -> None:
    """Register the CPU flash-attention kernel's forward and backward with torch's context-parallel
    dispatcher (``_attention.custom_ops``, which ``context_parallel`` installs on entry)."""
    aten = torch.ops.aten
    ops = _ring().custom_ops
    ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_forward
    ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _cpu_backward


def use_ring(device: torch.device, rotate: str) -> None:
    """Torch's ring attention on ``device`` (on CPU with ``cpu_ring_attention``), passing K/V as ``rotate``
    (``cp_rotate``) says: ``allgather`` or ``alltoall``."""
    if device.type == "cpu":
        cpu_ring_attention()
    _ring().set_rotate_method(rotate)


@contextlib.contextmanager
def sequence_split(mesh: DeviceMesh, tokens: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Inside: the inputs, labels and positions of ``tokens`` (b, s + 1) split over the context-parallel
    ``mesh`` (torch's head-tail load balancer when 2 * cp divides s), and every attention torch's ring."""
    # own storage for each: context_parallel splits them in place (views of one tensor would overlap)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    positions = torch.arange(inputs.shape[1], device=tokens.device)
    split = [inputs, labels, positions]
    with context_parallel(mesh, buffers=split, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(split)):
        yield inputs, labels, positions


class CPWorkload:
    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        par, m = scenario.parallelism, scenario.model
        self.s, self.device = scenario, device
        self.dp_rank = rank // (par.cp * par.tp)  # the ranks of a context-parallel group read the same sequences
        use_ring(device, par.cp_rotate)
        mesh = init_device_mesh(device.type, (par.dp, par.cp, par.tp), mesh_dim_names=("dp", "cp", "tp"))
        self.cp_mesh = mesh["cp"]
        torch.manual_seed(0)
        model = GPT(m, checkpointing=par.activation_checkpointing).to(device=device, dtype=DTYPES[m.dtype])
        if par.tp > 1:
            parallelize(model, mesh["tp"])
            localize(model)
        data = mesh["dp", "cp"]._flatten("dp_cp")
        self.engine = DistributedDataParallel(model, process_group=data.get_group(), bucket_cap_mb=par.ddp_bucket_mb)
        self.optimizer = torch.optim.AdamW(self.engine.parameters(), lr=1e-4, foreach=False)

    def step(self, k: int) -> float:
        par, m = self.s.parallelism, self.s.model
        loss = torch.zeros(())
        for i in range(par.micro_batches):
            tokens = batch(m, par.micro_batch, seed=1000 * k + 10 * i + self.dp_rank, device=self.device)
            sync = i == par.micro_batches - 1
            with (
                contextlib.nullcontext() if sync else self.engine.no_sync(),
                sequence_split(self.cp_mesh, tokens) as split,
                loss_parallel() if par.tp > 1 else contextlib.nullcontext(),
            ):
                loss = self.engine(*split)
                loss.backward()
        with optimizer_phase():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())


class _RingCheck:
    """A check, not a training workload (``workload: commgate.run.workloads.cp:ring_check``): every step
    the decoder's loss and the gradients of its inputs' attention, computed under ``context_parallel`` on
    this rank's load-balanced part of the sequences, must equal the plain single-process ones; a rank
    whose results differ raises."""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        par = scenario.parallelism
        self.s, self.device = scenario, device
        use_ring(device, par.cp_rotate)
        self.mesh = init_device_mesh(device.type, (par.cp,))
        torch.manual_seed(0)
        self.model = GPT(scenario.model).to(device=device, dtype=DTYPES[scenario.model.dtype])

    def step(self, k: int) -> float:
        m, b = self.s.model, self.s.parallelism.micro_batch
        tokens = batch(m, b, seed=k, device=self.device)
        whole = self._loss_and_grads(tokens)
        with sequence_split(self.mesh, tokens) as split:
            part = self._loss_and_grads(*split)
        # each rank's loss is the mean over its part of the tokens: the parts' mean is the whole's
        torch.distributed.all_reduce(part, group=self.mesh.get_group())
        part /= self.mesh.size()
        tolerance = 1e-5 if m.dtype == "fp32" else 3e-2
        for what, got, want in (("loss", part[:1], whole[:1]), ("gradient", part[1:], whole[1:])):
            scale = float(want.abs().max().clamp(min=1.0))
            if (diff := float((got - want).abs().max())) > tolerance * scale:
                raise CommgateError(f"ring attention's {what} differs from plain attention's by {diff:.3g}")
        return float(part[0])

    def _loss_and_grads(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The loss and every parameter's gradient, flat, in fp32."""
        self.model.zero_grad(set_to_none=True)
        loss = self.model(*inputs)
        loss.backward()
        grads = [p.grad.reshape(-1).float() for p in self.model.parameters() if p.grad is not None]
        return torch.cat([loss.detach().float().reshape(1), *grads])


def ring_check(scenario: Scenario, *, rank: int, device: torch.device) -> _RingCheck:
    return _RingCheck(scenario, rank=rank, device=device)
