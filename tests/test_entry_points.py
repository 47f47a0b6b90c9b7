"""The README's two commands are what `.ci/run` runs and what a newcomer types."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_contributing_gives_the_readme_test_command() -> None:
    """CONTRIBUTING.md had drifted to another extra (``.[dev]``) and another duration (a newcomer's walkthrough)."""
    assert readme_commands()[1] in (ROOT / "CONTRIBUTING.md").read_text().splitlines()


def test_pyproject_declares_a_torch_range_not_a_pin() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=[\d.]+,<\d+"', text)


def test_pre_upgrade_dry_run_prints_the_a_b_commands(tmp_path: Path) -> None:
    """Run from a user's repository (not the checkout): the candidate from requirements, or an existing
    prefix (a ROCm/CUDA stack), the suite three times a side, interleaved, then compare."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    script = str(root / "ci" / "pre-upgrade.sh")
    env = {**os.environ, "DRY_RUN": "1", "OUT": "out", "SUITE": "comm"}
    # no current stack: said before the candidate's install, which took minutes before it was (an adversarial
    # pass), and in a dry run too, which printed commands that could not run
    bare = subprocess.run([script, "deepspeed==0.18.9"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr.startswith("CURRENT=.venv: no .venv/bin/commgate")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "commgate").write_text("#!/bin/sh\n")  # the dry run names it, never runs it
    (tmp_path / ".venv" / "bin" / "commgate").chmod(0o755)
    proc = subprocess.run([script, "deepspeed==0.18.9"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f".venv-candidate/bin/pip install -q torch==2.13.0 deepspeed==0.18.9 -e {root} " in lines
    runs = [line for line in lines if " run comm " in line]
    assert runs == [  # interleaved, three a side: latency is judged on runs
        f"{venv}/bin/commgate run comm --report-dir out/{side}/{i} "
        for i in (1, 2, 3)
        for venv, side in ((".venv", "before"), (".venv-candidate", "after"))
    ]
    assert ".venv/bin/commgate compare out/before out/after " in lines
    rocm = subprocess.run(
        [script], capture_output=True, text=True, env=env | {"CANDIDATE": "/opt/conda/envs/rocm"}, cwd=tmp_path
    )
    assert rocm.returncode == 0, rocm.stderr
    assert (
        "pip" not in rocm.stdout
        and "/opt/conda/envs/rocm/bin/commgate run comm --report-dir out/after/1 " in rocm.stdout
    )
    gpu = subprocess.run([script, "torch==2.9.1"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ".venv-candidate/bin/pip install -q torch==2.9.1 -e " in gpu.stdout  # no CPU pin beside a torch
    usage = subprocess.run([script], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: ci/pre-upgrade.sh")
    missing = subprocess.run(
        [script], capture_output=True, text=True, env={**os.environ, "CANDIDATE": str(tmp_path)}, cwd=tmp_path
    )
    assert missing.returncode == 2 and "no " in missing.stderr and "bin/commgate" in missing.stderr


def test_nightly_dry_run_prints_the_srun_torchrun_line() -> None:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"DRY_RUN": "1", "HEAD": "n001"}
    proc = subprocess.run([str(root / "ci" / "nightly.sbatch")], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    srun = proc.stdout.splitlines()[-1]
    for part in (
        "srun --nodes 2 --ntasks-per-node 1",
        "--nnodes 2 --nproc-per-node 8 --max-restarts 0",
        "--rdzv-backend c10d --rdzv-endpoint n001:29500",
        "-m commgate run ci/cluster --gate --baseline-dir baselines --report-dir reports/nightly/",
    ):
        assert part in srun, (part, srun)
    bench = proc.stdout.splitlines()[-2]  # the microbenchmarks first, on one node, refitting the curve
    for part in ("srun --nodes 1 --ntasks 1", "benchmarks/test_collectives.py", "--commgate-bench-backend nccl"):
        assert part in bench, (part, bench)
    assert "--benchmark-compare-fail=median:25%" in bench and "--commgate-curve-dir baselines" in bench


def test_nightly_dry_run_with_job_prints_the_captured_srun_and_the_check() -> None:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
        "DRY_RUN": "1",
        "HEAD": "n001",
        "BENCH": "0",
        "GPUS_PER_NODE": "4",
        "JOB": "python train.py --steps 20",
        "SCENARIO": "comm/job.yaml",
    }
    proc = subprocess.run([str(root / "ci" / "nightly.sbatch")], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    srun, check = proc.stdout.splitlines()[-2:]
    assert srun.startswith("srun --nodes 2 --ntasks-per-node 4 --kill-on-bad-exit=1 bash -c ")
    for part in (
        r"RANK=\$SLURM_PROCID",
        r"MASTER_ADDR=n001\ MASTER_PORT=29500",
        r"exec\ python\ train.py\ --steps\ 20",
    ):
        assert part in srun, (part, srun)
    assert "COMMGATE_CAPTURE=" in srun and "/capture" in srun
    assert "-m commgate check " in check and "/capture --baseline-dir baselines --report-dir reports/nightly/" in check
    assert check.endswith("--scenario comm/job.yaml ")


def test_under_load_runs_the_tests_beside_busy_processes_and_kills_them_after(tmp_path: Path) -> None:
    """ci/under-load.sh: its busy processes run while pytest does (a test of its own sees them) and are
    gone once it ends, failing or not; the exit status is pytest's."""
    import os
    import subprocess
    import sys

    probe = tmp_path / "test_probe.py"
    probe.write_text(  # the script's other children, alive while pytest runs: the busy processes
        "import os\nfrom pathlib import Path\n\ndef test_busy():\n"
        "    def ppid(p):\n"
        "        try:\n"
        "            return int((p / 'stat').read_text().rsplit(')', 1)[1].split()[1])\n"
        "        except (OSError, ValueError):\n"
        "            return None\n"
        "    siblings = [p for p in Path('/proc').iterdir() if p.name.isdigit() and ppid(p) == os.getppid()]\n"
        "    assert len(siblings) == 3  # two busy processes and this pytest\n"
    )
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_fails():\n    assert False\n")
    script = str(ROOT / "ci" / "under-load.sh")
    for target, status in ((probe, 0), (failing, 1)):
        env = {**os.environ, "HOGS": "2", "PYTHON": sys.executable}
        with subprocess.Popen([script, str(target)], env=env, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            head = proc.stdout.readline()
            pids = head.split("(")[1].split(")")[0].split()
            out, _ = proc.communicate(timeout=300)
        assert head.startswith("under load: 2 busy processes") and len(pids) == 2
        assert proc.returncode == status, out
        assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_bad_test_bound_is_one_line() -> None:
    """``COMMGATE_TEST_BOUND_S=abc`` was a traceback while loading the conftest (found by an adversarial pass)."""
    env = {**os.environ, "COMMGATE_TEST_BOUND_S": "abc"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_units.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert (
        done.stderr.strip()
        == "ERROR: COMMGATE_TEST_BOUND_S='abc': expected a positive number of seconds (default 1200)"
    )


def test_check_scenarios_runs_where_it_is_called(tmp_path: Path) -> None:
    """It changed to the checkout first: a relative path was not found there, its default read commgate's own
    scenarios, and the predictions were written into the checkout (found by an adversarial pass). From a
    repository of one's own: its paths, its scenarios/ by default, its out/."""
    import os
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scenarios").mkdir()
    shutil.copy(root / "scenarios" / "ddp.yaml", tmp_path / "scenarios" / "mine.yaml")
    env = {**os.environ, "COMMGATE": str(Path(sys.executable).parent / "commgate")}
    for args in (["scenarios/mine.yaml"], []):
        done = subprocess.run([str(root / "ci" / "check-scenarios.sh"), *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "(scenarios/mine.yaml; ddp" in done.stdout and (tmp_path / "out" / "predictions.json").is_file()
        (tmp_path / "out" / "predictions.json").unlink()
