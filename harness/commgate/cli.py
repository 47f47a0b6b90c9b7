"""The ``commgate`` command line.

Exit status: 0 success; 1 a check failed; 2 bad input or usage (one line per problem on stderr).
``predict`` imports neither torch nor deepspeed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from commgate import __version__
from commgate.core import env
from commgate.core.errors import CommgateError, ScenarioError, UsageError
from commgate.model.importer import HF_TYPES
from commgate.model.scenario import LatencyRule
from commgate.model.schemes import SCHEMES

if TYPE_CHECKING:
    from commgate.model.importer import Imported
    from commgate.model.scenario import Scenario
    from commgate.report.liveline import LiveLine
    from commgate.run.runners import Runner
    from commgate.session import Session

DEFAULT_SUITE = "scenarios"
BASELINES_DEFAULT = (
    "baselines/ in pytest's rootdir (the folder of the pytest configuration pytest finds from here), as the "
    "gate's; else ./baselines"
)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, as every other error of the command (the usage it would print
    first is what ``--help`` shows)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _pytest_config() -> Path | None:
    """The pytest configuration pytest finds from the working directory (``find_pytest_config``)."""
    from commgate.model.starter import find_pytest_config

    return find_pytest_config(Path.cwd())


def _rootdir(config: Path | None) -> Path:
    """pytest's rootdir as the CLI's defaults take it: the folder of ``config`` (the configuration pytest finds
    from here: from a subfolder, the repository's), written from here; else here (``.``)."""
    if config is None or config.parent.resolve() == Path.cwd().resolve():
        return Path(".")
    return Path(os.path.relpath(config.parent, Path.cwd()))


def default_paths(given: list[str], *, instead: str = "") -> list[str]:
    """The scenario paths a command reads: ``given``, else the folders the repository's pytest configuration
    names (``commgate_scenario_dirs``, as ``commgate init`` writes it and the pytest gate reads it), else
    ./scenarios; none there is one line saying what to give."""
    if given:
        return given
    from commgate.model.starter import scenario_dirs

    config = _pytest_config()
    named = scenario_dirs(config) if config is not None else []
    dirs = named or [str(_rootdir(config) / DEFAULT_SUITE)]
    if not any(Path(d).is_dir() for d in dirs):
        suite = dirs[0] if dirs[0].startswith(".") else f"./{dirs[0]}"  # ./scenarios, ../scenarios
        if config is not None and suite != f"./{DEFAULT_SUITE}":
            suite += f" (in pytest's rootdir, the folder of {config})"
        where = f"the folders {config} names ({', '.join(named)})" if named else suite
        raise UsageError(
            f"no scenarios here: {where} not found; give scenario files or folders{instead}, or start a folder "
            "with commgate init"
        )
    return dirs


def _add_predict(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "predict",
        help="expected communication of scenarios (no torch needed)",
        description="Print the per-collective expectation and the paper's equations for scenario files, "
        "directories of them, or a scenario given by flags.",
    )
    p.add_argument(
        "paths",
        nargs="*",
        type=env.path_text,
        help="scenario files or directories (default: the pytest configuration's commgate_scenario_dirs, else "
        f"./{DEFAULT_SUITE})",
    )
    g = p.add_argument_group("a scenario from flags (instead of files)")
    g.add_argument(
        "--model",
        metavar="PRESET",
        type=env.nonempty,
        help="model preset, e.g. 13B or 19M-cpu (see `commgate presets`)",
    )
    g.add_argument("--scheme", choices=list(SCHEMES), help="; ".join(f"{n}: {s.summary}" for n, s in SCHEMES.items()))
    g.add_argument("--dp", type=int, help="data-parallel degree (default 1)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", type=int, help="pipeline stages (default 1)")
    g.add_argument("--seq", type=int, help="sequence length s (default: the preset's)")
    g.add_argument("--micro-batch", type=int, help="micro-batch size b (default 1)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step m (default 1)")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="default: the preset's")
    g.add_argument("--checkpointing", action="store_true", help="activation checkpointing (Eq. 5's assumption)")
    g.add_argument("--tied", action="store_true", help="tied input/output embeddings")
    g.add_argument("--experts", type=int, help="MoE experts per layer (scheme moe)")
    g.add_argument("--ep", type=int, help="MoE expert-parallel size (default 1; with --experts)")
    g.add_argument("--hpz", type=int, help="ZeRO++ hpZ partition size")
    g.add_argument("--qwz", action="store_true", help="ZeRO++ quantized weights")
    g.add_argument("--qgz", action="store_true", help="ZeRO++ quantized gradients")
    g.add_argument("--dp-replicate", type=int, help="HSDP replicas of the model sharded over --dp (scheme fsdp)")
    g.add_argument("--cp", type=int, help="context-parallel degree (scheme cp)")
    g.add_argument("--param-dtype", choices=["fp32", "bf16"], help="FSDP2 mixed precision: the gathers' dtype")
    g.add_argument("--reduce-dtype", choices=["fp32", "bf16"], help="FSDP2 mixed precision: the reductions' dtype")
    g.add_argument(
        "--reshard-after-forward",
        choices=["true", "false"],
        help="FSDP2, every group (default: torch's choice, the blocks but not the root)",
    )
    p.set_defaults(scenario_flags=tuple((act.option_strings[0], act.dest, act.default) for act in g._group_actions))
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    o.add_argument("--matrix", action="store_true", help="include the rank x rank traffic matrix")
    o.add_argument("--detail", action="store_true", help="every row of the model (per bucket, layer) with its source")
    o.add_argument("--report-dir", type=env.path, help="also write predictions.json there (atomically)")


