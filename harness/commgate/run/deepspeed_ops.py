"""Imported by the ranks' forkserver on CPU machines (``commgate.run.launcher.PRELOAD_CPU``): loads
DeepSpeed's CPU shared-memory comm op once, so that every rank inherits it (DeepSpeed keeps loaded ops in
``OpBuilder._loaded_ops``) instead of re-running torch's JIT build under its file lock. A rank killed while
it holds that lock (a failed or timed-out scenario) would leave the lock behind, and every later DeepSpeed
run would wait for it until its deadline."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.comm.torch import build_shm_op

from commgate.run.extensions import ninja_first

ninja_first()  # one ninja for every build of this environment's ops, here and in the ranks forked from here
SHM_COMM_OP = build_shm_op()
