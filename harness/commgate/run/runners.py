"""Where a scenario's ranks run: one ``Runner`` per way of starting them, behind one protocol, so that
``commgate.pipeline.run_scenario`` owns a scenario's life whatever started it.

* ``LocalRanks``: ``world_size`` fresh local processes (``commgate run``, the pytest gate).
* ``TorchrunRank``: this process is one rank of a torchrun/srun job; rank 0 gets the gathered capture,
  the other ranks get None (they run the scenario but do not report).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from commgate.core import env
from commgate.core.errors import UsageError
from commgate.model.scenario import Scenario
from commgate.run.capture import Capture, timeline
from commgate.run.inject import Faults
from commgate.run.links import Network
from commgate.run.workloads import skip_reason


class Runner(Protocol):
    def skip_reason(self, scenario: Scenario) -> str | None:
        """Why ``scenario`` cannot run here, or None."""

    def run(self, scenario: Scenario) -> Capture | None:
        """Run it and return the whole job's capture (None: this process does not report); raise
        ``commgate.run.launcher.RunError`` when the run fails."""


@dataclass(frozen=True, kw_only=True)
class LocalRanks:
    deadline_s: float | None = None
    """Per-scenario deadline (default: the scenario's ``deadline_s``)."""
    faults: Faults = field(default_factory=Faults)
    network: Network | None = None
    """Run the ranks on the two sides of this shaped link (``commgate.run.links.shaped``)."""
    progress: Callable[[str], None] | None = None
    """Told what the run is doing (forkserver start, phase, step k of n), several times a second."""
    trainers: frozenset[str] = frozenset()
    """The trainers of the scenarios it will run, whose imports the ranks' forkserver does once
    (``commgate.run.preload``; ``Session.expect``)."""

    def skip_reason(self, scenario: Scenario) -> str | None:
        from commgate.run.launcher import gpu_visible

        if self.network is not None and (scenario.emulate or scenario.world_size < 2):
            return "a shaped link joins two halves of the ranks: not with one rank or an emulated run"
        return skip_reason(scenario, gpus=gpu_visible())

    def run(self, scenario: Scenario) -> Capture:
        from commgate.run.launcher import launch_local

        return launch_local(
            scenario,
            deadline_s=self.deadline_s,
            faults=self.faults,
            network=self.network,
            progress=self.progress,
            trainers=self.trainers,
        )


@dataclass(kw_only=True)
class TorchrunRank:
    """This process is rank ``RANK`` of ``WORLD_SIZE`` (``env://``); each scenario gets a fresh key
    namespace on the job's store. A rank that raises ends the job (torchrun stops the others)."""

    rank: int = field(default_factory=lambda: env_int("RANK"))
    world: int = field(default_factory=lambda: env_int("WORLD_SIZE"))
    runs: int = 0

    def __post_init__(self) -> None:
        env_int("LOCAL_RANK")
        env_int("MASTER_PORT")

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def skip_reason(self, scenario: Scenario) -> str | None:
        import torch

        if scenario.world_size != self.world:
            return f"needs {scenario.world_size} ranks; torchrun started {self.world}"
        return skip_reason(scenario, gpus=torch.cuda.is_available())

    def run(self, scenario: Scenario) -> Capture | None:
        from commgate.run.rank import resolve_backend, run_rank, stack, torchrun_store

        self.runs += 1
        try:
            marks = {"entry": time.monotonic()}
            gathered = run_rank(
                scenario, rank=self.rank, world_size=self.world, store=torchrun_store(self.runs), marks=marks
            )
        except Exception:
            print(f"{scenario.id}: rank {self.rank} raised\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)
        if gathered is None:
            return None
        backend = resolve_backend(scenario)
        return Capture(
            scenario=scenario.id,
            world_size=self.world,
            warmup_steps=scenario.warmup_steps,
            steps=scenario.steps,
            backend=backend,
            calls=tuple(sorted(gathered.calls, key=lambda c: (c.rank, c.seq))),
            timeline=timeline(marks),
            stack=stack(backend, int(os.environ.get("LOCAL_WORLD_SIZE", self.world))),
            step_windows=tuple(sorted(gathered.windows, key=lambda w: (w.rank, w.step))),
            clocks=tuple(sorted(gathered.clocks, key=lambda c: c.rank)),
        )


def env_int(name: str) -> int:
    """The whole number torchrun (or srun) put in the environment variable ``name``; a one-line
    ``UsageError`` naming it and its value otherwise."""
    value = os.environ.get(name, "")
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise UsageError(f"environment variable {name} {value!r}: expected a whole number (torchrun sets it for each "
                         "rank); unset it or set it right")  # fmt: skip
    return number


def under_torchrun() -> bool:
    """Started by torchrun (or srun + torchrun): every process is one rank of the job."""
    return all(k in os.environ for k in env.TORCHRUN_VARIABLES)