FLAGS = {
    "$.model": "--model", "$.model.preset": "--model", "$.model.s": "--seq", "$.model.dtype": "--dtype",
    "$.model.tied_embeddings": "--tied", "$.parallelism": "--scheme", "$.parallelism.scheme": "--scheme",
    "$.parallelism.dp": "--dp", "$.parallelism.tp": "--tp", "$.parallelism.pp": "--pp",
    "$.parallelism.micro_batch": "--micro-batch", "$.parallelism.micro_batches": "--micro-batches",
    "$.parallelism.activation_checkpointing": "--checkpointing", "$.parallelism.zero": "--hpz/--qwz/--qgz",
    "$.parallelism.zero.hpz": "--hpz", "$.parallelism.zero.qwz": "--qwz", "$.parallelism.zero.qgz": "--qgz",
    "$.parallelism.moe": "--experts", "$.parallelism.moe.experts": "--experts", "$.parallelism.moe.ep": "--ep",
    "$.parallelism.dp_replicate": "--dp-replicate", "$.parallelism.cp": "--cp",
    "$.parallelism.fsdp.param_dtype": "--param-dtype", "$.parallelism.fsdp.reduce_dtype": "--reduce-dtype",
    "$.parallelism.fsdp.reshard_after_forward": "--reshard-after-forward",
    "$.parallelism.fsdp": "--param-dtype/--reduce-dtype/--reshard-after-forward",
}  # fmt: skip
"""The scenario paths ``_flags_document`` writes and the ``predict`` flag each comes from."""


def _flags_document(a: argparse.Namespace) -> dict[str, Any]:
    if not a.model:
        raise UsageError(f"{'--scheme' if a.scheme else 'a scenario by flags'} needs --model PRESET (or give scenario "
                         "files instead)")  # fmt: skip
    if not a.scheme:
        raise UsageError(f"--model needs --scheme ({', '.join(SCHEMES)})")
    model: dict[str, Any] = {"preset": a.model}
    if a.seq is not None:
        model["s"] = a.seq
    if a.dtype:
        model["dtype"] = a.dtype
    if a.tied:
        model["tied_embeddings"] = True
    if a.ep is not None and a.experts is None:
        raise UsageError("--ep needs --experts N (the experts per layer it places; scheme moe)")
    dp, tp, pp = (1 if v is None else v for v in (a.dp, a.tp, a.pp))  # unset, not given: every flag given counts
    par: dict[str, Any] = {
        "scheme": a.scheme,
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "micro_batch": 1 if a.micro_batch is None else a.micro_batch,
        "micro_batches": 1 if a.micro_batches is None else a.micro_batches,
        "activation_checkpointing": a.checkpointing,
    }
    zero = {k: v for k, v in (("hpz", a.hpz), ("qwz", a.qwz or None), ("qgz", a.qgz or None)) if v is not None}
    if zero:
        par["zero"] = zero
    if a.experts is not None:
        par["moe"] = {"experts": a.experts, "ep": 1 if a.ep is None else a.ep}
    if a.dp_replicate is not None:
        par["dp_replicate"] = a.dp_replicate
    if a.cp is not None:
        par["cp"] = a.cp
    fsdp: dict[str, Any] = {"param_dtype": a.param_dtype, "reduce_dtype": a.reduce_dtype}
    if a.reshard_after_forward is not None:
        fsdp["reshard_after_forward"] = a.reshard_after_forward == "true"
    if fsdp := {k: v for k, v in fsdp.items() if v is not None}:
        par["fsdp"] = fsdp
    name = f"{a.model}-{a.scheme}-dp{dp}-tp{tp}-pp{pp}".replace("+", "p")
    return {"schema_version": 1, "name": name, "model": model, "parallelism": par}


def cmd_predict(a: argparse.Namespace) -> int:
    from commgate.core.fsutil import atomic_write_json
    from commgate.model.loader import load_document, load_paths
    from commgate.model.predict import predict
    from commgate.report.render import prediction_document, prediction_text, predictions_document

    given = [flag for flag, dest, default in a.scenario_flags if getattr(a, dest) != default]
    if given and a.paths:  # a flag would be silently ignored: the files are predicted as written
        raise UsageError(f"give scenario paths or a scenario by flags ({', '.join(given)}), not both")
    if given:
        try:
            scenarios = load_document(_flags_document(a), file="<command line>")
        except ScenarioError as exc:  # said by the flags the user gave, not the document made of them
            raise UsageError(
                "; ".join(f"{FLAGS.get(p.path.split('[')[0], p.path)}: {p.message}" for p in exc.problems)
            ) from None
    else:
        scenarios = load_paths(default_paths(a.paths, instead=" (or --model/--scheme)"))
    preds = [predict(s) for s in scenarios]
    if a.report_dir:
        doc = predictions_document(preds, matrix=a.matrix, detail=a.detail)
        out = atomic_write_json(a.report_dir / "predictions.json", doc)
        print(f"wrote {out}", file=sys.stderr)
    if a.json:
        doc = (
            prediction_document(preds[0], matrix=a.matrix, detail=a.detail)
            if len(preds) == 1
            else predictions_document(preds, matrix=a.matrix, detail=a.detail)
        )
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print("\n\n".join(prediction_text(p, matrix=a.matrix, detail=a.detail) for p in preds))
        print(f"\n{len(preds)} scenario(s) predicted.")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    """Every scenario through ``commgate.pipeline.run_scenario``: on local ranks, or, under torchrun, with
    this process as one rank of the job (rank 0 reports). The handlers of the signals that stop it (``_stop``)
    are the caller's again once it returns without one (a test that calls ``main`` in its own process)."""
    previous = {n: signal.getsignal(n) for n in STOPS}
    try:
        return _run(a)
    finally:
        for n, handler in previous.items():
            if signal.getsignal(n) is _stop:
                signal.signal(n, handler)


