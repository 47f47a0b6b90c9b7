"""Planted faults, to prove that a gate catches what it should (``--commgate-fault``).

* ``delay-first-recv[=MS]``: the first recv of step 0 on every rank waits MS ms (default 2000) before it
  is posted: a cold-start spike like the paper's first pipeline recv.
* ``late-rank[=MS]``: the last rank starts step 0 MS ms (default 400) after its peers issued their first
  call of it, so that they wait for it there (DDP's single initial bucket has no steady-state twin).
* ``extra-collective``: one extra all-reduce (1 fp32, whole world) after every step.
* ``slow=OP[:FACTOR]``: every call of OP (e.g. ``all_reduce``) takes FACTOR times as long (default 2): once
  issued, before it is posted, it waits FACTOR - 1 times what the rank's earlier calls of the same op,
  group and size took without the wait (a key's first call: what the op's earlier call nearest in size took;
  the op's first call is not slowed).
* ``ddp-bucket-mb=MB``: DDP runs with this ``bucket_cap_mb`` (the prediction keeps the scenario's).
* ``zero-stage=N``: DeepSpeed runs ZeRO stage N (the prediction keeps the scenario's).
* ``env=NAME=VALUE``: the ranks run with NAME=VALUE in their environment, as a user's launcher may set it
  (``ACCELERATE_USE_CPU=true`` makes accelerate drop DeepSpeed from a Hugging Face Trainer job).

A fault changes what runs, never what is expected: the gate must notice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commgate.core.errors import UsageError
from commgate.model.collectives import Op
from commgate.model.scenario import Scenario

SPECS = (
    "delay-first-recv[=MS]",
    "late-rank[=MS]",
    "extra-collective",
    "slow=OP[:FACTOR]",
    "ddp-bucket-mb=MB",
    "zero-stage=N",
    "env=NAME=VALUE",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    delay_first_recv_ms: float = 0.0
    late_rank_ms: float = 0.0
    extra_collective: bool = False
    slow: tuple[tuple[str, float], ...] = ()
    """(op, factor): that op's calls take factor times as long."""
    ddp_bucket_mb: float | None = None
    zero_stage: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    """(name, value): set in each rank's environment before it joins."""

    def __bool__(self) -> bool:
        return self != Faults()

    def describe(self) -> str:
        parts = []
        if self.delay_first_recv_ms:
            parts.append(f"delay-first-recv={self.delay_first_recv_ms:g}")
        if self.late_rank_ms:
            parts.append(f"late-rank={self.late_rank_ms:g}")
        if self.extra_collective:
            parts.append("extra-collective")
        parts += [f"slow={op}:{f:g}" for op, f in self.slow]
        if self.ddp_bucket_mb is not None:
            parts.append(f"ddp-bucket-mb={self.ddp_bucket_mb:g}")
        if self.zero_stage is not None:
            parts.append(f"zero-stage={self.zero_stage}")
        parts += [f"env={k}={v}" for k, v in self.env]
        return ", ".join(parts)

    def apply(self, scenario: Scenario) -> Scenario:
        """The scenario as it is run with these faults (configuration faults only)."""
        par = scenario.parallelism
        if self.ddp_bucket_mb is not None:
            par = replace(par, ddp_bucket_mb=self.ddp_bucket_mb)
        if self.zero_stage is not None and par.zero.stage:
            par = replace(par, zero=replace(par.zero, stage=self.zero_stage))
        return replace(scenario, parallelism=par)


def parse(specs: list[str]) -> Faults:
    """``--commgate-fault`` values; ``UsageError`` (one line) for anything else."""
    faults = Faults()
    for spec in specs:
        name, _, value = spec.partition("=")
        try:
            if name == "delay-first-recv":
                faults = replace(faults, delay_first_recv_ms=_positive(value, MAX_MS) if value else 2000.0)
            elif name == "late-rank":
                faults = replace(faults, late_rank_ms=_positive(value, MAX_MS) if value else 400.0)
            elif name == "extra-collective" and not value:
                faults = replace(faults, extra_collective=True)
            elif name == "slow" and value:
                op, _, factor = value.partition(":")
                if op not in {o.value for o in Op} or (factor and not 1 <= float(factor) <= 100):
                    raise ValueError
                faults = replace(faults, slow=(*faults.slow, (op, float(factor) if factor else 2.0)))
            elif name == "ddp-bucket-mb" and value:
                faults = replace(faults, ddp_bucket_mb=_positive(value, MAX_MB))
            elif name == "zero-stage" and value in ("1", "2", "3"):
                faults = replace(faults, zero_stage=int(value))
            elif name == "env" and (var := value.partition("=")[0]).isidentifier() and "=" in value:
                faults = replace(faults, env=(*faults.env, (var, value.partition("=")[2])))
            else:
                raise ValueError
        except ValueError:
            raise UsageError(
                f"--commgate-fault {spec!r}: expected one of {', '.join(SPECS)} (MS a positive number up to "
                f"{MAX_MS:,.0f}, MB up to {MAX_MB:,.0f}, FACTOR from 1 to 100)"
            ) from None
    return faults


MAX_MS = 3_600_000.0
"""The longest planted delay, an hour (1e300 ms was accepted, and overflowed ``time.sleep`` in a rank)."""
MAX_MB = 1_048_576.0
"""The largest planted bucket, a TiB."""


def _positive(value: str, at_most: float) -> float:
    """A fault's size: a positive, finite number up to ``at_most`` (a delay of 0 or -500 ms, or nan, plants
    nothing)."""
    number = float(value)
    if not math.isfinite(number) or not 0 < number <= at_most:
        raise ValueError(value)
    return number
