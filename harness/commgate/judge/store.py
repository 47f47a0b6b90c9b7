"""The baseline directory (``--commgate-baseline-dir``, ``--baseline-dir``; ``baselines/`` by default): the
one module that knows its layout.

    {root}/{backend}/{scenario id}.json            a scenario's baseline (``commgate.judge.baseline``)
    {root}/{backend}/{scenario id}.obtained.json   what the last run that differed from it sent, in the same
                                                   schema: copy it over the baseline to accept it
    {root}/bandwidth-{backend}.json                the backend's bandwidth curves (``commgate.report.bandwidth``)

As pytest-benchmark's ``storage/file.py``: ``save``, ``load`` and ``query``; as pytest-regressions'
``*.obtained`` files: a mismatch leaves what was obtained beside what was expected, for a person to diff
or accept, and a run that matches removes it. Every file is written atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from commgate.core.errors import Problem, WriteError
from commgate.core.fsutil import is_loop
from commgate.judge import baseline as bl

OBTAINED = ".obtained.json"


@dataclass(frozen=True, slots=True)
class BaselineStore:
    """The baselines and bandwidth curves under ``root``."""

    root: Path

    def folder(self, backend: str) -> Path:
        """``{root}/{backend}``; a one-line ``WriteError`` where a file (or a link to nothing) stands there."""
        where = self.root / backend
        if (where.exists() or where.is_symlink()) and not where.is_dir():
            raise WriteError(
                f"{where}: not a directory, where commgate keeps the {backend} baselines; remove it, or give "
                "another baseline directory"
            )
        return where

    def path(self, backend: str, scenario_id: str) -> Path:
        """``{root}/{backend}/{id}.json``, the id made file-name safe (``tp[s=128]`` stays readable)."""
        return self.folder(backend) / f"{_safe(scenario_id)}.json"

    def obtained_path(self, backend: str, scenario_id: str) -> Path:
        """``{root}/{backend}/{id}.obtained.json``, beside the baseline."""
        return self.folder(backend) / f"{_safe(scenario_id)}{OBTAINED}"

    def curve_path(self, backend: str) -> Path:
        """``{root}/bandwidth-{backend}.json``: beside the backends' folders, not in them."""
        return self.root / f"bandwidth-{backend}.json"

    def load(self, backend: str, scenario_id: str) -> bl.Baseline | None:
        """The scenario's stored baseline (None when there is none); a file that is malformed, or another
        scenario's, is a one-line ``BaselineError``."""
        path = self.path(backend, scenario_id)
        if is_loop(path):
            message = "a symbolic-link loop, not a baseline; remove it: the next gated run writes the baseline anew"
            raise bl.BaselineError([Problem(file=str(path), path="", message=message)])
        return bl.load(path, scenario=scenario_id) if path.exists() else None

    @contextlib.contextmanager
    def only_writer(self, backend: str) -> Iterator[None]:
        """Held from reading a scenario's baseline to writing it back (``--update-baselines``): two runs that
        updated one folder at once each read the latency history, added their run and wrote it back, and the
        last write lost the other's run while both said they had added theirs (found by an adversarial pass).
        An exclusive lock on the backend's folder itself (made here: the run is to write into it), so nothing
        is left among the baselines. A run that finds it held says so, and waits at most ``LOCK_WAIT_S``."""
        import fcntl

        folder = self.folder(backend)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            fix = "give another baseline directory"
            raise WriteError(f"{folder}: cannot write baselines there ({why}); {fix}") from None
        try:
            waited = 0.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if waited == 0:
                        print(f"    waiting for another commgate run updating {folder}", flush=True)
                    if waited >= LOCK_WAIT_S:
                        raise WriteError(
                            f"{folder}: another commgate run has been updating these baselines for {waited:.0f} s; "
                            "wait for it to end, or give another baseline directory"
                        ) from None
                    time.sleep(LOCK_POLL_S)
                    waited += LOCK_POLL_S
                except OSError:  # a file system without locks (some network mounts): unguarded, as before
                    break
            yield
        finally:
            os.close(fd)  # and with it the lock

    def save(self, baseline: bl.Baseline) -> Path:
        """Store ``baseline`` as its scenario's on its backend (atomically); returns the file."""
        return bl.write(self.path(baseline.backend, baseline.scenario), baseline)

    def save_obtained(self, baseline: bl.Baseline) -> Path:
        """Leave ``baseline`` (what a run that differed sent) beside the scenario's baseline."""
        return bl.write(self.obtained_path(baseline.backend, baseline.scenario), baseline)

    def discard_obtained(self, backend: str, scenario_id: str) -> None:
        """Remove the scenario's obtained file, if a run left one (it no longer differs, or was accepted)."""
        self.obtained_path(backend, scenario_id).unlink(missing_ok=True)

    def query(self) -> list[Path]:
        """Every baseline file, sorted (obtained files are not baselines). A folder that holds one backend's
        baselines (``baselines/gloo``) is read as such."""
        return self._baselines("*/*.json") or self._baselines("*.json")

    def unused(self, used: set[str]) -> list[Path]:
        """The baseline files of the backends the run used whose resolved path is not among ``used`` (those a
        whole run judged against). Another backend's (``emulated/`` beside ``gloo/``) the run could not use:
        listing them called the scenarios' own baselines unused (found by an adversarial pass)."""
        folders = {Path(u).parent for u in used}
        found = self._baselines("*/*.json")
        return [p for p in found if (not used or p.resolve().parent in folders) and str(p.resolve()) not in used]

    def _baselines(self, pattern: str) -> list[Path]:
        """The files ``pattern`` finds that are baselines: not obtained files, nor links to nothing (a loop)."""
        return sorted(p for p in self.root.glob(pattern) if not p.name.endswith(OBTAINED) and p.is_file())


LOCK_WAIT_S = 3600.0
"""How long a run waits for another updating the same baseline folder (a latency rerun included)."""
LOCK_POLL_S = 0.2


NAME_MAX = 255
"""Bytes in a file name on Linux's file systems; a longer scenario id is shortened, its hash kept."""


def _safe(scenario_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.=,\[\]+-]", "_", scenario_id)
    if len(safe) + len(OBTAINED) <= NAME_MAX:
        return safe
    return f"{safe[: NAME_MAX - len(OBTAINED) - 17]}~{hashlib.sha256(scenario_id.encode()).hexdigest()[:16]}"
