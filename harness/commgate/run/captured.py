"""A job captured without change: ``commgate capture -o DIR -- COMMAND`` (``launch``), the capture directory
read back into one ``Capture`` (``load``), and the ``Runner`` that hands it to the pipeline
(``FromCapture``), so that ``commgate check`` judges it by the same code as a run.

The directory holds what each rank wrote (``commgate.run.external``): ``rank{r}.json`` (calls and step
windows, as a commgate run's rank writes them), ``rank{r}.meta.json`` (job, launcher, host, versions, how
it ended), and ``job.json`` from ``commgate capture`` (the command, its exit status). A directory that is
not a capture, ranks missing or outside the world, two jobs mixed, a truncated or malformed file: one line
naming the file, the field and what is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from commgate.core import schemas
from commgate.core.errors import DocumentError, Problem, UsageError
from commgate.core.fsutil import atomic_write_json, read_json
from commgate.model.scenario import Expectations, ModelSpec, Parallelism, Scenario
from commgate.run import capture as capture_doc
from commgate.run.capture import Capture, CapturedCall, StepWindow, rank_clock
from commgate.run.external import BOOTSTRAP, CAPTURE_ENV, COMMAND_ENV, JOB_ENV

RANK_FILE = re.compile(r"rank(\d+)\.json")
JOB_FILE = "job.json"


def _bad(file: Path | str, message: str, where: str = "$") -> DocumentError:
    return DocumentError([Problem(file=str(file), path=where, message=message)])


def launch(out: Path, command: list[str]) -> int:
    """Run ``command`` with every rank it starts captured into ``out``; its output passes through, its exit
    status is returned (128 + N when a signal N ended it), and ``out/job.json`` records both."""
    if not command:
        raise UsageError("capture: give the job's command after --, e.g. commgate capture -o DIR -- torchrun ...")
    if out.exists() and not out.is_dir():
        raise UsageError(f"capture: {out} is a file, not a directory; give a new directory")
    if out.exists() and any(RANK_FILE.fullmatch(p.name) for p in out.iterdir()):
        raise UsageError(f"capture: {out} holds a capture already; give a new directory")
    if out.exists() and any(out.iterdir()):  # its files could be the user's: job.json would be written over
        raise UsageError(f"capture: {out} is a directory that is not empty; a capture goes to a new directory")
    new = not out.exists()
    from commgate.core.fsutil import check_writable_dir

    check_writable_dir(out, what="the capture", fix="give another -o")  # before the job, not after it
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"capture: cannot make {out} ({exc.strerror or exc}); give another -o") from None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BOOTSTRAP), env.get("PYTHONPATH")]))
    env[CAPTURE_ENV] = str(out.resolve())
    env[JOB_ENV] = uuid.uuid4().hex
    env[COMMAND_ENV] = shlex.join(command)
    started = time.time()
    try:
        job = subprocess.Popen(command, env=env)
    except OSError as exc:
        if new:  # a command that never started leaves nothing behind
            out.rmdir()
        raise UsageError(f"capture: cannot start {command[0]!r}: {exc.strerror or exc}") from None
    interrupts = 0

    def interrupted(number: int, _frame: Any) -> None:
        """Ctrl-C: the job ends and writes its capture, and this waits for it. A terminal's Ctrl-C reaches the
        job too (one process group): forwarding it again would interrupt torchrun's own shutdown of its
        ranks, so the first is forwarded only where it cannot have come from the terminal; the second is
        forwarded, the third kills the job."""
        nonlocal interrupts
        interrupts += 1
        if interrupts >= 3:
            print("commgate capture: interrupted three times: killing the job", file=sys.stderr)
            job.kill()
        elif interrupts == 2 or not _terminal_reached(job):
            job.send_signal(number)
        else:
            print("commgate capture: interrupted: waiting for the job to end (Ctrl-C again to interrupt it "
                  "once more, a third time to kill it)", file=sys.stderr)  # fmt: skip

    forward = {s: signal.signal(s, lambda n, _f: job.send_signal(n)) for s in (signal.SIGTERM, signal.SIGHUP)}
    forward[signal.SIGINT] = signal.signal(signal.SIGINT, interrupted)
    try:
        code = job.wait()
        _outlived(env[JOB_ENV])
    finally:
        for s, h in forward.items():
            signal.signal(s, h)
    status = 128 - code if code < 0 else code
    atomic_write_json(
        out / JOB_FILE,
        {
            "command": env[COMMAND_ENV],
            "job": env[JOB_ENV],
            "exit_status": status,
            "wall_s": round(time.time() - started, 3),
        },
    )
    written = sorted(p.name for p in out.iterdir() if RANK_FILE.fullmatch(p.name))
    print(f"commgate capture: {len(written)} rank file(s) in {out}; the job exited with {status}", file=sys.stderr)
    if not written:
        print(f"commgate capture: {NONE_WRITTEN}", file=sys.stderr)
    return status


OUTLIVE_S = 30.0
"""How long the job's processes that outlive its command are waited for (``_outlived``) before they are ended."""