def _run(a: argparse.Namespace) -> int:
    from commgate.model.loader import load_paths, trainers_named
    from commgate.report.liveline import LiveLine
    from commgate.run import links
    from commgate.run.runners import LocalRanks, TorchrunRank, under_torchrun
    from commgate.session import Session, options

    # A CI runner's cancel (SIGTERM) and a closed terminal or dropped ssh (SIGHUP) unwind like Ctrl-C, so that
    # rank processes are killed on the way out and the report says the run was interrupted.
    for number in STOPS:
        signal.signal(number, _stop)
    checked = options(
        lambda name: f"--{name}",
        baseline_dir=a.baseline_dir,
        gate=a.gate,
        update=a.update_baselines,
        refresh_latency=a.refresh_latency,
        deadline=a.deadline,
    )
    if a.select and not all(k.strip() for k in a.select):  # an unset $SEL would select every scenario
        raise UsageError("-k '': an empty selection matches every scenario; give part of a scenario id, or no -k")
    if a.link is not None and not a.link.strip():
        raise UsageError("--link '': give a rate (e.g. 10gbit), or no --link")
    if a.emulate and a.link:
        raise UsageError(
            f"--emulate with --link {a.link}: a shaped link joins two halves of the started ranks, and an emulated "
            "run starts one; give one of the two"
        )
    paths = default_paths(a.paths)
    if not under_torchrun():  # the ranks' forkserver imports torch, DeepSpeed and the trainers meanwhile
        from commgate.run.launcher import start_forkserver

        start_forkserver(trainers_named(paths))
    scenarios = load_paths(paths)
    if a.select:
        scenarios = [s for s in scenarios if any(k in s.id for k in a.select)]
        if not scenarios:
            raise UsageError(f"no scenario id contains any of {a.select}")
    if a.emulate:  # those that cannot be are skipped with the reason (commgate.run.workloads.skip_reason)
        scenarios = [dataclasses.replace(s, emulate=True) for s in scenarios]
    link = links.Link.parse(a.link) if a.link else None
    live = LiveLine(sys.stdout)
    runner: Runner
    if under_torchrun():
        if link is not None:
            raise UsageError("--link shapes local ranks' network; under torchrun the cluster's network is the link")
        runner = rank = TorchrunRank()
        lead, how = rank.lead, " (torchrun)"
    else:
        runner, lead, how = LocalRanks(deadline_s=a.deadline, progress=live), True, ""
    whole = all(Path(p).is_dir() for p in a.paths) and not a.select  # the suite of its directories, all of it
    with contextlib.ExitStack() as stack:
        if link is not None:
            shaped = stack.enter_context(links.shaped(link))
            runner = LocalRanks(deadline_s=a.deadline, network=shaped, progress=live)
            how = f" over a {link} link"
        session = Session(options=checked, runner=runner, report_dir=a.report_dir if lead else None)
        session.expect(scenarios)
        session.check_writable()  # before any rank starts: a path that cannot be written is one line
        if session.report_dir is not None:
            stack.enter_context(session.only_writer())
        return _run_all(session, scenarios, how, live, whole=whole) if lead else _run_rank(session, scenarios)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(number: int, _frame: object) -> None:
    """The first Ctrl-C, SIGTERM or SIGHUP: a KeyboardInterrupt (SIGINT's says nothing: "Ctrl-C"), and every
    later one waits for the clean-up it starts (``_stopping``): a second SIGINT (Ctrl-C pressed twice, or a
    wrapper forwarding the terminal's) broke it off, leaving the previous run's report.json unmarked, a traceback
    from an at-exit hook and the forkserver behind (found by an adversarial pass)."""
    for n in STOPS:
        signal.signal(n, _stopping)
    raise KeyboardInterrupt("" if number == signal.SIGINT else signal.Signals(number).name)


def _stopping(number: int, _frame: object) -> None:
    os.write(2, b"commgate: stopping: the ranks are being stopped and the report written\n")  # no print: reentrant


def _run_all(session: Session, scenarios: list[Scenario], how: str, live: LiveLine, *, whole: bool) -> int:
    """Every scenario with its progress (``live``) and summary lines, then ``_finish``."""
    at = ""
    try:
        for i, s in enumerate(scenarios, 1):
            at = f" during {s.id}, scenario {i} of {len(scenarios)}"
            what = s.parallelism.scheme if s.expectations.model_known else "no scenario"
            print(f"[{i}/{len(scenarios)}] {s.id}: {what} on {s.world_size} ranks{how} ...", flush=True)
            live.start(s.id)
            try:
                result = session.run(s)
            finally:
                live.clear()
            if result is not None:
                print(result.summary(), flush=True)
    except KeyboardInterrupt as exc:  # the report says so, and holds the scenarios that finished
        session.interrupt(f"{str(exc) or 'Ctrl-C'}{at}")
        _finish(session, whole=False)
        raise
    return _finish(session, whole=whole)


def _run_rank(session: Session, scenarios: list[Scenario]) -> int:
    """A torchrun rank other than rank 0: it runs every scenario with the others and reports nothing."""
    for s in scenarios:
        session.run(s)
    return 0


def _finish(session: Session, *, whole: bool) -> int:
    """The baselines a ``whole`` suite did not use, the HTML page beside report.json, the time model's
    accuracy, the summary line, and the exit status."""
    if session.updated:  # as pytest's "commgate baselines" section says them: a rewrite is never silent
        print("baselines written:", *session.updated, sep="\n    ")
    if whole and (unused := session.unused_baselines()):
        print("baselines no scenario used:", *unused, sep="\n    ")
    if session.report.path is not None:
        print("writing the HTML report ...", flush=True)
    page = session.finish()
    where = f"; report: {session.report.path}, {page}" if page is not None else ""
    from commgate.report.timemodel import accuracy_line

    if line := accuracy_line(s["time_model"] for s in session.report.scenarios if s.get("time_model")):
        print(line)
    counts = session.counts
    stopped = f"interrupted ({session.report.interrupted}): " if session.report.interrupted else ""
    print(stopped + ", ".join(f"{n} {k}" for k, n in counts.items()) + where)
    return 1 if counts["failed"] or counts["error"] else 0


def cmd_capture(a: argparse.Namespace) -> int:
    """The job's own command with every rank it starts captured; its exit status is commgate's."""
    from commgate.run.captured import launch

    command = a.job[1:] if a.job[:1] == ["--"] else a.job
    return launch(a.out, command)


