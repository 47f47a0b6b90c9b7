"""The README's two commands are what `.ci/run` runs and what a newcomer types."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- two-commands -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README.md lost its two-commands block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_has_exactly_two_commands() -> None:
    first, second = readme_commands()
    assert "commgate" in first and "pytest" in second
    assert "torch==2.13.0" in first and "torch==2.13.0" in second


def test_ci_run_calls_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_pyproject_declares_a_torch_range_not_a_pin() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=[\d.]+,<\d+"', text)