def _outlived(job_id: str) -> None:
    """Wait for the job's processes that outlive its command: ``torch.multiprocessing.spawn``'s workers, ended
    by their parent's SIGTERM, write their captures after it has gone (capture counted 0 or 1 of 2 rank files
    and returned, the files written after it: found by an adversarial pass). They are the processes whose
    environment holds the job's id; after ``OUTLIVE_S`` they are terminated, then killed: none is left."""
    left = _job_processes(job_id)
    if not left:
        return
    print(f"commgate capture: waiting for {len(left)} process(es) of the job still running (its ranks write their "
          "captures as they end)", file=sys.stderr)  # fmt: skip
    deadline = time.monotonic() + OUTLIVE_S
    for signum in (None, signal.SIGTERM, signal.SIGKILL):
        if signum is not None:
            print(f"commgate capture: {len(left)} process(es) of the job still running after its command ended: "
                  f"{signal.Signals(signum).name} to {', '.join(map(str, left))}", file=sys.stderr)  # fmt: skip
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _job_processes(job_id)
        if not left:
            return


def _job_processes(job_id: str) -> list[int]:
    """The running processes whose environment holds ``JOB_ENV=job_id`` (Linux' /proc; elsewhere, none)."""
    mark, out = f"{JOB_ENV}={job_id}".encode(), []
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    environ = (entry / "environ").read_bytes()
                except OSError:  # gone, or not ours
                    continue
                if mark in environ.split(b"\0"):
                    out.append(int(entry.name))
    return out


def _terminal_reached(job: subprocess.Popen[bytes]) -> bool:
    """Whether a Ctrl-C that reached this process reached ``job`` too: both in the foreground process group
    of the controlling terminal."""
    try:
        with open("/dev/tty", "rb") as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp() == os.getpgid(job.pid)
    except OSError:  # no terminal (CI, nohup, a kill from elsewhere): the signal was this process's alone
        return False


@dataclass(frozen=True, kw_only=True)
class Captured:
    """A capture directory, read: the merged capture and what the ranks said about the job."""

    directory: Path
    capture: Capture
    metas: tuple[dict[str, Any], ...]
    """Each rank's ``rank{r}.meta.json``, by rank."""
    exit_status: int | None
    """The job's exit status (``job.json``; None when not captured by ``commgate capture``)."""

    @property
    def steps(self) -> int:
        return self.capture.steps

    def provenance(self) -> str:
        """One line: launcher, world size, hosts, steps and how they were found, versions, exit status."""
        m = self.metas[0]
        v = m.get("versions", {})
        ended = {str(x.get("ended")) for x in self.metas}
        status = f"; exit status {self.exit_status}" if self.exit_status is not None else ""
        return (
            f"{self.directory}: {m['launcher']}, {len(self.metas)} ranks on {self.capture.stack.get('hosts')}, "
            f"backend {m['backend']}, {self.steps} step(s) by {m['step_marks']}, torch {v.get('torch')}, "
            f"deepspeed {v.get('deepspeed')}; ranks {', '.join(sorted(ended))}{status}"
        )


