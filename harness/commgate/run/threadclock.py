"""How long the training thread was blocked: its wall time less its time on a CPU and its time waiting
for one. On CPU ranks a thread blocks only on what it waits for (a collective, a peer's message, the
GIL for a moment), so a step's blocked time is its exposed communication, and what the time model
compares with its exposed-communication prediction.

On Linux: ``CLOCK_THREAD_CPUTIME_ID`` (``time.thread_time_ns``) for the time on a CPU, and the run-queue
delay of ``/proc/self/task/<tid>/schedstat`` (its second field, in ns; kept up to date when the thread
is switched in) for the time spent runnable but waiting for a core, which is what ranks sharing fewer
cores than they are lose. Elsewhere, or without schedstat, nothing is measured.
"""

from __future__ import annotations

import os
import threading
import time


class ThreadClock:
    """The calling thread's (time on a CPU + time waiting for one), in ns, or None where not measured."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def busy_ns(self) -> int | None:
        if self._fd is None:
            return None
        try:
            runnable = int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None
        return time.thread_time_ns() + runnable

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
