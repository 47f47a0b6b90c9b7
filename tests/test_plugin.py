"""The pytest plugin, driven end to end through pytester."""

import pytest


def test_commgate_markers_pass_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        @pytest.mark.multinode
        @pytest.mark.slow
        @pytest.mark.nightly
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1)


def test_unknown_markers_still_fail_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import pytest\n@pytest.mark.gpuu\ndef test_x():\n    pass\n")
    result = pytester.runpytest("--strict-markers")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'gpuu' not found in `markers` configuration option*"])


def test_markers_are_listed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu: needs a GPU*", "@pytest.mark.nightly:*"])


def test_plugin_is_registered_through_the_pytest11_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--trace-config")
    result.stdout.fnmatch_lines(["*commgate*commgate/plugin.py*"])