def _check_rank_file(doc: Any) -> None:
    """A rank file's calls and windows, held to the capture schema (errors name the rank file's own path)."""
    if not isinstance(doc, dict) or not {"calls", "step_windows"} <= doc.keys():
        import jsonschema

        raise jsonschema.ValidationError("expected an object with calls and step_windows (a rank's capture)")
    stub = {"capture_version": 1, "scenario": "-", "world_size": 1, "warmup_steps": 0, "steps": 1, "backend": "-"}
    clocks = {"clocks": [doc["clock"]]} if "clock" in doc else {}
    capture_doc.validate(stub | {"calls": doc["calls"], "step_windows": doc["step_windows"]} | clocks)


WORLD_MAX = 1048576
"""The most ranks a capture may hold (the scenario schema's bound on a parallelism degree)."""

_NULLABLE = {"type": ["string", "null"]}
META_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "a rank's capture meta (rank{r}.meta.json, written by commgate.run.external)",
    "type": "object",
    "required": [
        "meta_version", "job", "rank", "world_size", "host", "launcher", "backend", "steps", "step_marks",
        "ended", "stack",
    ],
    "properties": {
        "meta_version": {"const": 1},
        "job": {"type": "string"},
        "rank": {"type": "integer", "minimum": 0, "maximum": WORLD_MAX - 1},
        "world_size": {"type": "integer", "minimum": 1, "maximum": WORLD_MAX},
        "local_world_size": {"type": "integer", "minimum": 1, "maximum": WORLD_MAX},
        "host": {"type": "string"},
        "launcher": {"type": "string"},
        "command": {"type": "string"},
        "requested_backend": _NULLABLE,
        "backend": _NULLABLE,
        "not_captured": _NULLABLE,
        "steps": {"type": "integer", "minimum": 0},
        "step_marks": {"type": "string"},
        "ended": {"type": "string"},
        "started": {"type": "number"},
        "stack": {"type": "object", "additionalProperties": _NULLABLE},
        "versions": {"type": "object", "additionalProperties": _NULLABLE},
    },
    # a rank that captured something names the backend it captured over
    "if": {"properties": {"not_captured": {"type": "string"}}, "required": ["not_captured"]},
    "else": {"properties": {"backend": {"type": "string"}}},
}  # fmt: skip
"""What ``commgate.run.external`` writes as ``rank{r}.meta.json`` (further keys are let through)."""

JOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["exit_status"],
    "properties": {"command": {"type": "string"}, "exit_status": {"type": "integer"}},
}
"""``job.json``, as ``launch`` writes it."""

RECAPTURE = "; capture the job again (commgate capture -o NEW_DIR -- COMMAND)"
NONE_WRITTEN = (
    "the job's ranks wrote no capture: a rank writes it when it ends, which os._exit and SIGKILL skip, and a "
    "process is a rank with RANK in its environment (torchrun sets it) or once it names its rank to "
    "init_process_group (torch.multiprocessing.spawn's workers); end the ranks normally (return, sys.exit); "
    f"and the ranks must start with commgate's bootstrap ({BOOTSTRAP}) on their PYTHONPATH, which a launch "
    "script that sets PYTHONPATH itself, or python -I or -E, drops: add it to the PYTHONPATH the script sets"
)


@functools.cache
def _validator(which: str) -> Any:
    return schemas.strict()(META_SCHEMA if which == "meta" else JOB_SCHEMA)


def _check(which: str, doc: Any) -> None:
    """``doc`` held to ``META_SCHEMA`` or ``JOB_SCHEMA``: a ``jsonschema.ValidationError`` that says the fix."""
    import jsonschema

    try:
        _validator(which).validate(doc)
    except jsonschema.ValidationError as exc:
        exc.message += RECAPTURE
        raise


def _check_meta(doc: Any) -> None:
    _check("meta", doc)


def _check_job(doc: Any) -> None:
    _check("job", doc)


