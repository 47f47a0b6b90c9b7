"""Helpers for driving the commgate pytest plugin through pytester: scenario files in a fresh
directory (its rootdir, so baselines go to ``<it>/baselines``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import commgate.report.plots

# Imported here, so that pytester's inline runs (which forget modules they import) share one launcher
# and its forkserver instead of starting one per run; and jsonschema with it: commgate's schema validators are
# cached, and one made inside an inline run raised the forgotten module's ValidationError, which a later
# reader's fresh import did not catch (tests/test_baseline.py failed after this directory's tests alone).
import commgate.run.launcher
import jsonschema  # noqa: F401
import pytest
import referencing  # noqa: F401

commgate.report.plots.pyplot()  # matplotlib and numpy too: C extensions cannot be imported twice in a process

SCENARIO = (
    "schema_version: 1\nname: {name}\nmodel: {{preset: 19M-cpu}}\n"
    "parallelism: {{scheme: {scheme}, dp: 2{extra}}}\nsteps: 2\n"
)


@pytest.fixture
def scenario_file(pytester: pytest.Pytester) -> Callable[..., Path]:
    """Write ``<name>.yaml``: a 2-rank scenario (DDP unless told), extra parallelism fields appended."""

    def write(name: str = "g", extra: str = "", scheme: str = "ddp", tail: str = "") -> Path:
        return pytester.makefile(".yaml", **{name: SCENARIO.format(name=name, scheme=scheme, extra=extra) + tail})

    return write


@pytest.fixture
def accepted(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> Path:
    """Scenario ``g`` (``scenario_file``) with its baseline written by a first run; the baseline file."""
    scenario_file("g")
    pytester.runpytest("--commgate-update-baselines").assert_outcomes(passed=1)
    return pytester.path / "baselines" / "gloo" / "g.json"
