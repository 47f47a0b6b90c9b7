"""Planted faults at work inside a rank (``--commgate-fault``; ``commgate.run.inject`` parses them).

The faults on calls, ``delay-first-recv`` and ``slow``, are a ``DelayingRecorder``: a rank installs it
instead of the plain ``Recorder`` only when one of them is planted, so that the capture's issue path never
asks whether a fault is planted. The faults on steps, ``late-rank`` and ``extra-collective``, are
``before_step`` and ``after_step``, which the rank calls around each step. Configuration faults
(``ddp-bucket-mb``, ``zero-stage``) change the scenario before it runs (``Faults.apply``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commgate.model.collectives import Op
from commgate.run.inject import Faults
from commgate.run.recorder import FIELDS, Recorder

_BYTES, _START = FIELDS.index("bytes"), FIELDS.index("start_ns")

_Key = tuple[str, tuple[int, ...], int]
"""(op, group, bytes): the calls a ``slow`` fault compares with one another."""


class DelayingRecorder(Recorder):
    """A ``Recorder`` that delays calls as the planted faults say, once a call is recorded and before it
    is posted, so that the delay is counted in the call's latency:

    * ``delay-first-recv``: the first recv of step 0 waits ``delay_first_recv_s``, once;
    * ``slow``: op -> factor; a call of that op waits factor - 1 times the median of what this rank's
      earlier calls of the same op, group and size took without the wait; a key's first call, factor - 1
      times what the op's earlier call nearest in size took (DDP rebuilds its buckets after the first
      step: the first measured step's calls are each the first of their size, and left unslowed they were
      the op's fastest tenth, so that its floor hardly moved under a planted 20x);
    * ``late-rank``: the first call of step 0 tells the late rank it was issued (``ARRIVED``), so that
      the late rank's wait (``before_step``) starts once its peers wait for it, however late a loaded
      machine started them.
    """

    def __init__(self, rank: int, faults: Faults) -> None:
        super().__init__(rank)
        self.delay_first_recv_s = faults.delay_first_recv_ms / 1000
        self.slow = dict(faults.slow)
        self.announce = bool(faults.late_rank_ms)
        self._unslowed: dict[_Key, list[int]] = {}
        """Each key's calls' durations without the wait."""
        self._by_size: dict[str, dict[int, int]] = {}
        """Each op's calls' last duration without the wait, by bytes."""
        self._waits: dict[int, tuple[_Key, int]] = {}
        """seq -> (key, the wait it was given), until the call completes."""

    def issue(
        self, op: Op, group: tuple[int, ...], tensors: Sequence[torch.Tensor], peer: int | None, root: int | None
    ) -> int:
        seq = super().issue(op, group, tensors, peer, root)
        if self.announce and self.step == 0:
            self.announce = False
            dist.distributed_c10d._get_default_store().set(ARRIVED.format(rank=self.rank), "1")
        if str(op) in self.slow:
            self._slow_down(seq, (str(op), group, self._open[seq][_BYTES]), self.slow[str(op)])
        if op is Op.RECV and self.delay_first_recv_s and self.step == 0:
            self._hold(self.delay_first_recv_s)  # once
            self.delay_first_recv_s = 0.0
        return seq

    def _hold(self, seconds: float) -> None:
        """Sleep with the call open, saying so (``holding``): a planted wait, however long a loaded machine
        makes it (19x a call's time under ``slow=OP:20``), is not a stall."""
        self.holding = True
        try:
            time.sleep(seconds)
        finally:
            self.holding = False

    def _slow_down(self, seq: int, key: _Key, factor: float) -> None:
        """Wait (factor - 1) x the median of this key's earlier unslowed times, or on its first call, of the
        unslowed time of the op's earlier call nearest in size (nothing on the op's first call)."""
        earlier = sorted(self._unslowed.get(key, ()))
        sizes = self._by_size.get(key[0], {})
        if earlier:
            wait = int((factor - 1) * earlier[len(earlier) // 2])
        elif sizes:
            near = min(sizes, key=lambda b: abs(math.log((b + 1) / (key[2] + 1))))
            wait = int((factor - 1) * sizes[near])
        else:
            wait = 0
        self._waits[seq] = (key, wait)
        if wait:
            self._hold(wait / 1e9)

    def _close(self, seq: int, end: int) -> tuple[tuple[Any, ...], int] | None:
        done = super()._close(seq, end)
        if done is not None and seq in self._waits:
            key, wait = self._waits.pop(seq)
            rec, stamped = done
            unslowed = stamped - rec[_START] - wait
            self._unslowed.setdefault(key, []).append(unslowed)
            self._by_size.setdefault(key[0], {})[key[2]] = unslowed
        return done


def recorder(faults: Faults) -> Callable[[int], Recorder]:
    """What makes a rank's recorder (``commgate.run.interpose.install``): the plain ``Recorder`` unless a
    fault on calls is planted."""
    if not faults.delay_first_recv_ms and not faults.slow and not faults.late_rank_ms:
        return Recorder
    return functools.partial(DelayingRecorder, faults=faults)


ARRIVED = "commgate/late-rank/arrived/{rank}"
"""The store key a rank sets when it issues its first call of step 0 (``late-rank`` planted)."""
ARRIVALS_WAIT = timedelta(seconds=120)
"""How long the late rank waits for its peers' first calls (a scenario whose peers issue none in step 0
sleeps from when the wait gives up)."""


def before_step(faults: Faults, step: int, *, rank: int, world_size: int) -> None:
    """``late-rank``: the last rank starts step 0 ``late_rank_ms`` after every other rank issued its first
    call of it (not after its own start: on a loaded machine the ranks start far apart), so that they
    wait for it in that call."""
    if step == 0 and faults.late_rank_ms and rank == world_size - 1:
        store = dist.distributed_c10d._get_default_store()
        with contextlib.suppress(RuntimeError):  # (a peer that issued nothing in step 0: no wait to time)
            store.wait([ARRIVED.format(rank=r) for r in range(world_size - 1)], ARRIVALS_WAIT)
        time.sleep(faults.late_rank_ms / 1000)


def after_step(faults: Faults, device: torch.device) -> None:
    """``extra-collective``: one more all-reduce (1 fp32, whole world) after the step."""
    if faults.extra_collective:
        dist.all_reduce(torch.zeros(1, device=device))