def load(directory: Path) -> Captured:
    """The capture in ``directory``, every rank present, one job; else a one-line ``DocumentError``."""
    if not directory.is_dir():
        raise _bad(
            directory, "not a directory; give the -o directory of commgate capture (or COMMGATE_CAPTURE)", where=""
        )
    files: dict[int, Path] = {}
    for p in sorted(directory.iterdir()):
        if found := RANK_FILE.fullmatch(p.name):
            r = int(found.group(1))
            if p.name != f"rank{r}.json" or r in files:  # rank01.json: not a name a rank writes
                raise _bad(p, f"not a rank's file name (rank {r}'s is rank{r}.json); remove or rename it")
            files[r] = p
    if not files and (directory / JOB_FILE).is_file():  # commgate capture ran a job, and no rank wrote
        raise _bad(directory, f"no rank<N>.json in it: {NONE_WRITTEN}", where="")
    if not files:
        raise _bad(
            directory,
            "not a capture: no rank<N>.json in it (commgate capture -o DIR, or COMMGATE_CAPTURE=DIR)",
            where="",
        )
    hint = ": a rank's capture is written when the rank ends; was it killed outright (SIGKILL) or ended by os._exit?"
    metas: dict[int, dict[str, Any]] = {}
    for r, f in sorted(files.items()):
        meta = f.with_name(f"rank{r}.meta.json")
        if not meta.exists():
            raise _bad(meta, f"missing beside {f.name}{hint}")
        metas[r] = read_json(meta, _check_meta, hint=hint)
    first = metas[min(metas)]
    world = first["world_size"]
    for r, m in metas.items():
        where = directory / f"rank{r}.meta.json"
        if m["job"] != first["job"]:
            mixed = f"job {m['job']!r}, but rank{min(metas)}'s is {first['job']!r}: two jobs' captures in one directory"
            raise _bad(
                where,
                f"{mixed}; capture each job into a directory of its own (one job over several nodes: not commgate "
                "capture on each node, which makes each its own job, but COMMGATE_CAPTURE and commgate's bootstrap "
                "on every rank's PYTHONPATH, as ci/nightly.sbatch sets them: docs/capture.md)",
                "$.job",
            )
        if m["rank"] != r or m["world_size"] != world:
            raise _bad(where, f"rank {m['rank']} of {m['world_size']}: not rank {r} of {world}")
        if r >= world:
            stray = f"rank {r} of a world of {world}: no such rank; remove rank{r}.json and {where.name}"
            raise _bad(where, f"{stray}, or capture the job again into a directory of its own", "$.rank")
        if m.get("not_captured"):
            raise _bad(where, f"nothing was captured: {m['not_captured']}", "$.not_captured")
    if len(files) < world:  # every rank present is below world: some below it are missing
        shown = list(itertools.islice((r for r in range(world) if r not in files), 8))
        names = ", ".join(f"rank{r}.json" for r in shown)
        more = f" and {world - len(files) - len(shown)} more" if world - len(files) > len(shown) else ""
        ranks = ", ".join(map(str, shown)) + (", ..." if more else "")
        raise _bad(directory, f"ranks [{ranks}] of a world of {world} are missing ({names}{more}){hint}", where="")
    docs = {r: read_json(f, _check_rank_file, hint=hint) for r, f in sorted(files.items())}
    for r, doc in docs.items():
        _as_its_rank_wrote_it(files[r], r, doc, world)
    return _merge(directory, docs, metas)


def _as_its_rank_wrote_it(path: Path, r: int, doc: dict[str, Any], world: int) -> None:
    """A rank file that holds what its rank could have written: its own calls and windows, each sequence
    number once, groups of ranks of the world that hold the rank, peers and roots in the call's group, steps
    within the rank's windows. A file edited or put together by hand is refused here, not judged (found by an
    adversarial pass: a call of step 99 was left out in silence, another rank's call counted as this one's)."""
    steps = {w["step"] for w in doc["step_windows"]}
    for i, w in enumerate(doc["step_windows"]):
        if w["rank"] != r:
            raise _bad(
                path, f"a step window of rank {w['rank']} in rank {r}'s file{RECAPTURE}", f"$.step_windows[{i}].rank"
            )
    last = max(steps, default=-1) + 1  # the calls after the last window ends belong to none (as written)
    seen: set[int] = set()
    for i, c in enumerate(doc["calls"]):
        at = f"$.calls[{i}]"
        group = c["group"]
        why, key = "", ""
        if c["rank"] != r:
            why, key = f"a call of rank {c['rank']} in rank {r}'s file", "rank"
        elif c["seq"] in seen:
            why, key = f"sequence number {c['seq']} a second time", "seq"
        elif r not in group or max(group) >= world or len(set(group)) != len(group):
            why, key = f"group {group}: not distinct ranks of a world of {world} that include rank {r}", "group"
        elif c["peer"] is not None and (c["peer"] not in group or c["peer"] == r):
            why, key = f"peer {c['peer']}: not another rank of the call's group {group}", "peer"
        elif c.get("root") is not None and c["root"] not in group:
            why, key = f"root {c['root']}: not a rank of the call's group {group}", "root"
        elif c["step"] > last:
            why, key = f"step {c['step']}, past the rank's last step window ({last - 1})", "step"
        if why:
            raise _bad(path, f"{why}: not what a rank writes{RECAPTURE}", f"{at}.{key}")
        seen.add(c["seq"])


