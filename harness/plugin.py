"""commgate's pytest plugin (registered through the ``pytest11`` entry point).

Kept thin: it registers commgate's markers so ``--strict-markers`` accepts them everywhere.
Collection of scenario files as tests, the ``--commgate-*`` options and the baseline fixtures
come with the regression gate. Nothing heavy (torch, deepspeed) is imported here.
"""

from __future__ import annotations

import pytest

MARKERS: dict[str, str] = {
    "gpu": "needs a GPU (NCCL/RCCL); skipped where none is present",
    "multinode": "starts several nodes (torchrun agents); slow",
    "slow": "takes more than a few seconds",
    "nightly": "part of the nightly cluster run, not of pull-request gating",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
