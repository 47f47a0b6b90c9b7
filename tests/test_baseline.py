"""Baselines (load, validate, migrate, compare, write) and drift statistics, on committed JSON fixtures
and synthetic captures: no ranks started here."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from commgate.judge import baseline as bl
from commgate.judge.drift import cold_starts, mann_whitney_u, shifts
from commgate.model.scenario import ColdStartRule, LatencyRule, Tolerance
from commgate.run.capture import Capture, CapturedCall

DATA = Path(__file__).parent / "data" / "baselines"
EXACT = Tolerance()


def test_a_baseline_round_trips_canonically() -> None:
    b = bl.load(DATA / "ddp.json")
    assert b.scenario == "ddp-19m-dp4" and b.backend == "gloo" and b.provenance["world_size"] == 4
    assert json.dumps(b.to_json(), sort_keys=True, indent=2) + "\n" == (DATA / "ddp.json").read_text()


def test_compare_names_every_difference_with_obtained_expected_and_delta() -> None:
    stored, now = bl.load(DATA / "ddp.json"), bl.load(DATA / "ddp-split-bucket.json")
    assert bl.compare(stored, stored, bytes_tol=EXACT, calls_tol=EXACT) == []
    diffs = [d.text() for d in bl.compare(now, stored, bytes_tol=EXACT, calls_tol=EXACT)]
    assert diffs == [
        "calls [steps] all_reduce fp32 1061888 B backward group [0, 1, 2, 3]: obtained 0, expected 12 (-12)",
        "calls [steps] all_reduce fp32 530432 B backward group [0, 1, 2, 3]: obtained 12, expected 0 (+12)",
        "calls [steps] all_reduce fp32 531456 B backward group [0, 1, 2, 3]: obtained 12, expected 0 (+12)",
    ]
    assert bl.compare(now, stored, bytes_tol=EXACT, calls_tol=Tolerance(atol=12)) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "truncated.json",
            r"truncated\.json:\d+: \$: not valid JSON \(.*\); delete it or rerun with --commgate-update-baselines$",
        ),
        (
            "newer.json",
            r"newer\.json: \$\.schema_version: 2 is newer than this commgate reads \(1\); upgrade commgate$",
        ),
        ("negative-calls.json", r"negative-calls\.json: \$\.calls\[0\]\.calls: -1 is less than the minimum of 1$"),
    ],
)
def test_a_bad_baseline_is_a_one_line_error_naming_the_file(name: str, message: str) -> None:
    with pytest.raises(bl.BaselineError, match=message) as info:
        bl.load(DATA / name)
    assert "\n" not in str(info.value)


def test_older_versions_are_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads((DATA / "ddp.json").read_text())
    old = {k: v for k, v in doc.items() if k != "histogram"} | {"schema_version": 0}
    with pytest.raises(bl.BaselineError, match=r"\$\.schema_version: 0 has no migration to 1"):
        bl.migrate(dict(old))
    monkeypatch.setitem(bl.MIGRATIONS, 0, lambda d: d | {"schema_version": 1, "histogram": {}})
    assert bl.migrate(dict(old))["histogram"] == {}


def test_a_failed_write_leaves_the_old_baseline_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gloo" / "x.json"
    bl.write(path, bl.load(DATA / "ddp.json"))
    before = path.read_text()

    def boom(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        bl.write(path, bl.load(DATA / "ddp-split-bucket.json"))
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_fractions_are_stored_exactly() -> None:
    assert bl.exact(Fraction(4, 3)) == "4/3" and bl.exact(Fraction(6, 3)) == 2
    b = bl.load(DATA / "ddp.json")
    assert bl.Baseline.from_json(json.loads(json.dumps(b.to_json()))) == b


def test_mann_whitney_u() -> None:
    a, b = list(range(1, 11)), list(range(11, 21))
    assert mann_whitney_u(a, b) == pytest.approx(0.000183, abs=2e-5)  # U = 0, n = 10 + 10
    assert mann_whitney_u(a, a) == pytest.approx(1.0)
    assert mann_whitney_u([5] * 12, [5] * 12) == 1.0  # all tied: no evidence


def test_latency_shifts_need_both_the_factor_and_significance() -> None:
    key = ("recv", "peer 1", 4096, "pipeline")
    base = {key: list(range(1000, 1012))}
    rule = LatencyRule()
    assert [s.verdict for s in shifts({key: [x * 2 for x in base[key]]}, base, rule)] == ["slower"]
    assert [s.verdict for s in shifts({key: [x // 2 for x in base[key]]}, base, rule)] == ["faster"]
    assert [s.verdict for s in shifts({key: [x + 100 for x in base[key]]}, base, rule)] == ["~"]  # significant, small
    assert shifts({key: [x * 2 for x in base[key][:5]]}, base, rule) == []  # too few samples to judge


def _call(rank: int, step: int, seq: int, ns: int) -> CapturedCall:
    return CapturedCall(
        rank=rank,
        seq=seq,
        step=step,
        phase="pipeline",
        op="recv",
        group=(0, 1),
        peer=1 - rank,
        dtype="fp32",
        elements=1024,
        bytes=4096,
        tensors=1,
        start_ns=0,
        duration_ns=ns,
    )


def test_a_cold_start_spike_names_rank_op_peer_size_and_ratio() -> None:
    calls = [_call(0, 0, 0, 900_000_000)] + [_call(0, k, k, 1_000_000) for k in (1, 2, 3)]
    cap = Capture(scenario="s", world_size=2, warmup_steps=1, steps=3, backend="gloo", calls=tuple(calls))
    (spike,) = cold_starts(cap, ColdStartRule(factor=10, min_excess_ms=100))
    assert (
        spike.text() == "cold-start spike: rank 0 recv peer 1 4096 B took 900.0 ms in step 0 vs 1.00 ms steady (900x)"
    )
    assert cold_starts(cap, ColdStartRule(factor=10, min_excess_ms=1000)) == []  # not slow enough in absolute terms
    assert cold_starts(cap, ColdStartRule(factor=1000, min_excess_ms=0)) == []  # nor relatively


def test_another_scenarios_baseline_is_a_one_line_error(tmp_path: Path) -> None:
    """A baseline copied or renamed from another scenario's file is not compared with this one's run."""
    stored = bl.load(DATA / "ddp.json")
    assert bl.load(DATA / "ddp.json", scenario=stored.scenario) == stored
    with pytest.raises(
        bl.BaselineError, match=rf"\$\.scenario: '{stored.scenario}' is another scenario's baseline, not 'zero3'"
    ) as info:
        bl.load(DATA / "ddp.json", scenario="zero3")
    assert "\n" not in str(info.value)


def test_a_speed_up_is_reported_never_a_failure() -> None:
    """With ``latency.action: fail`` a slower collective fails the gate; one that got faster is reported
    as a warning only."""
    from dataclasses import replace

    from commgate.judge.gate import against_baseline
    from commgate.model.scenario import load_text

    stored = bl.load(DATA / "ddp.json")
    hw = stored.provenance["hardware"]
    key = next(iter(stored.latency[hw]))
    base = {key: list(range(1000, 1030))}
    stored = replace(stored, latency={hw: base})
    (s,) = load_text(
        "schema_version: 1\nname: ddp-19m-dp4\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 4}\n"
        "expectations: {baseline: {latency: {action: fail}}}\n"
    )
    for scale, fails in ((3, True), (1 / 3, False)):
        now = replace(stored, latency={hw: {key: [int(x * scale) for x in base[key]]}})
        (finding,) = [f for f in against_baseline(s, now, stored) if f.kind == "latency"]
        assert finding.fail is fails, (scale, finding)
