"""Random valid jobs of each trainer commgate runs as itself (``tests/trainer_gen.py``: torchtitan's and Hugging
Face's Trainer crossed with their parallelism and knobs, the configuration files they read generated too) run
as themselves on CPU gloo ranks and must reconcile with the model to 0 unexplained bytes. The seed is printed
and in every test id; replay one with ``COMMGATE_GEN_SEED=S``, draw more with ``COMMGATE_GEN_TRAINER_COUNT=N``
per trainer (``COMMGATE_GEN_SEED=random``: a fresh seed). A trainer that is not installed is skipped, naming
its extra."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from commgate.model.trainers import TRAINERS
from commgate.pipeline import Options, run_scenario
from commgate.run.runners import LocalRanks
from trainer_gen import DRAWERS, job

_env = os.environ.get("COMMGATE_GEN_SEED", "20261124")
SEED = random.SystemRandom().randrange(10**9) if _env == "random" else int(_env)
COUNT = int(os.environ.get("COMMGATE_GEN_TRAINER_COUNT", "3"))
print(f"commgate generated trainer jobs: seed {SEED}, {COUNT} per trainer")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(COUNT), ids=lambda i: f"seed{SEED}-{i}")
@pytest.mark.parametrize("trainer", sorted(DRAWERS))
def test_a_random_trainer_job_reconciles_to_zero_unexplained_bytes(trainer: str, index: int, tmp_path: Path) -> None:
    if why := TRAINERS[trainer].unavailable():
        pytest.skip(why)
    j = job(trainer, SEED, index, tmp_path / "job")
    replay = f"replay: COMMGATE_GEN_SEED={SEED} (python tests/trainer_gen.py {SEED} {index + 1})"
    result = run_scenario(j.scenario, LocalRanks(deadline_s=600), Options(baseline_dir=tmp_path, gate=False))
    assert result is not None
    assert result.status == "passed", f"{j.file} ({replay}):\n{j.file.read_text()}\n{result.summary()}"
    rec = result.reconciliation
    assert rec is not None and not rec.mismatches and rec.keys, replay
    assert all(o.unexplained_bytes == 0 for o in rec.ops), replay
    assert all(c.unexplained_bytes == 0 for c in result.prediction.comparison()), replay


def test_every_trainer_commgate_runs_as_itself_has_a_generator() -> None:
    """A trainer added to TRAINERS without a generator would escape the random jobs."""
    assert set(DRAWERS) == set(TRAINERS) - {"commgate"}  # commgate's own: tests/scenario_gen.py


def test_the_generator_is_seeded_and_refuses_in_one_line(tmp_path: Path) -> None:
    """The same seed gives the same job; the draws a trainer refuses are one line each (no traceback)."""
    for trainer in sorted(DRAWERS):
        if TRAINERS[trainer].unavailable():
            continue
        a, b = job(trainer, SEED, 0, tmp_path / "a" / trainer), job(trainer, SEED, 0, tmp_path / "b" / trainer)
        assert a.file.read_text() == b.file.read_text()
        assert all("\n" not in r and "Traceback" not in r for r in a.refused)
