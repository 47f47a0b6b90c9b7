"""The effective-bandwidth curve: interpolation, the busbw factors, storage per hardware, bad files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from commgate.core.errors import CommgateError
from commgate.judge.store import BaselineStore
from commgate.report import bandwidth
from commgate.report.bandwidth import Curve, Sample, fit


def sample(op: str = "all_reduce", nbytes: int = 4, median_s: float = 1e-3, world: int = 2, g: int = 2) -> Sample:
    return Sample(op=op, world=world, group_size=g, nbytes=nbytes, median_s=median_s, p99_s=median_s * 2)


def curve(*samples: Sample, flops: dict[int, float] | None = None) -> Curve:
    return fit(samples, backend="gloo", hardware="cpu x2", compute_flops=flops or {2: 1e9})


def test_nccl_tests_bus_factors() -> None:
    assert bandwidth.busbw("all_reduce", 8, 1000, 1.0) == pytest.approx(1750)  # 2(n-1)/n
    assert bandwidth.busbw("all_gather", 4, 1000, 1.0) == pytest.approx(750)  # (n-1)/n
    assert bandwidth.busbw("broadcast", 4, 1000, 1.0) == 1000
    assert bandwidth.algbw(1000, 0.5) == 2000


def test_latency_is_interpolated_log_log_floored_below_and_linear_above() -> None:
    c = curve(sample(nbytes=1024, median_s=1e-4), sample(nbytes=1024**2, median_s=1e-2))
    kw = {"group_size": 2, "world": 2}
    assert c.seconds("all_reduce", nbytes=4, **kw) == 1e-4  # the latency floor
    assert c.seconds("all_reduce", nbytes=32 * 1024, **kw) == pytest.approx(1e-3)  # halfway in log-log
    assert c.seconds("all_reduce", nbytes=4 * 1024**2, **kw) == pytest.approx(4e-2)  # the bandwidth bound
    assert c.seconds("reduce", nbytes=1024, **kw) == 1e-4  # a reduce costs at most an all-reduce
    assert c.seconds("all_reduce", nbytes=1024, group_size=1, world=2) == 0  # no peers, no time


def test_the_nearest_measured_group_and_world_stand_in() -> None:
    c = curve(
        sample(median_s=1.0, world=2, g=2), sample(median_s=2.0, world=8, g=2), sample(median_s=3.0, world=8, g=8)
    )
    assert c.seconds("all_reduce", group_size=2, world=3, nbytes=4) == 1.0
    assert c.seconds("all_reduce", group_size=2, world=4, nbytes=4) == 2.0  # a tie goes to the busier world
    assert c.seconds("all_reduce", group_size=4, world=8, nbytes=4) in (2.0, 3.0)
    assert c.seconds("all_reduce", group_size=8, world=8, nbytes=4) == 3.0
    with pytest.raises(CommgateError, match="no all_to_all measurements"):
        c.seconds("all_to_all", group_size=2, world=2, nbytes=4)


def test_fit_keeps_the_least_disturbed_repeat_and_rejects_unknown_ops() -> None:
    c = curve(sample(median_s=2.0), sample(median_s=1.0))
    assert [s.median_s for s in c.samples] == [1.0]
    with pytest.raises(CommgateError, match="unknown op 'allreduce'"):
        curve(sample(op="allreduce"))
    with pytest.raises(CommgateError, match="no samples"):
        fit([], backend="gloo", hardware="x")


def test_curves_are_stored_per_hardware_and_round_trip(tmp_path: Path) -> None:
    path = BaselineStore(tmp_path).curve_path("gloo")
    assert path.name == "bandwidth-gloo.json"
    a = curve(sample(nbytes=64, median_s=0.5), flops={2: 3e9, 8: 1e9})
    bandwidth.store(path, a)
    other = fit([sample()], backend="gloo", hardware="gpu x8")
    bandwidth.store(path, other)
    curves = bandwidth.load_all(path)
    assert set(curves) == {"cpu x2", "gpu x8"}
    assert curves["cpu x2"] == a and curves["cpu x2"].flops(3) == 3e9 and curves["cpu x2"].flops(8) == 1e9
    found, note = bandwidth.lookup(path, "cpu x2")
    assert found == a and "this hardware" in note
    found, note = bandwidth.lookup(path, "tpu")
    assert found is not None and "no bandwidth curve for 'tpu'" in note
    found, note = bandwidth.lookup(tmp_path / "none.json", "cpu x2")
    assert found is None and "benchmarks/test_collectives.py" in note


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "bandwidth-gloo.json"
    path.write_text("{truncated")
    with pytest.raises(CommgateError, match=r"bandwidth-gloo\.json:1: \$: not valid JSON") as info:
        bandwidth.load_all(path)
    # the command that rewrites it, as a missing curve's note gives it (it said "re-run the microbenchmarks")
    assert str(info.value).endswith(
        f"; measure this machine's curve again to rewrite it: `{bandwidth.sweep_command(tmp_path)}`"
    )
    doc = {"schema_version": 1, "curves": {"cpu": curve(sample()).to_json()}}
    doc["curves"]["cpu"]["samples"][0]["median_s"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(CommgateError, match=r"\$\.curves\.cpu\.samples\[0\]\.median_s: -1 is less than or equal to"):
        bandwidth.load_all(path)


def test_the_committed_curve_is_valid_and_monotone_enough() -> None:
    """The curve this repository ships (this machine's sweep) loads, and latency grows with size overall."""
    path = BaselineStore(Path(__file__).parents[1] / "baselines").curve_path("gloo")
    curves = bandwidth.load_all(path)
    assert curves
    for c in curves.values():
        assert {s.op for s in c.samples} == set(bandwidth.OPS)
        assert c.compute_flops and all(math.isfinite(f) for f in c.compute_flops.values())
        small = c.seconds("all_reduce", group_size=2, world=2, nbytes=4)
        big = c.seconds("all_reduce", group_size=2, world=2, nbytes=64 << 20)
        assert big > 10 * small


def test_a_partial_sweep_refits_its_points_and_keeps_the_rest(tmp_path: Path) -> None:
    path = BaselineStore(tmp_path).curve_path("gloo")
    bandwidth.store(
        path, curve(sample(nbytes=4, median_s=1.0), sample(nbytes=64, median_s=2.0), flops={2: 1e9, 8: 3e8})
    )
    bandwidth.calibrate(path, "cpu x2", 0.2, "test")
    bandwidth.store(path, curve(sample(nbytes=64, median_s=5.0), flops={8: 4e8}))
    c = bandwidth.load_all(path)["cpu x2"]
    assert sorted((s.nbytes, s.median_s) for s in c.samples) == [(4, 1.0), (64, 5.0)]
    assert dict(c.compute_flops) == {2: 1e9, 8: 4e8}
    assert c.utilization == 1.0 and c.calibrated is None  # the rates changed: calibrate again


ROOT = Path(__file__).resolve().parents[1]


def test_a_user_without_a_curve_gets_the_shipped_default_said_to_be_one(tmp_path: Path) -> None:
    """No curve in the user's baseline directory: the time model uses commgate's shipped gloo curve (the
    repository's measured one, the same file) and its note says whose it is and how to measure this machine's."""
    shipped = json.loads((bandwidth.DEFAULTS / "bandwidth-gloo.json").read_text())
    assert shipped == json.loads((ROOT / "baselines" / "bandwidth-gloo.json").read_text()), (
        "re-measured baselines/bandwidth-gloo.json: copy it to harness/commgate/core/curves/ too"
    )
    got, note = bandwidth.lookup(BaselineStore(tmp_path).curve_path("gloo"), "a machine nobody measured")
    assert got is not None and got.hardware in shipped["curves"]
    assert "using commgate's default gloo curve" in note and "not this machine" in note
    assert bandwidth.lookup(BaselineStore(tmp_path).curve_path("nccl"), "x")[0] is None  # none shipped for nccl


def test_the_command_that_measures_a_curve_works_from_outside_the_checkout(tmp_path: Path) -> None:
    """The command the note suggests is run as printed (here: collected only) from a user's directory, its
    interpreter this one (a bare ``python`` was pyenv's, without commgate, found by an adversarial pass)."""
    import shlex
    import subprocess

    command = shlex.split(bandwidth.sweep_command(tmp_path / "baselines"))
    assert command[1:3] == ["-m", "pytest"]
    proc = subprocess.run([*command, "--co", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tests collected" in proc.stdout