def cmd_check(a: argparse.Namespace) -> int:
    """A captured job judged as a run is: ``commgate.pipeline.run_scenario`` over the capture (or over a
    Flight Recorder dump's calls, placed in the capture's steps)."""
    from commgate.report.liveline import LiveLine
    from commgate.run.captured import FromCapture, load
    from commgate.session import Session, options

    if a.capture is None:
        if a.flight_recorder is None:
            raise UsageError("check: give the capture directory DIR, or --flight-recorder DUMPS")
        return _flight_recorder_alone(a)
    if a.scenario is not None and a.name is not None:
        raise UsageError("check: --name names a capture judged without a scenario; --scenario names it already")
    checked = options(
        lambda name: f"--{name}",
        baseline_dir=a.baseline_dir,
        update=a.update_baselines,
        refresh_latency=a.refresh_latency,
    )
    captured = load(a.capture)
    scenarios = _check_scenario(a, captured)
    if why := next(filter(None, map(FromCapture(captured=captured).mismatch, scenarios)), None):
        raise UsageError(why)
    print(captured.provenance(), flush=True)
    if a.scenario is None:
        print(f"    no scenario: judged against the baseline {scenarios[0].id!r} and the drift rules only", flush=True)
    if a.flight_recorder is not None:
        from commgate.run.flightrec import align, read

        dumps = read(a.flight_recorder)
        placed, parted = align(dumps, captured.capture)
        _print_dumps(dumps)
        if parted:
            print("the dumps and the capture part:", *parted, sep="\n    ")
            return 1
        print(f"    every one of the dumps' {len(dumps.calls)} calls is a captured call; judged in the capture's steps")
        captured = dataclasses.replace(captured, capture=placed)
    session = Session(options=checked, runner=FromCapture(captured=captured), report_dir=a.report_dir)
    return _run_all(session, scenarios, " (captured)", LiveLine(sys.stdout), whole=False)


def _check_scenario(a: argparse.Namespace, captured: Any) -> list[Scenario]:
    """The one scenario ``check`` judges the capture by: ``--scenario``'s (its own ``capture:``, if any, is
    this DIR), or, without one, the baseline-only stand-in named ``--name`` or after the job."""
    from commgate.model.loader import load_paths
    from commgate.run.captured import job_name, unscripted

    if a.scenario is None:
        return [unscripted(captured, a.name or job_name(captured))]
    scenarios = load_paths([a.scenario])
    if len(scenarios) != 1:
        raise UsageError(f"check: {a.scenario} holds {len(scenarios)} scenarios (a sweep); a capture is one job")
    (s,) = scenarios
    if s.capture is not None and Path(s.capture) != a.capture.resolve():
        raise UsageError(f"check: {a.scenario}: capture: {s.capture}, but DIR is {a.capture}; give one of them")
    return [dataclasses.replace(s, capture=None)]  # FromCapture over DIR (with --flight-recorder's calls)


