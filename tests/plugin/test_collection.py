"""Scenario files are collected as tests: ids, sweeps, markers, -k, bad files, hardware skips."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


def test_scenarios_and_sweeps_are_items_with_readable_ids(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("a")
    scenario_file("b", tail="sweep:\n  model.s: [128, 256]\n")
    pytester.makefile(".yaml", other="key: value\n")  # not a scenario: not collected
    result = pytester.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["a.yaml::a", "b.yaml::b[[]s=128[]]", "b.yaml::b[[]s=256[]]", "3 tests collected*"])


def test_last_failed_reruns_exactly_the_failed_sweep_variant(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """pytest 9 keeps ``--lf``'s ids as parsed node ids: ``b.yaml::b[s=128]`` is the name ``b`` with the
    parameters ``s=128``, which an item named ``b[s=128]`` never equalled, so ``--lf`` reran every test, or,
    beside another failure, skipped the failed variant (found by an adversarial pass)."""
    scenario_file("a")
    scenario_file("b", tail="sweep:\n  model.s: [128, 256]\n")
    cache = pytester.path / ".pytest_cache" / "v" / "cache"
    cache.mkdir(parents=True)
    for failed in (["b.yaml::b[s=128]"], ["a.yaml::a", "b.yaml::b[s=128]"]):
        (cache / "lastfailed").write_text(json.dumps(dict.fromkeys(failed, True)))
        result = pytester.runpytest("--lf", "--collect-only", "-q", "-p", "cacheprovider")
        assert sorted(line for line in result.outlines if "::" in line) == failed, result.outlines
    named = pytester.runpytest("b.yaml::b[s=256]", "--collect-only", "-q")
    named.stdout.fnmatch_lines(["b.yaml::b[[]s=256[]]", "1 test collected*"])


def test_keyword_and_marker_selection(pytester: pytest.Pytester, scenario_file: Callable[..., Path]) -> None:
    scenario_file("fast")
    scenario_file("night", tail="markers: [nightly]\n")
    pytester.runpytest("--collect-only", "-q", "-k", "night").stdout.fnmatch_lines(["night.yaml::night", "1/2 *"])
    result = pytester.runpytest("--collect-only", "-q", "-m", "not nightly", "--strict-markers")
    result.stdout.fnmatch_lines(["fast.yaml::fast", "1/2 *"])


def test_a_malformed_scenario_is_a_one_line_collection_error(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    scenario_file("bad", extra=", tp: 3")  # 8 heads are not divisible by 3
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*bad.yaml*: $.parallelism*"])
    assert "Traceback" not in result.stdout.str()


def test_hardware_this_machine_lacks_is_a_skip_with_the_reason(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("commgate.run.launcher.gpu_visible", lambda: False)
    scenario_file("gpu", tail="markers: [gpu]\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs GPUs (marker gpu or backend nccl); this machine has none*"])


BROKEN = {
    "empty.yaml": b"",
    "binary.yaml": bytes(range(256)) * 4,
    "utf16.yaml": "schema_version: 1\nname: u\n".encode("utf-16"),
    "a_list.yaml": b"- schema_version: 1\n- parallelism: {scheme: ddp}\n",
    "typo.yaml": b"schema_version: 1\nname: t\nmodel: {preset: 19M-cpu}\nparallelsim: {scheme: ddp, dp: 2}\n",
}


def test_a_broken_file_among_scenarios_is_never_a_silent_pass(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """Every YAML file under the scenario directories (``commgate_scenario_dirs``, default ``scenarios``) is a
    scenario: one good file and five broken ones (empty, binary, UTF-16, a top-level list, a mistyped
    key) give one good test, five collection errors, one line each, and a failed run."""
    (pytester.path / "scenarios").mkdir()
    good = scenario_file("good")
    good.rename(pytester.path / "scenarios" / "good.yaml")
    for name, data in BROKEN.items():
        (pytester.path / "scenarios" / name).write_bytes(data)
    pytester.makefile(".yaml", unrelated="key: value\n")  # elsewhere, declaring no schema_version: not collected
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    out = result.stdout.str()
    assert "Traceback" not in out and "unrelated.yaml" not in out
    result.stdout.fnmatch_lines(["*5 errors*"])
    for name in BROKEN:
        assert f"ERROR scenarios/{name}" in out, (name, out)
    result.stdout.fnmatch_lines(["*typo.yaml*parallelsim*"])


def test_scenario_directories_and_declared_files_are_configurable(pytester: pytest.Pytester) -> None:
    """``commgate_scenario_dirs = comm`` makes comm/'s files scenarios; outside it, a file declaring
    schema_version is one (and a broken one fails); a file named on the command line is loaded where it may be
    one, and listed with the rule that decided where it is none."""
    pytester.makeini("[pytest]\ncommgate_scenario_dirs = comm\n")
    (pytester.path / "comm").mkdir()
    (pytester.path / "comm" / "empty.yml").write_bytes(b"")
    (pytester.path / "declared.yaml").write_text("schema_version: 1\nname: d\n")  # no parallelism: invalid
    (pytester.path / "other.yaml").write_text("not: a scenario\n")
    result = pytester.runpytest("--collect-only", "-q")
    out = result.stdout.str()
    assert "ERROR comm/empty.yml" in out and "ERROR declared.yaml" in out and "other.yaml" not in out
    result = pytester.runpytest("--collect-only", "-q", "other.yaml")  # pytest's "not found": never a pass
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "ERROR other.yaml" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*other.yaml: a mapping with none of a scenario's required keys*"])
    (pytester.path / "forgot.yaml").write_text("name: f\nparallelism: {scheme: ddp, dp: 2}\n")
    result = pytester.runpytest("--collect-only", "-q", "forgot.yaml")
    assert result.ret == pytest.ExitCode.INTERRUPTED and "ERROR forgot.yaml" in result.stdout.str()


def test_another_projects_yaml_is_left_to_it(pytester: pytest.Pytester) -> None:
    """Found by an adversarial pass: with commgate installed, pytest's own YAML-test example
    (docs.pytest.org, "Working with non-python tests") and a BDD suite's ``scenarios/`` were collection
    errors in projects that never configured commgate. A file with none of a scenario's keys is theirs."""
    pytester.makeconftest(
        """
        import pytest, yaml

        def pytest_collect_file(parent, file_path):
            if file_path.suffix == ".yaml" and file_path.name.startswith("test"):
                return YamlFile.from_parent(parent, path=file_path)

        class YamlFile(pytest.File):
            def collect(self):
                for name, spec in sorted(yaml.safe_load(self.path.read_text()).items()):
                    yield YamlItem.from_parent(self, name=name, spec=spec)

        class YamlItem(pytest.Item):
            def __init__(self, *, spec, **kwargs):
                super().__init__(**kwargs)
                self.spec = spec

            def runtest(self):
                assert self.spec["ok"]
        """
    )
    pytester.makefile(".yaml", test_simple="hello: {ok: true}\nworld: {ok: true}\n")
    (pytester.path / "scenarios").mkdir()
    (pytester.path / "scenarios" / "login.yaml").write_text("feature: login\nsteps: [open, type, submit]\n")
    for args in (("test_simple.yaml",), ()):
        result = pytester.runpytest("-q", *args)
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()
        result.stdout.fnmatch_lines(["*2 passed*"])
        assert "commgate" not in result.stdout.str() and "login.yaml" not in result.stdout.str()


