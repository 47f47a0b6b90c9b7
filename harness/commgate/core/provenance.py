"""Where a run was taken: package versions (from metadata: nothing heavy is imported), the CPU, and the
git commit. Shared by reports, baselines and the ranks' capture."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from commgate import __version__


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions of the stack."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "commgate": __version__,
    }


@functools.cache
def cpuinfo(field: str) -> str | None:
    """The first ``field`` of Linux's ``/proc/cpuinfo`` (``model name``, ``flags``); None elsewhere or where it
    cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        return None
    return None


def cpu_fingerprint() -> str:
    """The CPU model and core count (what gloo latencies depend on)."""
    model = cpuinfo("model name") or platform.processor() or platform.machine()
    return f"{model} x{os.cpu_count()}"


@functools.cache
def commit() -> str | None:
    """git HEAD of the working directory (looked up once per process)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
