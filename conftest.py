"""Repository-wide pytest configuration.

``pytester`` drives the commgate plugin end to end in the plugin's own tests.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """The tests kill runs on purpose, and a process killed while torch builds or loads a C++ extension
    (DeepSpeed's CPU comm op and commgate's completion stamps, which every forkserver loads) leaves that
    build's lock behind; every later build then waits for it. So both are built up front, in a process no
    test can kill, where commgate builds them for this environment (``commgate.run.extensions``), and the
    tests load copies from a directory of their own, removed at the end. A ``TORCH_EXTENSIONS_DIR`` already
    set is left as it is."""
    global TEST_BOUND_S
    TEST_BOUND_S = _bound_s()  # a usage error here is one line; at import, a traceback
    _own_tmpdir(config)
    from commgate.run.extensions import ninja_first

    # One ninja for every build in the session: the forkservers build with the environment's own, and the jobs
    # the tests capture (DeepSpeed scripts under torchrun, sharing the session's extensions) with PATH's: the
    # system's 1.11 and the environment's 1.13 each rebuilt the other's op (88 s each, a lock a kill can strand).
    ninja_first()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    from commgate.run.extensions import environment_dir
    from commgate.run.launcher import gpu_visible

    own = Path(tempfile.mkdtemp(prefix="commgate-tests-extensions-"))
    config.add_cleanup(lambda: shutil.rmtree(own, ignore_errors=True))
    built, cpu = environment_dir(), not gpu_visible()  # only on CPU machines does the forkserver load the op
    if locks := sorted(built.glob("*/lock")):  # a killed build's: not copied, not waited on
        why = "a build lock (a killed build's, or one running now); the tests build their own extensions"
        print(f"commgate tests: {', '.join(map(str, locks))}: {why}", flush=True)
        where = own
    else:
        where = built
    from commgate.run import stamps

    ninja = where / "deepspeed_shm_comm" / "build.ninja"  # a build's flags name its environment's paths
    if cpu and not (ninja.is_file() and sys.prefix in ninja.read_text()):
        _build(where, "DeepSpeed's CPU comm op", "import commgate.run.deepspeed_ops", "DeepSpeed's tests will say why")
    if not (where / stamps.NAME / f"{stamps.NAME}.so").is_file():
        code = "import sys; from commgate.run import stamps; sys.exit(stamps.build() is None)"
        _build(where, "commgate's completion stamps", code, "tests/test_capture_timing.py will say why")
    if where == built and built.is_dir():
        shutil.copytree(built, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"), symlinks=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(own)


def _own_tmpdir(config: pytest.Config) -> None:
    """The processes the tests start write their temporary files in a directory of the session's, removed at its
    end: a process a test kills on purpose (SIGKILL) leaves its forkserver's log and multiprocessing's
    ``pymp-*`` directory behind, as does a run whose forkserver a test makes fail (its log is kept for the
    user), and four runs of the suite had left 13 of them in ``/tmp``. This process keeps the directory it had
    (``tempfile`` reads ``TMPDIR`` once), so its own runs' temporary files are where they always were."""
    base = Path(tempfile.gettempdir())  # read, and kept, before TMPDIR changes
    own = Path(tempfile.mkdtemp(prefix="commgate-tests-tmp-", dir=base))
    config.add_cleanup(lambda: shutil.rmtree(own, ignore_errors=True))
    os.environ["TMPDIR"] = str(own)


def _build(where: Path, what: str, code: str, otherwise: str) -> None:
    """Build ``what`` in ``where`` by running ``code`` in a process of its own; a failure is printed, and
    ``otherwise`` says where it will show."""
    print(f"commgate tests: building {what} once, in {where} (a minute or two)", flush=True)
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(where)}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        print(f"commgate tests: the build of {what} ran past 900 s; {otherwise}", flush=True)
        return
    if done.returncode != 0:
        print(f"commgate tests: the build of {what} failed; {otherwise}:\n{done.stderr[-2000:]}", flush=True)


# The malformed-scenario corpus is read by tests/test_malformed.py, not collected by the gate.
collect_ignore = ["tests/data"]


def _bound_s() -> float:
    value = os.environ.get("COMMGATE_TEST_BOUND_S", "")
    try:
        bound = float(value or 1200)
    except ValueError:
        bound = -1.0
    if not 0 < bound < float("inf"):
        raise pytest.UsageError(
            f"COMMGATE_TEST_BOUND_S={value!r}: expected a positive number of seconds (default 1200)"
        )
    return bound


TEST_BOUND_S = 1200.0
"""No test runs longer (the longest, torchtitan's own 8B and 70B configurations, takes minutes): past it, every
process the test session started is killed, so that a test waiting on one fails instead of holding CI until its
own timeout, and the session goes on. ``COMMGATE_TEST_BOUND_S`` sets another bound."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timer = threading.Timer(TEST_BOUND_S, _kill_descendants, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A test that leaves a build lock in the session's extensions directory with no build behind it (a
    process killed while torch held it) errors here, naming it, and the lock goes: every later forkserver start
    would wait 10 minutes on it, and one such lock failed 7 tests after it in CI and ran CI past its time."""
    result = yield
    own = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or "/nonexistent")
    if own.name.startswith("commgate-tests-extensions-"):
        from commgate.run.extensions import stale

        if left := [lock for lock in sorted(own.glob("*/lock")) if stale(lock)]:
            for lock in left:
                lock.unlink(missing_ok=True)
            raise AssertionError(
                f"{item.nodeid} left {', '.join(map(str, left))}: a torch extension build lock that no process "
                "holds or builds behind (a build or its check killed halfway); removed, so that later tests do "
                "not wait on it"
            )
    return result


def _kill_descendants(nodeid: str) -> None:
    import psutil
    from commgate.run.extensions import build_locks

    children = psutil.Process().children(recursive=True)
    names = []
    for child in children:
        try:
            names.append(" ".join(child.cmdline())[:120])
            child.kill()
        except psutil.Error:
            continue
    print(
        f"\n{nodeid}: ran past {TEST_BOUND_S:g} s; killed the {len(names)} process(es) it had started: {names}; "
        f"torch extension build locks: {[str(lock) for lock in build_locks()]}",
        file=sys.__stderr__,
        flush=True,
    )
