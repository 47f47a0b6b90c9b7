"""Loading scenarios: the default suite, defaults, sweeps, presets with overrides."""

import os
from pathlib import Path
from typing import Any

import pytest
from commgate.core.errors import ScenarioError
from commgate.model.loader import load_paths, load_text
from commgate.model.schemes import SCHEMES

ROOT = Path(__file__).resolve().parents[1]

BASE = """
schema_version: 1
name: s
model: {preset: 19M-cpu}
parallelism: {scheme: ddp, dp: 2}
"""


def test_default_suite_covers_every_scheme() -> None:
    suite = load_paths([ROOT / "scenarios"])
    assert {s.parallelism.scheme for s in suite} == set(SCHEMES)
    assert {s.world_size for s in suite} >= {2, 4, 8}
    assert len({s.id for s in suite}) == len(suite)


def test_defaults() -> None:
    (s,) = load_text(BASE)
    assert (s.backend, s.steps, s.warmup_steps, s.markers, s.workload) == ("auto", 3, 1, (), None)
    assert (s.parallelism.micro_batch, s.parallelism.micro_batches, s.parallelism.zero.stage) == (1, 1, 0)
    assert s.expectations.model_bytes.rtol == 0 and s.expectations.model_bytes.atol == 0


def test_preset_fields_can_be_overridden() -> None:
    (s,) = load_text(BASE.replace("{preset: 19M-cpu}", "{preset: 13B, s: 4096, dtype: bf16}"))
    assert (s.model.L, s.model.h, s.model.s, s.model.dtype) == (40, 5120, 4096, "bf16")


def test_sweep_expands_into_readable_ids() -> None:
    text = BASE + "sweep:\n  model.s: [128, 256]\n  parallelism.dp: [2, 4]\n"
    ids = [s.id for s in load_text(text)]
    assert ids == ["s[s=128,dp=2]", "s[s=128,dp=4]", "s[s=256,dp=2]", "s[s=256,dp=4]"]
    assert [s.model.s for s in load_text(text)] == [128, 128, 256, 256]


def test_every_bad_point_of_a_sweep_is_said_at_once_at_the_sweeps_line() -> None:
    """Only the first bad variant was said (tp=3 of tp 2, 3, 4, 5; tp=5 only once 3 was fixed), at the base
    value's line, which reads another value (found by an adversarial pass). Every bad variant is said, at the
    line of the sweep's key; a problem of a value no variant changes, once, without a variant."""
    text = BASE.replace("{scheme: ddp, dp: 2}", "{scheme: tp, tp: 2}") + "sweep:\n  parallelism.tp: [2, 3, 4, 5]\n"
    with pytest.raises(ScenarioError) as info:
        load_text(text, file="s.yaml")
    said = [(p.line, p.path, p.message) for p in info.value.problems]
    assert [(line, m.split(":")[0], m.endswith(f"(sweep variant tp={m[0]})")) for line, _, m in said] == [
        (7, "3", True), (7, "3", True), (7, "5", True), (7, "5", True)
    ]  # fmt: skip
    shared = BASE.replace("dp: 2", "dp: 1") + "sweep:\n  model.s: [64, 128]\n"
    with pytest.raises(ScenarioError) as info:
        load_text(shared, file="s.yaml")
    assert [str(p) for p in info.value.problems] == ["s.yaml:5: $.parallelism.dp: 1: scheme 'ddp' needs dp >= 2"]


def test_joined_sweep_keys_move_together_for_strong_scaling() -> None:
    text = BASE + "sweep:\n  parallelism.dp+parallelism.micro_batches: [[2, 4], [4, 2]]\n  model.s: [64, 128]\n"
    got = [(s.id, s.world_size, s.parallelism.micro_batches, s.model.s) for s in load_text(text)]
    assert got == [
        ("s[dp=2,micro_batches=4,s=64]", 2, 4, 64),
        ("s[dp=2,micro_batches=4,s=128]", 2, 4, 128),
        ("s[dp=4,micro_batches=2,s=64]", 4, 2, 64),
        ("s[dp=4,micro_batches=2,s=128]", 4, 2, 128),
    ]
    with pytest.raises(ScenarioError, match=r"\$\.sweep\.parallelism\.dp\+parallelism\.micro_batches: \[2, 4, 8\]: "):
        load_text(BASE + "sweep:\n  parallelism.dp+parallelism.micro_batches: [[2, 4, 8]]\n")


