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


def cpu_fingerprint() -> str:
    """The CPU model and core count (what gloo latencies depend on)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
