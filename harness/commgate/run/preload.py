"""Imported by the ranks' forkserver where no GPU is visible (``commgate.run.launcher``): the trainers
named in ``COMMGATE_PRELOAD`` (``hf,torchtitan``; the trainers of the scenarios the process runs) imported
once, by their adapters' ``preload()``, so that each rank forked after it does not import them again (a
second or more per rank: transformers' Trainer, torchtitan's trainer and its datasets, Megatron-core).

Only what importing does is done here, never a patch a run applies (a rank of another trainer's job is forked
from the same process). A trainer whose preload raises is said in the forkserver's log and left to its
ranks, which import it themselves and fail, if they do, as they would without this."""

from __future__ import annotations

import os
import sys
import traceback

from commgate.core import env
from commgate.run.launcher import PRELOAD_ENV
from commgate.run.workloads import PRELOADS

ONE_THREAD = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
"""Set while the trainers import, where unset: pyarrow (imported by transformers' Trainer and torchtitan's,
through Hugging Face ``datasets``) otherwise starts its jemalloc's background thread at import, and every
rank would be forked from a process with two threads. Without it the forkserver forks with one, as without
the preload; the ranks' Arrow allocator then frees its memory on its own calls instead of on that thread."""


def preload(names: str) -> list[str]:
    """Each trainer of ``names`` preloaded; the ones whose preload raised, said on stdout (the forkserver's
    log)."""
    failed = []
    with env.defaults(ONE_THREAD):
        for name in filter(None, names.split(",")):
            try:
                PRELOADS[name]()
            except Exception:  # its ranks import it themselves: a failure there is theirs to report
                failed.append(name)
                print(f"commgate: preloading trainer {name!r} failed; its ranks import it themselves:", flush=True)
                traceback.print_exc(file=sys.stdout)
    return failed


preload(os.environ.get(PRELOAD_ENV, ""))
