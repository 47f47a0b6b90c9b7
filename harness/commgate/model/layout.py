"""Which ranks form which process groups.

The order is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; model fastest):
``rank = pipe * (dp * tp) + data * tp + model``. Tensor-parallel groups are therefore consecutive ranks
(inside a node), pipeline groups are strided by ``dp * tp``. MoE groups follow DeepSpeed's
``_create_expert_and_data_parallel``: inside each data-parallel group, expert-parallel groups are
consecutive chunks of ``ep`` ranks and expert-data-parallel groups take one rank of each chunk.
ZeRO++ hpZ groups are consecutive chunks of ``hpz`` ranks of a data-parallel group.

Context parallelism (torchtitan's mesh ``(dp, cp, tp)``): ``dp`` here counts every rank of a gradient
reduction, the scenario's dp times cp (``Parallelism.data_ranks``); the context-parallel groups are
consecutive chunks of ``cp`` ranks of each data-parallel group, like hpZ's.

HSDP (``replicate`` > 1, torchtitan's mesh ``(pp, dp_replicate, dp_shard, cp, tp)``): the replica is the
axis between pipe and data, ``rank = pipe * (replicate * dp * tp) + (replica * dp + data) * tp + model``;
the sharding (dp) groups lie inside one replica, the replicate groups take the same (data, model) rank of
each replica. With replicate = 1 this is the order above.

Naming: an *axis* is one of ``dp, tp, pp, ep, edp, hpz, rep, world``; a *group* is a tuple of global ranks.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Literal

Axis = Literal["dp", "tp", "pp", "mp", "ep", "edp", "hpz", "rep", "cp", "world"]
Group = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    hpz: int = 1
    replicate: int = 1
    """HSDP replicas (with tp = pp = 1)."""
    cp: int = 1
    """Context-parallel ranks, consecutive within each data-parallel group (``dp`` counts them too)."""

    @property
    def world_size(self) -> int:
        return self.replicate * self.dp * self.tp * self.pp

    @property
    def block(self) -> int:
        """Ranks of one pipeline stage (every replica's)."""
        return self.replicate * self.dp * self.tp

    def rank(self, *, pipe: int, data: int, model: int, replica: int = 0) -> int:
        return pipe * self.block + (replica * self.dp + data) * self.tp + model

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipe, data, model) of a global rank (HSDP: data is its index in its replica's sharding group)."""
        pipe, rest = divmod(rank, self.block)
        data, model = divmod(rest, self.tp)
        return pipe, data % self.dp, model

    def _stages(self, pipe: int | None) -> range | tuple[int]:
        return range(self.pp) if pipe is None else (pipe,)

    @functools.cache  # noqa: B019 - Layout is a small frozen value; its groups are reused by every row
    def dp_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        """Data-parallel (HSDP: sharding) groups, of one pipeline stage or of all: one per replica and
        tensor-parallel rank (ranks ``tp`` apart inside a replica's ``dp * tp``)."""
        span = self.dp * self.tp
        return tuple(
            tuple(range(p * self.block + r * span + m, p * self.block + (r + 1) * span, self.tp))
            for p in self._stages(pipe)
            for r in range(self.replicate)
            for m in range(self.tp)
        )

    @functools.cache  # noqa: B019
    def replicate_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        """HSDP: the ranks holding the same shard, one in each replica (``dp * tp`` apart), of one pipeline
        stage or of all."""
        span = self.dp * self.tp
        return tuple(
            tuple(range(p * self.block + k, (p + 1) * self.block, span))
            for p in self._stages(pipe)
            for k in range(span)
        )

    @functools.cache  # noqa: B019
    def data_groups(self) -> tuple[Group, ...]:
        """Every data rank of every replica, one group per pipeline stage and tensor-parallel rank (the
        data-parallel groups without replicas)."""
        return tuple(
            tuple(range(p * self.block + m, (p + 1) * self.block, self.tp))
            for p in range(self.pp)
            for m in range(self.tp)
        )

    @functools.cache  # noqa: B019
    def tp_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        """Consecutive ``tp`` ranks: one group per stage, replica and data rank."""
        return tuple(
            tuple(range(p * self.block + k * self.tp, p * self.block + (k + 1) * self.tp))
            for p in self._stages(pipe)
            for k in range(self.replicate * self.dp)
        )

    @functools.cache  # noqa: B019
    def pp_groups(self) -> tuple[Group, ...]:
        return tuple(tuple(range(r, self.world_size, self.block)) for r in range(self.block))

    @functools.cache  # noqa: B019
    def mp_groups(self) -> tuple[Group, ...]:
        """DeepSpeed's model-parallel groups: the ranks of one data-parallel index, every stage and
        tensor-parallel rank (the pipeline groups when tp = 1)."""
        return tuple(
            tuple(self.rank(pipe=p, data=d, model=m) for p in range(self.pp) for m in range(self.tp))
            for d in range(self.dp)
        )

    @functools.cache  # noqa: B019
    def stage_pairs(self, src: int, dst: int) -> tuple[Group, ...]:
        """(sender, receiver) pairs between pipeline stages ``src`` and ``dst``, one per pipeline."""
        block = self.block
        return tuple(zip(range(src * block, (src + 1) * block), range(dst * block, (dst + 1) * block), strict=False))

    def _chunks(self, size: int, pipe: int | None) -> tuple[Group, ...]:
        return tuple(g[i : i + size] for g in self.dp_groups(pipe) for i in range(0, len(g), size))

    def ep_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        return self._chunks(self.ep, pipe)

    def edp_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        return tuple(g[j :: self.ep] for g in self.dp_groups(pipe) for j in range(self.ep))

    def hpz_groups(self, pipe: int | None = None) -> tuple[Group, ...]:
        return self._chunks(self.hpz, pipe)

    def cp_groups(self) -> tuple[Group, ...]:
        """The ranks that split one sequence (the same data-parallel replica and tensor-parallel rank)."""
        return self._chunks(self.cp, None)

    def batch_groups(self) -> tuple[Group, ...]:
        """The ranks of one context-parallel index across the data ranks of every replica: those that read
        different batches (torchtitan's ``batch`` mesh; ``data_groups`` when cp = 1)."""
        return tuple(g[j :: self.cp] for g in self.data_groups() for j in range(self.cp))

    def dp_chunks(self, size: int) -> tuple[Group, ...]:
        """Consecutive chunks of ``size`` ranks of every data-parallel group (FSDP2's post-forward groups
        with an int ``reshard_after_forward``: ``mesh.view(-1, size)``)."""
        return self._chunks(size, None)

    def world(self) -> tuple[Group, ...]:
        return (tuple(range(self.world_size)),)


def group_text(group: tuple[int, ...]) -> str:
    """A process group as a list of ranks; one of more than 8 evenly spaced ranks (an emulated run's
    data-parallel groups) by its ends and count, ``[0, 1, ..., 1023] (1024 ranks)``."""
    n = len(group)
    if n <= 8 or any(b - a != group[1] - group[0] for a, b in itertools.pairwise(group)):
        return str(list(group))
    return f"[{group[0]}, {group[1]}, ..., {group[-1]}] ({n} ranks)"