def _merge(directory: Path, docs: dict[int, dict[str, Any]], metas: dict[int, dict[str, Any]]) -> Captured:
    calls = sorted(
        (CapturedCall.from_json(c) for d in docs.values() for c in d["calls"]), key=lambda c: (c.rank, c.seq)
    )
    windows = sorted(
        (StepWindow(**w) for d in docs.values() for w in d["step_windows"]), key=lambda w: (w.rank, w.step)
    )
    steps = max((w.step + 1 for w in windows), default=0)
    if steps == 0:
        why = "no training step was found: no module forward ran after the group was set up"
        why += ", and the job never called commgate.capture.step()"
        raise _bad(directory / "rank0.meta.json", f"{why}; call it where each step begins", "$.steps")
    first = metas[0]
    hosts = ",".join(dict.fromkeys(str(m["host"]) for m in metas.values()))
    stack = {k: v for k, v in first["stack"].items() if v is None or isinstance(v, str)}
    stack |= {"launcher": str(first["launcher"]), "hosts": hosts, "command": str(first.get("command", ""))}
    job = directory / JOB_FILE
    status = read_json(job, _check_job)["exit_status"] if job.exists() else None
    cap = Capture(
        scenario=directory.name,
        world_size=first["world_size"],
        warmup_steps=0,
        steps=steps,
        backend=str(first["backend"]),
        calls=tuple(calls),
        stack=stack,
        step_windows=tuple(windows),
        clocks=tuple(sorted((k for d in docs.values() for k in rank_clock(d)), key=lambda k: k.rank)),
    )
    return Captured(directory=directory, capture=cap, metas=tuple(metas[r] for r in sorted(metas)), exit_status=status)


@dataclass(kw_only=True)
class FromCapture:
    """The pipeline's ``Runner`` for a job already captured: its capture, held to the scenario that
    describes the job (world size and steps, warm-up included). A captured job cannot be run again: the
    gate's rerun to confirm a latency shift fails, so the shift stays unconfirmed (as a failed rerun)."""

    captured: Captured
    handed: int = 0

    def skip_reason(self, scenario: Scenario) -> str | None:
        return None

    def mismatch(self, scenario: Scenario) -> str | None:
        """Why ``scenario`` cannot describe the captured job (its world size, its steps), or None: said before
        anything is judged (``check`` printed the scenario's progress line first: found by an adversarial
        pass), and again where a run reaches it."""
        cap, where = self.captured.capture, self.captured.directory
        total = scenario.warmup_steps + scenario.steps
        if scenario.world_size != cap.world_size:
            return f"{scenario.file}: world size {scenario.world_size}, but {where} holds {cap.world_size} ranks"
        if total != cap.steps:
            return (
                f"{scenario.file}: warmup_steps {scenario.warmup_steps} + steps {scenario.steps} = {total}, but "
                f"{where} holds {cap.steps} step(s); set them to add up to the captured job's steps"
            )
        return None

    def run(self, scenario: Scenario) -> Capture:
        from commgate.run.launcher import RunError

        cap, where = self.captured.capture, self.captured.directory
        self.handed += 1
        if self.handed > 1:
            raise RunError(f"{where}: a captured job cannot be rerun")
        if why := self.mismatch(scenario):
            raise UsageError(why)
        if split := parted(cap.calls, sorted({c.rank for c in cap.calls})):  # the job, not the gate, failed
            raise RunError(f"{where}: the ranks' calls part: {split}")
        if status := self.captured.exit_status:  # a crash after its last call (a checkpoint save) passed
            raise RunError(f"{where}: {failed(status)}")
        return replace(cap, scenario=scenario.id, warmup_steps=scenario.warmup_steps, steps=scenario.steps)


