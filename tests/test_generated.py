"""Random valid scenarios from a seeded generator (``tests/scenario_gen.py``) run on the real frameworks
and must reconcile with the model to 0 unexplained bytes: the gate has to be right on setups nobody wrote
down. The seed is printed and is in every test id; replay one with ``COMMGATE_GEN_SEED=S``, draw more with
``COMMGATE_GEN_COUNT=N`` (``COMMGATE_GEN_SEED=random`` draws a fresh seed)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from commgate.pipeline import Options, run_scenario
from commgate.run.runners import LocalRanks
from scenario_gen import scenarios

_env = os.environ.get("COMMGATE_GEN_SEED", "20261123")
SEED = random.SystemRandom().randrange(10**9) if _env == "random" else int(_env)
COUNT = int(os.environ.get("COMMGATE_GEN_COUNT", "12"))
DRAWN = scenarios(SEED, COUNT)
print(f"commgate generated scenarios: seed {SEED}, {COUNT} scenarios")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", DRAWN, ids=[f"seed{SEED}-{s.name}" for s in DRAWN])
def test_a_random_valid_scenario_reconciles_to_zero_unexplained_bytes(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = run_scenario(scenario, LocalRanks(deadline_s=120), Options(baseline_dir=tmp_path, gate=False))
    assert result is not None
    replay = f"replay: COMMGATE_GEN_SEED={SEED} (python tests/scenario_gen.py {SEED} {COUNT})"
    assert result.status == "passed", f"{scenario.id} ({replay}):\n{result.summary()}"
    rec = result.reconciliation
    assert rec is not None and all(o.unexplained_bytes == 0 for o in rec.ops), replay
    assert all(c.unexplained_bytes == 0 for c in result.prediction.comparison()), replay
