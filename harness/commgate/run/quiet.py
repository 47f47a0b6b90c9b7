"""Imported first by the ranks' forkserver (``commgate.run.launcher.PRELOAD``): what the forkserver prints
while it imports torch and DeepSpeed and loads DeepSpeed's op (the accelerator warning, "built
successfully") goes to the file ``COMMGATE_FORKSERVER_LOG`` names, not to the terminal of the command that
started it. The ranks write theirs to their own logs (``commgate.run.rank.child``)."""

from __future__ import annotations

import os

if log := os.environ.get("COMMGATE_FORKSERVER_LOG"):  # commgate.run.launcher.LOG_ENV
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