def test_two_files_naming_one_scenario_alike_are_a_collection_error_naming_both(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    first = scenario_file("g")
    twin = pytester.mkdir("more") / "twin.yaml"
    twin.write_text(first.read_text())  # its name is g too: one baseline, one report entry for two scenarios
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([f"{twin}: $.name: scenario id 'g' is also defined in {first}"])
    assert "Traceback" not in result.stdout.str()


def test_yaml_files_in_a_named_directory_that_are_not_scenarios_are_reported_with_the_rule(
    pytester: pytest.Pytester,
) -> None:
    """In a directory named on the command line (not a scenario directory): an empty file, a binary one, a
    list and a mapping with none of a scenario's keys are each named with the rule that decided; a mapping
    that looks like a scenario but forgot schema_version is loaded, and its error is a collection error."""
    comm = pytester.mkdir("comm")
    (comm / "empty.yaml").write_text("")
    (comm / "binary.yaml").write_bytes(b"\x00\x01\x02")
    (comm / "list.yaml").write_text("- a\n- b\n")
    (comm / "ci.yaml").write_text("jobs: {build: {}}\n")
    result = pytester.runpytest("--collect-only", "-q", "comm")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines_random([
        "*commgate: YAML files not collected as scenarios (the rule that decided)*",
        f"{comm}/empty.yaml: empty (no YAML document)",
        f"{comm}/binary.yaml: binary (a NUL character), not YAML text",
        f"{comm}/list.yaml: its top level is a list, not a mapping",
        f"{comm}/ci.yaml: a mapping with none of a scenario's required keys (model, name, parallelism, schema_version)",
    ])  # fmt: skip
    (comm / "forgot.yaml").write_text("name: f\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n")
    result = pytester.runpytest("--collect-only", "-q", "comm")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([f"{comm}/forgot.yaml:1: $: missing required field 'schema_version'"])


def test_a_configured_scenario_directory_that_does_not_exist_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """A misspelled ``commgate_scenario_dirs`` collected nothing and the session passed, having judged no
    scenario (found by an adversarial pass); the default directory may still be absent."""
    pytester.makepyfile(test_x="def test_x(): pass\n")
    assert pytester.runpytest("-p", "no:cacheprovider").ret == pytest.ExitCode.OK  # the default, absent: fine
    pytester.makeini("[pytest]\ncommgate_scenario_dirs = comm\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *.ini: commgate_scenario_dirs names 'comm', not a directory under *"])