def test_zero_scheme_implies_its_stage() -> None:
    (s,) = load_text(BASE.replace("scheme: ddp", "scheme: zero2"))
    assert s.parallelism.zero.stage == 2


def test_nccl_backend_implies_the_gpu_marker() -> None:
    (s,) = load_text(BASE + "backend: nccl\nmarkers: [nightly]\n")
    assert s.markers == ("nightly", "gpu")


def test_expectations_are_read() -> None:
    text = BASE + (
        "expectations:\n  model: {bytes: {rtol: 0.01}}\n  baseline: {latency: {factor: 1.5}}\n"
        "  drift: {cold_start: {action: fail}}\n"
    )
    (s,) = load_text(text)
    e = s.expectations
    assert e.model_bytes.rtol == 0.01 and e.latency.factor == 1.5 and e.cold_start.action == "fail"
    assert (e.latency.min_runs, e.latency.confirm) == (3, 2) and e.cold_start.factor == 10.0


def test_duplicate_ids_across_files_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(BASE)
    (tmp_path / "b.yaml").write_text(BASE)
    with pytest.raises(ScenarioError, match="scenario id 's' is also defined in"):
        load_paths([tmp_path])


def test_a_file_named_twice_or_with_its_folder_is_one_file(tmp_path: Path) -> None:
    """``validate a.yaml a.yaml`` (or ``a.yaml`` and its folder) said the file's scenario "is also defined in"
    the file itself (found by an adversarial pass)."""
    (tmp_path / "a.yaml").write_text(BASE)
    for paths in ([tmp_path / "a.yaml", tmp_path / "a.yaml"], [tmp_path / "a.yaml", tmp_path]):
        assert [s.id for s in load_paths(paths)] == ["s"]


def test_an_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no scenario files"):
        load_paths([tmp_path])


def test_a_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"nope\.yaml: \$: cannot read"):
        load_paths([tmp_path / "nope.yaml"])


def test_a_fifo_or_a_device_is_refused_unread(tmp_path: Path) -> None:
    """A FIFO blocked the read forever and a link to /dev/zero filled the memory (found by an adversarial
    pass): only a regular file is read, and at most one byte past the limit."""
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    for name, kind in (("fifo.yaml", "a FIFO"), ("zero.yaml", "a device or socket")):
        with pytest.raises(ScenarioError) as info:
            load_paths([tmp_path / name])
        assert str(info.value) == f"{tmp_path / name}: $: {kind}, not a file; a scenario is a YAML file"


def test_what_the_model_does_not_cover_yet_is_a_one_line_error() -> None:
    head = "schema_version: 1\nname: x\nmodel: {preset: 19M-cpu, dtype: bf16}\n"
    moe = "parallelism: {scheme: moe, dp: 2, moe: {experts: 2}, zero: {stage: 1}}\n"
    fp32_acc = "deepspeed: {data_types: {grad_accum_dtype: fp32}}\n"
    with pytest.raises(ScenarioError, match=r"grad_accum_dtype: fp32: MoE under DeepSpeed's BF16_Optimizer is not"):
        load_text(head + moe + fp32_acc)
    # the baseline-only mode takes what the model cannot describe
    (s,) = load_text(head + moe + fp32_acc + "expectations: {model: {check: false}}\n")
    assert not s.expectations.model_check
    with pytest.raises(ScenarioError, match=r"zero\.bucket_elements: 2001: DeepSpeed's ZeRO-1/2 need an even bucket"):
        load_text(head + "parallelism: {scheme: zero1, dp: 2, zero: {bucket_elements: 2001}}\n")


