"""A corpus of malformed scenarios: each produces the one-line errors its ``# expect:`` lines name."""

import subprocess
import sys
from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.model.loader import load_file

CORPUS = sorted((Path(__file__).parent / "data" / "malformed").glob("*.yaml"))


def expectations(path: Path) -> list[str]:
    return [line.split("# expect:", 1)[1].strip() for line in path.read_text().splitlines() if "# expect:" in line]


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_malformed_file_reports_each_problem_on_one_line(path: Path) -> None:
    wanted = expectations(path)
    assert wanted, f"{path.name} declares no '# expect:' line"
    with pytest.raises(ScenarioError) as info:
        load_file(path)
    lines = [str(p) for p in info.value.problems]
    for line in lines:
        assert "\n" not in line
        assert line.startswith(str(path)), line
    for want in wanted:
        assert any(want in line for line in lines), f"{want!r} not in:\n" + "\n".join(lines)


def test_all_problems_of_a_file_are_reported_at_once() -> None:
    with pytest.raises(ScenarioError) as info:
        load_file(next(p for p in CORPUS if p.stem == "many_problems"))
    assert len(info.value.problems) == 3


def test_cli_exits_2_with_one_line_per_problem_and_no_traceback() -> None:
    path = next(p for p in CORPUS if p.stem == "heads_not_divisible_by_tp")
    proc = subprocess.run([sys.executable, "-m", "commgate", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(str(path)) for line in lines)
    assert proc.stdout == ""


def test_problems_of_several_files_are_reported_together(tmp_path: Path) -> None:
    for name in ("bad_scheme", "zero_steps"):
        src = next(p for p in CORPUS if p.stem == name)
        (tmp_path / src.name).write_text(src.read_text())
    proc = subprocess.run([sys.executable, "-m", "commgate", "validate", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "bad_scheme.yaml" in proc.stderr and "zero_steps.yaml" in proc.stderr


def test_each_problem_is_reported_once(tmp_path: Path) -> None:
    """A file holding only ``a: 1`` lacks four required fields and has one unknown: five lines, not one per
    (missing field x error jsonschema raised)."""
    path = tmp_path / "a.yaml"
    path.write_text("a: 1\n")
    proc = subprocess.run([sys.executable, "-m", "commgate", "validate", str(path)], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == len(set(lines)) == 5, lines


def test_a_binary_file_is_one_line(tmp_path: Path) -> None:
    from commgate.model.loader import load_paths

    (tmp_path / "binary.yaml").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ScenarioError) as info:
        load_paths([tmp_path])
    assert str(info.value).startswith(f"{tmp_path}/binary.yaml: $: YAML error: unacceptable character #x0000")
    assert len(str(info.value).splitlines()) == 1
