"""The measured steps' windows on one rank, opened and closed by ``commgate.run.rank.run_rank`` around
commgate's workloads' ``step(k)``, or by a trainer that runs its own loop from its hooks
(``commgate.run.workloads.OwnLoop``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from commgate.run.capture import StepWindow
from commgate.run.inject import Faults
from commgate.run.threadclock import ThreadClock

if TYPE_CHECKING:
    import torch


class Steps:
    """The measured steps' windows on one rank: ``begin(k)`` labels what follows step k's and starts its
    window (after the planted faults due before it), ``end()`` closes the open one (the faults due after it
    first; on CUDA, the step's kernels inside), ``close()`` ends the last and labels what follows as after
    every step (a trainer's teardown: outside every window). ``run_rank`` drives them around commgate's
    workloads' ``step(k)``; a trainer that runs its own loop calls them from its hooks
    (``commgate.run.workloads.OwnLoop``)."""

    def __init__(self, rec: Any, faults: Faults, device: torch.device, *, rank: int, world_size: int) -> None:
        self.rec, self.faults, self.device, self.rank, self.world_size = rec, faults, device, rank, world_size
        self.clock = ThreadClock() if device.type == "cpu" else None  # on CUDA the thread's time is not the step's
        self.open: tuple[int, int, int | None] | None = None
        """(step, start, the thread's busy time then) of the open window."""
        self.marks: dict[str, float] | None = None
        """Set for a trainer's own loop: its engine is built inside it, so the first step marks ``built``."""
        self.last = -1

    def begin(self, k: int) -> None:
        from commgate.run import planted

        self.end()
        if self.marks is not None and self.last < 0:
            self.marks["built"] = time.monotonic()
        self.rec.poll()
        self.rec.step, self.rec.phase = k, "forward"
        planted.before_step(self.faults, k, rank=self.rank, world_size=self.world_size)
        busy = self.clock.busy_ns() if self.clock else None
        self.open, self.last = (k, self.rec.now(), busy), k

    def end(self) -> None:
        import torch

        from commgate.run import planted

        if self.open is None:
            return
        k, begun, busy = self.open
        self.open = None
        planted.after_step(self.faults, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are inside its window
        self.rec.poll()
        ended = self.rec.now()
        busy_after = self.clock.busy_ns() if self.clock else None
        blocked = None if busy is None or busy_after is None else max(0, ended - begun - (busy_after - busy))
        self.rec.windows.append(StepWindow(rank=self.rank, step=k, start_ns=begun, end_ns=ended, blocked_ns=blocked))

    def close(self) -> None:
        self.end()
        self.rec.step = self.last + 1  # after every step: in no window
        if self.clock:
            self.clock.close()
            self.clock = None