def _print_dumps(dumps: Any) -> None:
    """What the dumps hold: ranks, version, calls per op, entries per state, and what they cannot tell."""
    ops: dict[str, int] = {}
    for c in dumps.calls:
        ops[str(c.op)] = ops.get(str(c.op), 0) + 1
    held = ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
    print(f"{dumps.source}: Flight Recorder dumps of ranks {list(dumps.ranks)}, version {dumps.version}: {held}")
    for r, states in dumps.states.items():
        print(f"    rank {r}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    print("    what the dumps cannot tell:", *dumps.notes, sep="\n      ")


def _flight_recorder_alone(a: argparse.Namespace) -> int:
    """Dumps without their job's capture: what they hold, and where the ranks' calls first part (as the stall
    watchdog names it); the model and the baseline need the steps, which only a capture holds."""
    from commgate.run.captured import parted
    from commgate.run.flightrec import read

    if a.scenario is not None or a.update_baselines:
        raise UsageError(
            "check --flight-recorder: a dump holds no steps, which --scenario and the baseline judge by; give the "
            "job's capture directory too (commgate check DIR --flight-recorder DUMPS --scenario S.yaml)"
        )
    dumps = read(a.flight_recorder)
    _print_dumps(dumps)
    if not dumps.calls:  # nothing to judge is not "the ranks agree"
        print("no call to judge: the dumps hold none (what the dumps cannot tell says why)")
        return 1
    if split := parted(dumps.calls, dumps.ranks):
        print(f"the ranks' calls part: {split}")
        return 1
    print(f"the ranks agree on every call the dumps hold ({len(dumps.calls)} calls)")
    return 0


def _report_of(path: Path) -> Path:
    """A report directory (what ``run --report-dir`` wrote) as its ``report.json``, as ``compare`` takes it
    (``html`` and ``calibrate`` said "a directory, not a file": found by an adversarial pass)."""
    return path / "report.json" if path.is_dir() and (path / "report.json").is_file() else path


def cmd_html(a: argparse.Namespace) -> int:
    from commgate.core.fsutil import check_writable_dir
    from commgate.report.htmlreport import check_outputs, write

    a.report = _report_of(a.report)
    out = a.out or a.report.parent
    check_writable_dir(out, what="the HTML page", fix="give another --out")
    check_outputs(out, fix="give another --out")
    beside = out / "report.json"  # another run's report there: its page would describe this one (adversarial pass)
    if beside.exists() and not (a.report.exists() and beside.samefile(a.report)):
        raise UsageError(
            f"--out {out} holds another report (report.json): its index.html would describe {a.report}; give a "
            "directory of its own"
        )
    print(write(out, _load_report(a.report)))
    return 0


def _load_report(path: Path) -> dict[str, Any]:
    """A report document, validated; a one-line error otherwise."""
    from commgate.core.fsutil import read_json
    from commgate.report.report import REPORT_VERSION, validate

    hint = ": expected a report.json written by commgate"
    doc: dict[str, Any] = read_json(path, validate, hint=hint, version=REPORT_VERSION)
    return doc


def cmd_calibrate(a: argparse.Namespace) -> int:
    from commgate.judge.store import BaselineStore
    from commgate.report import bandwidth
    from commgate.report.timemodel import calibrate

    a.report = _report_of(a.report)
    doc = _load_report(a.report)
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in doc["scenarios"]:
        if s.get("capture") and s.get("time_model"):
            cap = s["capture"]
            by.setdefault((cap["backend"], cap["stack"].get("hardware") or ""), []).append(s)
    fits = {key: (fit, rows) for key, rows in by.items() if (fit := calibrate([s["time_model"] for s in rows]))}
    if not fits:
        raise UsageError(
            f"{a.report}: no scenario inside the model's domain has both a predicted and a measured time "
            "(is there a curve? more ranks than cores are left out)"
        )
    store = BaselineStore(a.baseline_dir)
    for (backend, hardware), (fit, _) in fits.items():  # each curve there first: no fit said of one not stored
        bandwidth.can_calibrate(store.curve_path(backend), hardware, fit.utilization)
    for (backend, hardware), (fit, rows) in sorted(fits.items()):
        names = ", ".join(s["name"] for s in rows if not s["time_model"].get("domain"))
        print(f"  calibrated on: {names}")
        for key, seconds in sorted(fit.host_s.items()):
            if key in fit.undetermined:
                print(
                    f"  host time per layer pass, {key:<12} not determined: its runs' FLOPs and layer passes are "
                    "in one proportion (one scenario, or one size), so their compute time cannot tell it from u; "
                    f"taken as 0 (calibrate on a report with {key} scenarios of other sizes to fit it)"
                )
            else:
                print(f"  host time per layer pass, {key:<12} {seconds * 1e3:8.3f} ms")
        how = f"fitted to {fit.scenarios} scenarios of the report created {doc['created']}"
        path = store.curve_path(backend)
        bandwidth.calibrate(path, hardware, fit.utilization, how, fit.host_s, fit.lag)
        for key, lag in sorted(fit.lag.items()):
            print(f"  in flight beyond the curve, {key:<12} {lag:8.3f} s per s of compute")
        print(f"{hardware} ({backend}): u = {fit.utilization:.3f}, {how}")
    return 0


def cmd_validate(a: argparse.Namespace) -> int:
    from commgate.model.loader import load_paths

    scenarios = load_paths(default_paths(a.paths))
    for s in scenarios:
        print(f"ok  {s.id}  ({s.file}; {s.parallelism.scheme}, world {s.world_size})")
        for w in s.remarks:
            print(f"    warning: {w}")
    print(f"{len(scenarios)} scenario(s) valid.")
    return 0


def cmd_presets(a: argparse.Namespace) -> int:
    from commgate.model.transformer import PRESETS, param_count

    w = max(len("preset"), *map(len, PRESETS))  # the columns stay aligned whatever a preset is named
    print(f"{'preset':<{w}} {'L':>3} {'h':>5} {'a':>3} {'V':>6} {'s':>5} {'dtype':<5} {'parameters':>15}")
    for name, m in PRESETS.items():
        print(f"{name:<{w}} {m.L:>3} {m.h:>5} {m.a:>3} {m.V:>6} {m.s:>5} {m.dtype:<5} {param_count(m):>15,}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="commgate",
        description="Regression harness for the communication behaviour of distributed transformer training.",
    )
    parser.add_argument("--version", action="version", version=f"commgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_predict(sub)
    r = sub.add_parser(
        "run",
        help="run scenarios on local ranks (CPU gloo), capture every call, reconcile with the model",
        description="Run each scenario on world_size local processes, capture every collective and point-to-point "
        "call, and reconcile the capture with the per-collective model. Exit status 1 if any scenario failed.",
    )
    r.add_argument(
        "paths",
        nargs="*",
        type=env.path_text,
        help="scenario files or directories (default: the pytest configuration's commgate_scenario_dirs, else "
        f"./{DEFAULT_SUITE})",
    )
    r.add_argument(
        "--report-dir",
        type=env.path,
        help="write report.json there (rewritten after every scenario), then index.html, plots/ and trace.json",
    )
    r.add_argument("--deadline", type=float, help="seconds per scenario (default: each scenario's deadline_s)")
    r.add_argument(
        "--link",
        metavar="RATE[,DELAY]",
        help="run each scenario's ranks in two network namespaces, half on each side of a veth link shaped "
        "with tc (Linux, root): e.g. 10gbit, 1gbit, 25gbit,20us (a delay needs tc's netem); the interconnect "
        "study of Qi et al. (benchmarks/interconnect.py)",
    )
    r.add_argument(
        "--emulate",
        action="store_true",
        help="run rank 0 alone at each scenario's declared world size, every other rank emulated (the real "
        "framework code at production scale; reconciled from rank 0's view; no latencies)",
    )
    r.add_argument(
        "--baseline-dir",
        type=env.path,
        help="baselines ({backend}/{id}.json) and bandwidth curves (bandwidth-{backend}.json); default: "
        f"{BASELINES_DEFAULT}",
    )
    r.add_argument(
        "--gate",
        action="store_true",
        help="also judge each run as `pytest scenarios` does: paper, baseline (a missing one is written and "
        "fails), latency and cold-start drift; for torchrun/Slurm where pytest does not run the ranks",
    )
    r.add_argument(
        "--update-baselines",
        action="store_true",
        help="with --gate: rewrite the baselines whose communication changed and report what changed",
    )
    r.add_argument(
        "--refresh-latency",
        action="store_true",
        help="with --update-baselines: rewrite unchanged baselines too, adding this run to the latency history",
    )
    r.add_argument("-k", "--select", action="append", help="run only scenarios whose id contains this (repeatable)")
    c = sub.add_parser(
        "compare",
        help="what changed in communication between two runs (reports or baseline directories)",
        description="Compare two runs, e.g. before and after an upgrade: per scenario and collective, calls, bytes "
        "per step and message sizes exactly; latency per op on runs, not calls (each side needs --min-runs runs: "
        "a directory of run reports, e.g. ci/pre-upgrade.sh's before/ and after/). Exit status 1 on a change in "
        "volume, a scenario on one side only, or a slowdown seen in every run.",
    )
    side = "report.json or the --report-dir holding it, a directory of runs (*/report.json) or a baseline directory"
    c.add_argument("before", type=env.path, help=side)
    c.add_argument("after", type=env.path, help=side)
    c.add_argument(
        "--latency-factor",
        type=float,
        default=LatencyRule().factor,
        help="the least ratio of an op's floor per step (its fastest tenth of calls) that counts; raised to how "
        f"far the before runs reach from their median (default {LatencyRule().factor:g})",
    )
    c.add_argument("--min-runs", type=int, default=3, help="runs each side needs before latency is judged (default 3)")
    _add_capture(sub)
    _add_init(sub)
    h = sub.add_parser(
        "html",
        help="render a report.json as index.html with plots and trace.json (what run --report-dir writes)",
    )
    h.add_argument(
        "report", type=env.path, help="a report.json written by `commgate run` or the pytest gate, or its directory"
    )
    h.add_argument("--out", type=env.path, help="directory for index.html, plots/ and trace.json (default: beside it)")
    k = sub.add_parser(
        "calibrate",
        help="fit the time model's u, host time per layer pass and lag for this hardware to a report's runs",
        description="The APNet model's u (the share of the measured GEMM rate a training step reaches) and the "
        "framework's host time per layer pass of each workload kind, fitted by least squares to the measured compute "
        "times of a report's runs (the step less the time the training thread was blocked), and each kind's lag "
        "(time in flight beyond the bandwidth curve per second of compute); stored with the hardware's bandwidth "
        "curve. Calibrate on runs the model is not judged on (benchmarks/calibration); runs with more local ranks "
        "than cores are left out.",
    )
    k.add_argument(
        "report", type=env.path, help="a report.json from `commgate run` with a bandwidth curve, or its directory"
    )
    k.add_argument(
        "--baseline-dir", type=env.path, help=f"where bandwidth-{{backend}}.json is; default: {BASELINES_DEFAULT}"
    )
    v = sub.add_parser("validate", help="check scenario files; one line per problem")
    v.add_argument(
        "paths",
        nargs="*",
        type=env.path_text,
        help="scenario files or directories (default: the pytest configuration's commgate_scenario_dirs, else "
        f"./{DEFAULT_SUITE})",
    )
    sub.add_parser("presets", help="list the model presets")
    i = sub.add_parser(
        "import",
        help="write a scenario from a GPT-NeoX config, a DeepSpeed JSON and/or a Hugging Face config.json, or a "
        "torchtitan job",
        description="Write a scenario from existing configs; every key ignored or left out is listed on stderr. "
        "The result validates and predicts.",
    )
    i.add_argument("--neox", type=env.path, help="a GPT-NeoX YAML config (model, parallelism, ZeRO, precision)")
    i.add_argument("--deepspeed", type=env.path, help="a DeepSpeed JSON config (becomes the deepspeed: block)")
    i.add_argument("--hf", type=env.path, help=f"a Hugging Face config.json (model_type {', '.join(HF_TYPES)})")
    i.add_argument(
        "--torchtitan",
        metavar="TOML|MODULE:CONFIG",
        help="a torchtitan job: a TOML of torchtitan <= 0.2.2 (train_configs/llama3_8b.toml), or a 0.3.0 config "
        "function (llama3:llama3_8b, read by torchtitan's ConfigManager: needs commgate[torchtitan])",
    )
    i.add_argument("--dp", type=int, help="data-parallel degree (default: the config's, else 1)")
    i.add_argument("--tp", type=int, help="tensor-parallel degree (default: the config's, else 1)")
    i.add_argument("--pp", type=int, help="pipeline stages (default: the config's, else 1)")
    i.add_argument("--cpu", action="store_true", help="the reduced-scale variant for CPU runs")
    i.add_argument("--name", type=env.nonempty, help="scenario name (default: the written file's, OUT without .yaml)")
    i.add_argument(
        "--trainer",
        choices=("commgate", "hf"),
        default="commgate",
        help="commgate (default): a scenario of commgate's own workloads; hf: a Hugging Face Trainer job "
        '(--hf and optionally --deepspeed, "auto" resolved as Trainer resolves it and written out)',
    )
    i.add_argument("-o", "--out", type=env.path, required=True, help="the scenario file to write (a new one)")
    i.add_argument("--force", action="store_true", help="overwrite OUT if it exists (never one of the inputs)")
    return parser


def _add_init(sub: argparse._SubParsersAction[_Parser]) -> None:
    from commgate.model.starter import DEFAULT_SCHEMES

    n = sub.add_parser(
        "init",
        help="start a scenario folder in your repository: a scenario per scheme for your model, the pytest "
        "configuration, ci.sh",
        description="Write DIR/ (default comm/) in the current directory: one scenario per scheme for your model "
        "(each validated and predicted first), pytest.ini naming the folder when the repository has no pytest "
        "configuration (else the line to add), and DIR/ci.sh, what CI runs. Never overwrites a file.",
    )
    what = n.add_mutually_exclusive_group(required=True)
    what.add_argument("--module", metavar="PKG.MOD:BUILD", help="your model's build function (docs/scenarios.md)")
    what.add_argument("--preset", help="a model preset (commgate presets)")
    what.add_argument("--hf", type=env.path, metavar="CONFIG.json", help="a Hugging Face config.json, at reduced scale")
    n.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help="comma-separated (default: %(default)s)")
    n.add_argument("--dp", type=int, default=2, help="data-parallel CPU ranks (default 2)")
    n.add_argument("--dir", default="comm", help="the scenario folder (default comm)")
    n.add_argument(
        "--s",
        type=int,
        metavar="TOKENS",
        help="the sequence length (model.s; your build(scenario) reads scenario.model.s): default 64 for "
        "--module, the preset's or the reduced config's otherwise",
    )


def cmd_init(a: argparse.Namespace) -> int:
    from commgate.core.fsutil import atomic_write_text
    from commgate.model.starter import DEFAULT_SCHEMES, start
    from commgate.run.launcher import local_rank_limit

    if a.dp < 1:
        raise UsageError(f"--dp {a.dp}: give 1 or more data-parallel ranks (default 2)")
    if a.dp > (limit := local_rank_limit()):
        raise UsageError(
            f"--dp {a.dp}: the scenarios run on this machine's CPU ranks, at most {limit} here; give --dp {limit} or "
            "fewer (production world sizes run emulated: emulate: true, README)"
        )
    if a.s is not None and a.s < 1:
        raise UsageError(f"--s {a.s}: give a sequence length of 1 or more tokens")
    if "/" in a.dir or a.dir in ("", ".", ".."):
        raise UsageError(
            f"--dir {a.dir!r}: give a folder name inside the repository you run init from (default comm), not a "
            "path; run init from the repository's root"
        )
    schemes = tuple(s.strip() for s in a.schemes.split(",") if s.strip())
    if not schemes:
        raise UsageError(f"--schemes {a.schemes!r}: name one scheme or more, comma-separated (default: "
                         f"{','.join(DEFAULT_SCHEMES)})")  # fmt: skip
    got = start(
        repo=Path.cwd(), folder=a.dir, module=a.module, preset=a.preset, hf=a.hf, schemes=schemes, dp=a.dp, s=a.s
    )
    for path, text in got.files.items():
        atomic_write_text(path, text)
        print(f"wrote {path.relative_to(Path.cwd())}")
    for note in got.notes:
        print(f"note: {note}")
    python = env.python_command()
    print(
        f"next: {python} -m pytest {a.dir}/ --commgate-update-baselines   (stores baselines/: commit them), then "
        f"{python} -m pytest {a.dir}/ (the gate) and {'' if python == 'python' else f'PYTHON={python} '}sh "
        f"{a.dir}/ci.sh (what CI runs)"
    )
    return 0


def _add_capture(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "capture",
        help="run a job unchanged (torchrun, srun, ...) and capture every collective of every rank it starts",
        description="Run COMMAND (e.g. torchrun --nproc-per-node 2 train.py ...) with every rank's process group "
        "interposed: each rank writes its calls and step windows to DIR when it ends, however it ends. The job's "
        "output and exit status pass through. Without this command, COMMGATE_CAPTURE=DIR and PYTHONPATH=<the "
        "directory of commgate.run.external.BOOTSTRAP> in the ranks' environment do the same.",
    )
    p.add_argument("-o", "--out", type=env.path, required=True, help="a new directory for the capture")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the job's command line")
    c = sub.add_parser(
        "check",
        help="judge a captured job (commgate capture) as a run is judged: model, baseline, drift",
        description="Judge the capture in DIR against the scenario that describes the job: every byte against "
        "the model (exact, named terms), the stored baseline, the drift rules; the same report and HTML as a run. "
        "Exit status 1 if the check failed.",
    )
    c.add_argument("capture", type=env.path, nargs="?", metavar="DIR", help="the directory commgate capture -o wrote")
    c.add_argument(
        "--flight-recorder",
        type=env.path,
        metavar="DUMPS",
        help="PyTorch Flight Recorder dumps (a directory of <prefix><rank> files, pickle or .json, or one of them): "
        "alone, what they hold and where the ranks part; with DIR, each dumped call matched to the capture and "
        "judged in its steps",
    )
    c.add_argument(
        "--scenario",
        type=env.path,
        help="the scenario describing the job (its steps: the captured ones); without it, the baseline and drift "
        "rules alone judge the capture (the model is not checked)",
    )
    c.add_argument(
        "--name",
        type=env.nonempty,
        help="without --scenario: the name the capture's baseline is kept under (default: the job's script, "
        "e.g. train for torchrun ... train.py)",
    )
    c.add_argument("--baseline-dir", type=env.path, help=f"default: {BASELINES_DEFAULT}")
    c.add_argument("--update-baselines", action="store_true", help="rewrite a baseline whose communication changed")
    c.add_argument(
        "--refresh-latency",
        action="store_true",
        help="with --update-baselines: rewrite an unchanged baseline too, adding this capture to the latency history",
    )
    c.add_argument("--report-dir", type=env.path, help="write report.json, index.html, plots/ and trace.json there")


def cmd_compare(a: argparse.Namespace) -> int:
    from commgate.judge.compare import compare, load_side, verdict

    if not 1 < a.latency_factor <= 1e6:  # each named alone: it named both, whichever was wrong
        raise UsageError(f"--latency-factor {a.latency_factor:g}: give a factor above 1 and at most 1e6")
    if not 1 <= a.min_runs <= 100:
        raise UsageError(f"--min-runs {a.min_runs}: give 1 to 100 runs")
    changes = compare(
        load_side(a.before), load_side(a.after), LatencyRule(factor=a.latency_factor, min_runs=a.min_runs)
    )
    for change in changes:
        print("\n".join(change.lines()))
    line, status = verdict(changes)
    print(line)
    return status


def cmd_import(a: argparse.Namespace) -> int:
    import yaml

    from commgate.core.fsutil import atomic_write_text
    from commgate.model.importer import build, hf_trainer, scenario_name
    from commgate.model.loader import load_document
    from commgate.model.predict import predict

    _check_import_out(a)
    if a.name is None:  # the written file's name: imports of one config into several files do not collide
        a.name = scenario_name(a.out)
    got: Imported
    if a.torchtitan and a.trainer == "hf":  # it wrote a torchtitan scenario in silence (an adversarial pass)
        raise UsageError("--torchtitan imports a torchtitan job (trainer torchtitan); leave out --trainer hf")
    if a.torchtitan:
        got = _torchtitan_import(a)
    elif a.trainer == "hf":
        if extra := [f"--{k}" for k in ("neox", "tp", "pp", "cpu") if getattr(a, k)]:
            raise UsageError(f"--trainer hf takes --hf (a config.json), --deepspeed and --dp; not {', '.join(extra)}")
        if not a.hf:  # it named the flags not taken, none given, and not the one missing (an adversarial pass)
            raise UsageError("--trainer hf: give --hf CONFIG.json, the model's Hugging Face config")
        if a.dp is None:
            raise UsageError("--trainer hf: give --dp N, the number of ranks the job runs on (2 or more)")
        got = hf_trainer(hf=a.hf, deepspeed=a.deepspeed, dp=a.dp, out=a.out, name=a.name)
    else:
        dp = a.dp if a.dp is not None else 1
        got = build(neox=a.neox, deepspeed=a.deepspeed, hf=a.hf, dp=dp, tp=a.tp, pp=a.pp, cpu=a.cpu, name=a.name)
    for note in got.notes + got.comments:
        print(f"note: {note}", file=sys.stderr)
    if got.notes:  # written into the scenario, shown with its warnings: never on stderr alone
        got.doc["notes"] = list(got.notes)
    try:
        scenarios = load_document(got.doc, file=str(a.out))  # the result validates ...
    except ScenarioError as exc:  # nothing written: say what in the configs it comes from
        origins = {"$.parallelism.dp": "--dp"} | dict(got.origins)  # the flag, where no config set it
        what = "; ".join(
            f"{f'{origins[p.path]} ({p.path})' if p.path in origins else p.path}: {p.message}" for p in exc.problems
        )
        raise UsageError(f"{a.out} not written: the imported scenario is refused: {what}") from None
    for s in scenarios:
        predict(s)  # ... and predicts
    for w in scenarios[0].warnings:  # what validate would warn of, said as it is written (the notes are above)
        print(f"warning: {w}", file=sys.stderr)
    if a.cpu and (need := _cpu_deadline(scenarios[0])):
        deadline, estimate = need
        line = (
            f"deadline_s {deadline}: --cpu keeps every layer, and its steps' compute (at least {estimate:,.0f} s "
            f"on this machine's {os.cpu_count()} cores) x{CPU_MARGIN} passes the default 300 s"
        )
        got.doc["deadline_s"] = deadline
        print(f"note: {line}", file=sys.stderr)
        got.comments.append(line)
    text = "# written by commgate import; what the configs set that it does not take as such: its notes\n"
    text += "".join(f"# {line}\n" for line in got.comments)
    atomic_write_text(a.out, text + yaml.safe_dump(got.doc, sort_keys=False))
    print(f"wrote {a.out}: {scenarios[0].id} ({scenarios[0].parallelism.scheme}, world {scenarios[0].world_size})")
    return 0


def _check_import_out(a: argparse.Namespace) -> None:
    """OUT is never an input (a config would be replaced by the scenario), and an existing file is replaced
    only with ``--force``."""
    out = a.out.resolve()
    for flag in ("neox", "deepspeed", "hf", "torchtitan"):
        given = getattr(a, flag)
        if given is not None and Path(given).resolve() == out:
            raise UsageError(
                f"-o {a.out} is the --{flag} input: it would be replaced by the scenario; give another file"
            )
    if a.out.is_dir():
        raise UsageError(f"-o {a.out}: a directory; give the scenario file to write (e.g. {a.out / 'job.yaml'})")
    if a.out.suffix not in (".yaml", ".yml"):  # the gate reads *.yaml and *.yml only (found by an adversarial pass)
        raise UsageError(
            f"-o {a.out}: not a .yaml or .yml file, which commgate and pytest never read as a scenario; give "
            f"{a.out.with_suffix('.yaml') if a.out.suffix else a.out.with_name(a.out.name + '.yaml')}"
        )
    if a.out.exists() and not a.force:
        raise UsageError(f"-o {a.out} exists: give --force to replace it, or another file")


CPU_MARGIN = 40
"""``import --cpu``: the written deadline over the compute estimate (``budget.compute_s``, a lower bound at
50 GFLOP/s a core). Measured on 2 cores, torchtitan's llama3_70b.toml imported with --cpu --dp 1 --tp 2 (80
layers, full checkpointing, eager flex attention): more than 240 s a step at b 8, 11x the estimate's 21 s;
at b 1, 58 s a step, 21x the estimate's 2.7 s (246 s for its 4 steps, against the default deadline of 300)."""


def _cpu_deadline(s: Scenario) -> tuple[int, float] | None:
    """The ``deadline_s`` an imported ``--cpu`` scenario needs (whole minutes), with its compute estimate,
    where the default 300 s is short of ``CPU_MARGIN`` times the estimate; None where it is not."""
    from commgate.run.budget import compute_s

    need = compute_s(s)
    if need is None or need * CPU_MARGIN <= s.deadline_s:
        return None
    return 60 * math.ceil(need * CPU_MARGIN / 60), need


def _torchtitan_import(a: argparse.Namespace) -> Imported:
    """``--torchtitan``: a TOML read here, or a 0.3.0 config function read by torchtitan itself."""
    from commgate.model.importer import torchtitan, torchtitan_toml
    from commgate.model.trainers import TRAINERS

    if a.neox or a.deepspeed or a.hf:
        raise UsageError("--torchtitan imports a torchtitan job alone (no --neox, --deepspeed or --hf)")
    source = str(a.torchtitan)
    if source.endswith(".toml") or Path(source).is_file():
        job = torchtitan_toml(Path(source))
    elif ":" in source:
        if why := TRAINERS["torchtitan"].unavailable():
            raise UsageError(f"--torchtitan {source}: reading a config function needs torchtitan itself: {why}")
        from commgate.run.trainers.torchtitan import read_config

        module, _, config = source.partition(":")
        try:
            job = read_config(module, config)
        except CommgateError as exc:  # a config torchtitan cannot build, or one the model does not hold
            raise UsageError(f"--torchtitan {source}: {exc}") from None
    else:
        raise UsageError(f"--torchtitan {source}: expected a .toml file or MODULE:CONFIG (llama3:llama3_8b)")
    return torchtitan(job, dp=a.dp, tp=a.tp, pp=a.pp, cpu=a.cpu, name=a.name)


COMMANDS = {
    "predict": cmd_predict,
    "run": cmd_run,
    "compare": cmd_compare,
    "html": cmd_html,
    "calibrate": cmd_calibrate,
    "validate": cmd_validate,
    "presets": cmd_presets,
    "import": cmd_import,
    "capture": cmd_capture,
    "check": cmd_check,
    "init": cmd_init,
}


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status. Its output may go away while it runs (``commgate run | head -1``, a full
    disk): the command goes on to its end, its report and its true status (``commgate.core.stdout``)."""
    from commgate.core.stdout import Stdout, exit_status, plug_closed

    if stand_in := plug_closed():
        sys.stderr = stand_in
    before = sys.stdout
    out = sys.stdout = Stdout(before)
    try:
        try:
            status = _command(argv)
        except SystemExit as exc:  # argparse's --help, --version and usage errors
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
            status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
        return exit_status(out, status)
    finally:
        sys.stdout = before
        if stand_in:
            sys.stderr = None
            stand_in.close()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line read, with the defaults that depend on where it runs: ``--baseline-dir`` is the gate's,
    ``<rootdir>/baselines`` (``_rootdir``), so that from a subfolder both keep one set of baselines."""
    args = build_parser().parse_args(argv)
    if "baseline_dir" in args and args.baseline_dir is None:
        args.baseline_dir = _rootdir(_pytest_config()) / "baselines"
    return args


def _command(argv: Sequence[str] | None) -> int:
    try:
        os.getcwd()
    except FileNotFoundError:
        print("commgate: error: the working directory no longer exists; cd into one that does", file=sys.stderr)
        return 2
    try:
        args = parse(argv)
        env.check()
        return COMMANDS[args.command](args)
    except CommgateError as exc:
        print(f"commgate: error: {exc}" if isinstance(exc, UsageError) else str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commgate: interrupted", file=sys.stderr)
        for n in STOPS:  # the clean-up is done: the exit's own (Python's shutdown restores the default handler,
            if signal.getsignal(n) is _stopping:  # and a later Ctrl-C ended the command by the signal) is not cut
                signal.signal(n, signal.SIG_IGN)
        return 130