def test_a_scenario_directory_outside_the_rootdir_is_a_usage_error_unless_named(pytester: pytest.Pytester) -> None:
    """``commgate_scenario_dirs = ../sc`` passed the existence check and pytest collected nothing there: "no tests
    ran" with no word why (found by an adversarial pass). Named on the command line, it is collected."""
    shared = pytester.path / "sc"
    shared.mkdir()
    (shared / "s.yaml").write_text(
        "schema_version: 1\nname: s\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\n"
    )
    project = pytester.mkdir("proj")
    (project / "pytest.ini").write_text("[pytest]\ncommgate_scenario_dirs = ../sc\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        result = pytester.runpytest_subprocess("--collect-only", "-q")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(
            ["ERROR: *pytest.ini: commgate_scenario_dirs names '../sc', outside the rootdir *; name it on the "
             "command line (pytest ../sc) or move it under the rootdir"]
        )  # fmt: skip
        named = pytester.runpytest_subprocess("--collect-only", "-q", "../sc")
        assert named.ret == pytest.ExitCode.OK
        named.stdout.fnmatch_lines(["*s.yaml::s"])


def test_a_scenario_link_to_a_missing_file_is_an_error_not_a_silent_gap(
    pytester: pytest.Pytester, scenario_file: Callable[..., Path]
) -> None:
    """A ``*.yaml`` link whose target is gone (a scenario linked from a checkout that is missing) was passed
    over by pytest's walk and by ``commgate validate``: the gate stayed green without it (found by an
    adversarial pass)."""
    import subprocess
    import sys

    scenario_file("a")
    comm = pytester.mkdir("comm")
    (comm / "b.yaml").symlink_to(pytester.path / "gone" / "b.yaml")
    pytester.makeini("[pytest]\ncommgate_scenario_dirs = comm\n")
    for args in (["--collect-only", "-q"], ["--collect-only", "-q", "comm"]):
        result = pytester.runpytest(*args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(
            [f"*1 scenario link(s) to a missing file: {comm}/b.yaml -> {pytester.path}/gone/b.yaml;*"]
        )
        assert "Traceback" not in result.stdout.str() + result.stderr.str()
    proc = subprocess.run([sys.executable, "-m", "commgate", "validate", str(comm)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{comm}/b.yaml: $: a link to {pytester.path}/gone/b.yaml, which does not exist" in proc.stdout + proc.stderr
