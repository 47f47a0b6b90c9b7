"""The test session's own bounds (the repository's ``conftest.py``): a test waiting on a process that never
ends fails at ``COMMGATE_TEST_BOUND_S`` with the process killed and named, and the session goes on; the tests
build torch's C++ extensions in a directory of their own, so a build lock they leave cannot hold the user's."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_waiting_on_a_process_that_never_ends_fails_and_the_session_goes_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest((ROOT / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(
        test_wait="""
        import subprocess

        def test_waits_forever():
            done = subprocess.run(["sleep", "600"])
            assert done.returncode == 0

        def test_after():
            assert True
        """
    )
    monkeypatch.setenv("COMMGATE_TEST_BOUND_S", "3")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*assert -9 == 0*"])
    # the line goes to the session's stderr, which the test's capture holds or, where it is not capturing
    # fd 2 at that moment, the process's own
    said = "test_wait.py::test_waits_forever: ran past 3 s; killed the 1 process(es) it had started: ['sleep 600']"
    assert said in result.stdout.str() + result.stderr.str()


def test_a_test_that_leaves_a_stale_build_lock_errors_naming_it_and_the_tests_after_it_do_not_wait(
    pytester: pytest.Pytester,
) -> None:
    """A lock left in the session's extensions directory with no build behind it held every later forkserver
    start for 10 minutes: in CI, 7 tests after it failed so and the run went past its time, none naming the
    test that left it."""
    pytester.makeconftest((ROOT / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(
        test_lock="""
        import os
        from pathlib import Path

        def test_leaves_a_lock():
            (Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "lock").touch()

        def test_after():
            assert not (Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "lock").exists()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=2, errors=1)
    lock = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "lock"
    result.stdout.fnmatch_lines([f"*test_lock.py::test_leaves_a_lock left {lock}: a torch extension build lock*"])
    assert not lock.exists()


def test_every_process_the_tests_start_builds_with_the_environments_own_ninja() -> None:
    """The forkservers build DeepSpeed's op with the environment's ninja; a DeepSpeed job a test captures
    (under torchrun, in the same extensions directory) built it with PATH's: two versions, each rebuilding the
    other's (100 s a time; a test that stops a run then can strand the lock)."""
    import shutil
    import subprocess
    import sys

    own = Path(sys.prefix) / "bin" / "ninja"
    if not own.is_file():
        pytest.skip(f"this environment has no ninja of its own ({own}): PATH's is the only one")
    code = "import shutil; print(shutil.which('ninja'))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(own) == shutil.which("ninja")


def test_the_tests_build_torch_extensions_in_a_directory_of_their_own() -> None:
    own = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if not own.name.startswith("commgate-tests-extensions-"):
        pytest.skip("TORCH_EXTENSIONS_DIR was set before the session: the tests use it as it is")
    assert own.parent == Path(tempfile.gettempdir()) and own.is_dir()
    assert not list(own.glob("*/*/lock")), "a lock copied in from the user's directory"


def test_the_processes_the_tests_start_keep_their_temporary_files_in_the_sessions_directory() -> None:
    """A process a test kills outright leaves its temporary files (the forkserver's log, multiprocessing's
    ``pymp-*``): they land in a directory the session removes, not in the machine's ``/tmp``."""
    import subprocess
    import sys

    own = Path(os.environ["TMPDIR"])
    assert own.name.startswith("commgate-tests-tmp-") and own.is_dir()
    code = "import tempfile; print(tempfile.gettempdir())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert Path(child.stdout.strip()) == own