def test_a_directory_that_disappears_during_the_walk_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``commgate validate /tmp`` was a traceback (FileNotFoundError) when another job's temporary directory
    went away between listing and reading it (found by an adversarial pass)."""
    from commgate.model.loader import scenario_files

    (tmp_path / "a.yaml").write_text("x: 1\n")
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "b.yaml").write_text("x: 1\n")
    scandir = os.scandir

    def vanishing(path: Any) -> Any:
        if Path(path).name == "gone":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", vanishing)
    assert scenario_files([tmp_path]) == [tmp_path / "a.yaml"]


def test_a_directory_is_searched_as_pytest_searches_it(tmp_path: Path) -> None:
    """``commgate validate .`` read ``.venv/``'s, ``.github/workflows/``'s and ``node_modules/``'s YAML as broken
    scenarios, which ``pytest .`` never looks at (found by an adversarial pass): pytest's default
    ``norecursedirs`` are passed over, unless named on the command line."""
    from commgate.model.loader import scenario_files

    for where in ("a.yaml", "sub/b.yaml", ".venv/lib/pkg.yaml", ".github/workflows/ci.yml", "node_modules/x/c.yaml",
                  "build/d.yaml", "venv/e.yaml", "pkg.egg/f.yaml"):  # fmt: skip
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text("x: 1\n")
    assert scenario_files([tmp_path]) == [tmp_path / "a.yaml", tmp_path / "sub" / "b.yaml"]
    assert scenario_files([tmp_path / ".github"]) == [tmp_path / ".github" / "workflows" / "ci.yml"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("1.0e+400", "$.model.h: 1.0e+400 is not a finite number (YAML reads it as infinity)"),
        ("-.inf", "$.model.h: -.inf is not a finite number (YAML reads it as infinity)"),
        (".NaN", "$.model.h: .NaN is not a finite number (YAML reads it as NaN)"),
    ],
)
def test_a_number_past_a_floats_range_is_one_line_as_written(value: str, says: str) -> None:
    """``h: 1.0e+400`` was three lines, each echoing it as ``Infinity`` ("a number, expected integer", "out of
    range", "not a finite number"; found by an adversarial pass): one line, in the file's own spelling."""
    text = f"schema_version: 1\nname: x\nmodel: {{preset: 19M-cpu, h: {value}}}\nparallelism: {{scheme: ddp, dp: 2}}\n"
    with pytest.raises(ScenarioError) as info:
        load_text(text, file="s.yaml")
    assert [str(p) for p in info.value.problems] == [f"s.yaml:3: {says}"]


@pytest.mark.parametrize(
    ("value", "digits"),
    [
        ("010", "10"),
        ("09", "9"),
        ("00", "0"),
    ],
)
def test_an_integer_with_a_leading_zero_is_one_line_not_octal(value: str, digits: str) -> None:
    """``dp: 010`` was a scenario of 8 ranks, silently, and ``dp: 09`` "a string, expected integer" (found by an
    adversarial pass). Quoted, it is the string it says it is; 0 and 10 are what they say."""
    text = f"schema_version: 1\nname: x\nmodel: {{preset: 19M-cpu}}\nparallelism: {{scheme: ddp, dp: {value}}}\n"
    with pytest.raises(ScenarioError) as info:
        load_text(text, file="s.yaml")
    says = f"YAML reads an integer with a leading zero as octal; write {digits} (or, for a string, quote it: '{value}')"
    assert [str(p) for p in info.value.problems] == [f"s.yaml:4: $.parallelism.dp: {value}: {says}"]
    for fine in ("2", "10", "0x2"):
        (s,) = load_text(text.replace(f"dp: {value}", f"dp: {fine}"), file="s.yaml")
        assert s.parallelism.dp == int(fine, 0)
    with pytest.raises(ScenarioError, match="is a string, expected integer"):
        load_text(text.replace(f"dp: {value}", f"dp: '{value}'"), file="s.yaml")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("yes", "true is a boolean, expected string (YAML reads yes, no, on, off, true and false as booleans: quote"),
        ("2024-01-01", "2024-01-01 is a date, expected string (YAML reads a date as a date: quote it for a string)"),
    ],
)
def test_a_word_yaml_reads_as_another_type_says_so(value: str, says: str) -> None:
    """``name: yes`` was "true is a boolean" and ``name: 2024-01-01`` "datetime.date(2024, 1, 1) is a date", a
    Python repr, neither saying why or how to write it (found by an adversarial pass)."""
    text = f"schema_version: 1\nname: {value}\nmodel: {{preset: 19M-cpu}}\nparallelism: {{scheme: ddp, dp: 2}}\n"
    with pytest.raises(ScenarioError) as info:
        load_text(text, file="s.yaml")
    assert str(info.value.problems[0]).startswith(f"s.yaml:2: $.name: {says}")
    if value == "yes":  # quoted, it is the string it says
        (s,) = load_text(text.replace("name: yes", "name: 'yes'"))
        assert s.id == "yes"