def failed(status: int) -> str:
    """Why a capture of a job that exited with ``status`` (not 0) is not judged, in one line: a live run whose
    rank fails is an error, and so is its capture, whatever its calls (a job that crashed after its last call
    passed the gate: found by an adversarial pass)."""
    signum = status - 128 if status > 128 else None
    how = f" (signal {signal.Signals(signum).name})" if signum in signal.valid_signals() else ""
    return (
        f"the job exited with status {status}{how} (job.json): a failed job is not judged; its output says why: "
        "mend it and capture it again"
    )


def parted(calls: Sequence[Any], ranks: Sequence[int]) -> str | None:
    """Where the ranks' ``calls`` (a capture's, or Flight Recorder dumps') first part (a call one rank issued
    that its group's others never did), as the stall watchdog names it; None where they agree. A live run
    whose ranks part hangs, and the watchdog fails it; a capture of such a job is failed here, as its run
    (a capture that passed against its own baseline while its ranks parted was found by an adversarial pass)."""
    from commgate.run.diagnose import divergence

    keys = ("step", "op", "group", "peer", "bytes")
    return divergence({r: [{k: getattr(c, k) for k in keys} for c in calls if c.rank == r] for r in ranks})


LAUNCHER_MODULES = frozenset(
    {
        "torch",
        "torchrun",
        "torch.distributed.run",
        "torch.distributed.launch",
        "deepspeed",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
    }
)
"""Modules that launch a job (``python -m torch.distributed.launch train.py``): the job is the script they
start, not they (every job started by one was kept under the baseline ``launch``: an adversarial pass)."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
"""What a baseline's name may be (the scenario schema's ``name``)."""


def job_name(captured: Captured) -> str:
    """The name a capture's baseline is kept under when no scenario names it: the job's script (``train``
    for ``torchrun ... train.py``) or module (``-m pkg.train``), from the command the ranks recorded."""
    command = str(captured.capture.stack.get("command", ""))
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: recorded unquoted by an older commgate (``" ".join(argv)``)
        words = command.split()
    # the first script or module the command names: the job's (a .py after it is an argument of the job's)
    named = [(i, Path(w).stem) for i, w in enumerate(words) if w.endswith(".py")]
    modules = [(i + 1, words[i + 1]) for i, w in enumerate(words[:-1]) if w == "-m"]
    named += [(i, m.rsplit(".", 1)[-1]) for i, m in modules if m not in LAUNCHER_MODULES]
    # a script named "my train.py" keeps its baseline as my-train: a name of the characters a file name takes
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", min(named)[1]).strip("-._")[:100] if named else ""
    if not NAME.fullmatch(name):
        where = captured.directory / "rank0.meta.json"
        raise _bad(
            where, f"no job name in the command {command!r}; give one: commgate check DIR --name NAME", "$.command"
        )
    return name


def unscripted(captured: Captured, name: str) -> Scenario:
    """The scenario of a capture no scenario describes: named ``name`` (its baseline's name), its world size
    and steps the captured ones, judged against its baseline and the drift rules only. Its model is a
    stand-in the pipeline needs and neither checks nor shows (``Expectations.model_known``)."""
    if not NAME.fullmatch(name):
        raise UsageError(
            f"check: --name {name[:40]!r}{'...' if len(name) > 40 else ''}: at most 100 letters, digits, '_', '.', "
            "'-', starting with a letter or digit"
        )
    world = captured.capture.world_size
    return Scenario(
        id=name,
        name=name,
        description=f"the job captured in {captured.directory}, judged without a scenario (baseline only)",
        file=str(captured.directory),
        model=ModelSpec(L=1, h=8, a=1, V=8, s=8),
        parallelism=Parallelism(scheme="ddp", dp=world),
        steps=captured.steps,
        warmup_steps=0,
        expectations=Expectations(model_check=False, model_known=False),
    )
