"""PyTorch Flight Recorder dumps read into commgate's capture records.

A dump is one file per rank, named ``<prefix><rank>`` as torch writes them (``TORCH_FR_DUMP_TEMP_FILE`` is
the prefix; ``_dump_fr_trace()`` gives the pickle form, ``_dump_fr_trace_json()`` the JSON form, which this
reads from ``<prefix><rank>.json``). Each entry becomes a ``CapturedCall``: op (from ``profiling_name``),
process group and its ranks, dtype, message size (the larger of the call's input and output, commgate's
convention; an all-to-all's own input, whose size each rank's splits set), issue order. What a dump cannot
tell is said in ``notes``, never guessed:

* steps: a dump holds no step boundaries; every call is placed in step 0, in issue order;
* durations: ``duration_ms``, which the recorder writes only where the job timed its calls
  (``TORCH_NCCL_ENABLE_TIMING=1``: CUDA events around the call on NCCL's stream) and only once the call is
  retired; else None. ``time_discovered_started_ns``/``..._completed_ns`` are when NCCL's watchdog noticed the
  call start and end (both within a microsecond of each other on a real NCCL dump), not a duration;
* groups: an entry names its group ``(name, description)``; ``pg_config``, keyed by name, lists the group's
  ranks on NCCL; gloo's dump leaves it empty (torch 2.13), so the default group is every rank dumped and
  another group the ranks whose dumps hold calls on it (said);
* point-to-point: gloo records no send/recv in the Flight Recorder (torch 2.13): none appear (said).

Read with a restricted unpickler (``_Dump``): a dump is torch's own pickle of plain containers, strings and
numbers, and a file that names any other Python object is refused unread, never run. Commgate stores none.
"""

from __future__ import annotations

import functools
import io
import json
import math
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from commgate.core.errors import DocumentError, Problem
from commgate.model.collectives import Op
from commgate.run.capture import Capture, CapturedCall

VERSIONS = tuple(f"2.{n}" for n in range(0, 11))
"""The dump versions read (``version`` of the dump): torch 2.4 writes 2.1, 2.6 2.4, 2.8 2.9, 2.10 to 2.13
2.10 (``tests/data/flight_recorder``: real dumps of 2.4, 2.6, 2.8 and 2.12; 2.13 made fresh by the tests)."""
GLOO_FROM = "2.9"
"""The first dump version whose Flight Recorder records gloo's calls (torch 2.8: ``FlightRecorder.hpp`` left
``USE_C10D_NCCL``); before it only NCCL's, so a gloo job's dump holds nothing."""
NEEDED = ("profiling_name", "process_group", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "state")

OPS = {
    **dict.fromkeys(("all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced"), Op.ALL_REDUCE),
    **dict.fromkeys(
        ("all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "all_gather_into_tensor_coalesced"),
        Op.ALL_GATHER,
    ),
    **dict.fromkeys(
        ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        Op.REDUCE_SCATTER,
    ),
    **dict.fromkeys(("all_to_all", "alltoall", "alltoall_base", "all_to_all_single"), Op.ALL_TO_ALL),
    **{op.value: op for op in (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER, Op.BARRIER, Op.SEND, Op.RECV)},
}
"""``profiling_name`` (after ``gloo:``/``nccl:``, before a space) -> op."""

DTYPES = {
    "Float": ("fp32", 4),
    "Double": ("fp64", 8),
    "Half": ("fp16", 2),
    "BFloat16": ("bf16", 2),
    "Long": ("int64", 8),
    "Int": ("int32", 4),
    "Short": ("int16", 2),
    "Char": ("int8", 1),
    "Byte": ("uint8", 1),
    "Bool": ("bool", 1),
}
"""c10's ScalarType names, as dumps spell them -> (commgate's dtype name, bytes per element)."""

DUMP_NAME = re.compile(r"(.*?)(\d+)(\.json)?")


def _bad(file: Path, message: str, where: str = "$") -> DocumentError:
    return DocumentError([Problem(file=str(file), path=where, message=message)])


@dataclass(frozen=True, slots=True, kw_only=True)
class Dumps:
    """Every rank's dump, as capture records."""

    source: Path
    calls: tuple[CapturedCall, ...]
    """Every rank's calls, each in issue order (``seq``), all in step 0."""
    ranks: tuple[int, ...]
    version: str
    notes: tuple[str, ...]
    """What the dumps cannot tell, and how each gap was filled (or not)."""
    states: dict[int, dict[str, int]]
    """Per rank, how many entries were in each state (scheduled, started, completed)."""
    gloo: bool = False
    """The job ran gloo (its entries' ``profiling_name`` say ``gloo:``): gloo records its reduce_scatter as the
    all_reduce it runs (``ProcessGroupGloo``), which ``align`` knows."""


def dump_files(path: Path) -> dict[int, Path]:
    """The per-rank dump files: ``path`` a directory of ``<prefix><rank>[.json]``, or one rank's file (its
    siblings of the same prefix are the other ranks). One form is read: JSON where every rank has it."""
    if path.is_dir():
        found = [p for p in sorted(path.iterdir()) if p.is_file()]
    elif path.is_file():
        found = [p for p in sorted(path.parent.iterdir()) if p.is_file()]
        m = DUMP_NAME.fullmatch(path.name)
        prefix = m.group(1) if m else path.name
        found = [p for p in found if (n := DUMP_NAME.fullmatch(p.name)) and n.group(1) == prefix]
    else:
        raise _bad(path, "no such file or directory; give the Flight Recorder dumps (TORCH_FR_DUMP_TEMP_FILE's files)")
    by_form: dict[bool, dict[str, dict[int, Path]]] = {True: {}, False: {}}
    for p in found:
        if m := DUMP_NAME.fullmatch(p.name):
            by_form[m.group(3) is not None].setdefault(m.group(1), {})[int(m.group(2))] = p
    every = {r for prefixes in by_form.values() for ranks in prefixes.values() for r in ranks}
    for form in (False, True):  # the pickle form first: it is what the watchdog writes
        prefixes = by_form[form]
        if len(prefixes) > 1:
            raise _bad(path, f"dumps of {len(prefixes)} prefixes ({', '.join(sorted(prefixes))}): one job's a time")
        if prefixes and (ranks := next(iter(prefixes.values()))).keys() == every:
            return ranks
    if any(by_form.values()):  # each form lacks a rank the other has: neither is the job's whole
        have = {("JSON" if form else "pickle"): sorted(next(iter(by_form[form].values()))) for form in (False, True)
                if by_form[form]}  # fmt: skip
        said = "; ".join(f"ranks {ranks} as {form}" for form, ranks in have.items())
        raise _bad(path, f"dumps of some ranks in one form and some in the other ({said}): give every rank's in one")
    raise _bad(path, "no Flight Recorder dump here (files named <prefix><rank>, as TORCH_FR_DUMP_TEMP_FILE names them)")


_JIT_PICKLE = {"build_intlist", "build_doublelist", "build_boollist", "build_tensorlist", "restore_type_tag"}
"""What torch's C++ pickler may name in a dump of containers (``torch/jit/_pickle.py``): each hands back
its first argument."""


def _first(value: object, *_: object) -> object:
    return value


class _Dump(pickle.Unpickler):
    """An unpickler of plain data: ``find_class`` grants only torch's container builders (as the identity);
    any other class or function in the file is refused, so a dump from elsewhere cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.jit._pickle" and name in _JIT_PICKLE:
            return _first
        raise _Foreign(f"{module}.{name}")


class _Foreign(pickle.UnpicklingError):
    """A pickle naming a Python object a Flight Recorder dump never holds."""


def _load(file: Path) -> dict[str, Any]:
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise _bad(file, f"cannot be read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw) if file.suffix == ".json" else _Dump(io.BytesIO(raw)).load()
    except _Foreign as exc:
        message = f"not a Flight Recorder dump: the pickle names {exc}, which a dump never holds (refused, not run)"
        raise _bad(file, message) from None
    except Exception as exc:  # a truncated pickle raises whatever it stopped in (EOFError, UnpicklingError, ...)
        form = "JSON" if file.suffix == ".json" else "pickle"
        raise _bad(file, f"not a complete Flight Recorder dump ({form}: {exc}); truncated?") from None
    if not isinstance(doc, dict) or "version" not in doc or not isinstance(doc.get("entries", []), list):
        raise _bad(file, "not a Flight Recorder dump (no version and entries)")
    doc.setdefault("entries", [])  # the JSON form leaves out an empty buffer's entries
    if str(doc["version"]) not in VERSIONS:
        raise _bad(
            file, f"dump version {doc['version']!r} is not one commgate reads ({', '.join(VERSIONS)})", "$.version"
        )
    for i, e in enumerate(doc["entries"]):
        if not isinstance(e, dict) or (missing := [k for k in NEEDED if k not in e]):
            raise _bad(
                file, f"entry without {', '.join(missing) if isinstance(e, dict) else 'fields'}", f"$.entries[{i}]"
            )
    _check_types(file, doc)
    return doc


_SHAPES = {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
_NAMES = {"type": "array", "items": {"type": "string"}}
DUMP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "pg_config": {
            "type": "object",
            "additionalProperties": {"type": "object", "properties": {"ranks": {"type": ["string", "array"]}}},
        },
        "entries": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "profiling_name": {"type": "string"},
                    "process_group": {
                        "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]
                    },
                    "input_sizes": _SHAPES,
                    "output_sizes": _SHAPES,
                    "input_dtypes": _NAMES,
                    "output_dtypes": _NAMES,
                    "state": {"type": "string"},
                    "duration_ms": {"type": ["number", "null"], "minimum": 0},
                    "time_created_ns": {"type": ["integer", "null"], "minimum": 0},
                },
            },
        },
    },
}
"""The types ``read`` relies on in a dump (torch writes more: let through). Tuples (the pickle form's
``process_group``) are read as arrays."""


@functools.cache
def _validator() -> Any:
    from commgate.core import schemas

    return schemas.strict()(DUMP_SCHEMA)


def _check_types(file: Path, doc: dict[str, Any]) -> None:
    """``doc`` held to ``DUMP_SCHEMA``, and each group's ``ranks`` (JSON text in a dump) a list of ranks: else
    one line naming the file, the place and the value."""
    import jsonschema

    from commgate.core.fsutil import json_path

    def plain(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return [plain(i) for i in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    try:
        _validator().validate(plain({k: doc[k] for k in ("pg_config", "entries") if k in doc}))
    except jsonschema.ValidationError as exc:
        message = exc.message if len(exc.message) <= 200 else exc.message[:200] + "..."
        raise _bad(file, f"{message} (not as torch writes a dump)", json_path(exc.absolute_path)) from None
    except (RecursionError, ValueError) as exc:  # nested thousands deep; an integer of 100,000 digits
        raise _bad(file, f"not as torch writes a dump ({type(exc).__name__}: values beyond any dump's)") from None
    for i, e in enumerate(doc["entries"]):
        if (ms := e.get("duration_ms")) is not None and not math.isfinite(ms):
            raise _bad(file, f"duration_ms {ms}: not a duration (not as torch writes a dump)", f"$.entries[{i}]")
    for name, cfg in (doc.get("pg_config") or {}).items():
        ranks = cfg.get("ranks", [])
        try:
            listed = json.loads(ranks) if isinstance(ranks, str) else ranks
            ok = isinstance(listed, list) and all(isinstance(r, int) and r >= 0 for r in listed)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise _bad(
                file, f"ranks {ranks!r}: not a list of ranks (not as torch writes a dump)", f"$.pg_config.{name}.ranks"
            )
        cfg["ranks"] = listed  # read once: ``_groups`` takes the list


def read(path: Path) -> Dumps:
    """Every rank's dump under ``path``, as capture records; a one-line ``DocumentError`` for a bad one."""
    files = dump_files(path)
    if missing := sorted(set(range(max(files) + 1)) - files.keys()):
        raise _bad(path, f"ranks {missing} have no dump (found {sorted(files)}); a dump holds one rank's calls")
    docs = {r: _load(f) for r, f in sorted(files.items())}
    versions = {str(d["version"]) for d in docs.values()}
    if len(versions) > 1:
        raise _bad(path, f"dumps of versions {sorted(versions)}: not one job's")
    notes: list[str] = ["steps: a dump holds no step boundaries; its calls are in issue order, in one window"]
    groups = _groups(docs, files, notes)
    calls: list[CapturedCall] = []
    timed = 0
    for r, doc in docs.items():
        for seq, e in enumerate(doc["entries"]):
            call = _call(files[r], r, seq, e, groups, notes)
            if call is not None:
                calls.append(call)
                timed += call.duration_ns is not None
    if timed < len(calls):
        why = "not retired when dumped" if timed else "the job did not time its calls: TORCH_NCCL_ENABLE_TIMING=1"
        notes.append(f"durations: {len(calls) - timed} of {len(calls)} calls untimed ({why})")
    version = versions.pop()
    gloo = any(str(e["profiling_name"]).startswith("gloo:") for d in docs.values() for e in d["entries"])
    if gloo:
        notes.append("point-to-point: gloo records no send/recv in the Flight Recorder; none are here")
        notes.append("reduce_scatter: gloo runs, and records, its reduce_scatter as an all_reduce of the input")
    if not calls:
        older = [int(x) for x in version.split(".")] < [int(x) for x in GLOO_FROM.split(".")]
        notes.append(
            f"calls: the dumps hold none; before dump version {GLOO_FROM} (torch 2.8) the Flight Recorder records "
            "NCCL's calls only, never gloo's"
            if older
            else "calls: the dumps hold none (was TORCH_FR_BUFFER_SIZE set in the job?)"
        )
    states = {r: _count(str(e["state"]) for e in d["entries"]) for r, d in docs.items()}
    return Dumps(
        source=path,
        calls=tuple(calls),
        ranks=tuple(docs),
        version=version,
        notes=tuple(dict.fromkeys(notes)),
        states=states,
        gloo=gloo,
    )


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _pg(e: dict[str, Any]) -> tuple[str, str]:
    """The entry's group's (name, description): ``process_group`` is ``(name, description)``, or a name alone;
    the name keys ``pg_config``."""
    pg = e["process_group"]
    if isinstance(pg, (list, tuple)):
        return str(pg[0]), str(pg[1] if len(pg) > 1 else pg[0])
    return str(pg), str(pg)


def _groups(docs: dict[int, dict[str, Any]], files: dict[int, Path], notes: list[str]) -> dict[str, tuple[int, ...]]:
    """Each process group's ranks: from ``pg_config`` where it lists them; else the default group is every
    rank dumped and another group the ranks whose dumps hold calls on it (said in ``notes``)."""
    listed: dict[str, tuple[int, ...]] = {}
    lister: dict[str, int] = {}  # the rank whose dump listed the group first
    for r, d in docs.items():
        for name, cfg in (d.get("pg_config") or {}).items():
            ranks = cfg.get("ranks") if isinstance(cfg, dict) else None  # a list: ``_load`` read it
            if not (name and ranks):
                continue
            key, members = str(name), tuple(int(x) for x in ranks)
            if key in listed:  # each group's ranks checked once; two dumps must agree on them
                if members != listed[key]:
                    why = f"group {key!r} holds ranks {list(members)}, but {files[lister[key]]} lists "
                    why += f"{list(listed[key])}; the dumps are of two jobs: dump one job's ranks into one folder"
                    raise _bad(files[r], why, f"$.pg_config.{key}.ranks")
                continue
            listed[key], lister[key] = members, r
            if undumped := sorted(set(members) - docs.keys()):
                shown = ", ".join(map(str, undumped[:8])) + (", ..." if len(undumped) > 8 else "")
                why = f"group {key!r} holds ranks [{shown}], which have no dump (found {len(docs)}: ranks 0 to"
                raise _bad(files[r], f"{why} {len(docs) - 1}); dump every rank of the job", f"$.pg_config.{key}.ranks")
    seen: dict[str, set[int]] = {}
    desc: dict[str, str] = {}
    for r, d in docs.items():
        for e in d["entries"]:
            name, description = _pg(e)
            seen.setdefault(name, set()).add(r)
            desc[name] = description
    out: dict[str, tuple[int, ...]] = {}
    for name, ranks in seen.items():
        if name in listed:
            out[name] = listed[name]
        elif desc[name] == "default_pg":
            out[name] = tuple(sorted(docs))
            notes.append(
                "groups: the dump lists no group's ranks (gloo); the default group is taken as every rank dumped "
                "(a missing last rank cannot be seen)"
            )
        else:
            out[name] = tuple(sorted(ranks))
            notes.append(
                f"groups: group {name!r}'s ranks are not in the dump; taken as the ranks whose dumps hold its calls"
            )
    return out


def _size(file: Path, sizes: Any, dtypes: Any, where: str) -> tuple[int, str, int]:
    """(elements, commgate dtype, bytes) of one side of a call; a dtype the dump names that commgate does not
    know is a one-line error."""
    if len(dtypes) != len(sizes):  # zipped, the shapes past the shorter list were left out in silence
        why = f"{len(sizes)} shape(s) but {len(dtypes)} dtype(s): one a tensor (not as torch writes a dump)"
        raise _bad(file, why, where)
    elements = sum(math.prod(s) for s in sizes)
    if not dtypes:
        return elements, "none", 0
    for name in map(str, dtypes):  # every tensor's, not the first alone
        if name not in DTYPES:
            raise _bad(file, f"dtype {name!r} is not one commgate reads ({', '.join(DTYPES)})", where)
    nbytes = sum(math.prod(s) * DTYPES[str(d)][1] for s, d in zip(sizes, dtypes, strict=True))
    return elements, DTYPES[str(dtypes[0])][0], nbytes


def _call(
    file: Path, rank: int, seq: int, e: dict[str, Any], groups: dict[str, tuple[int, ...]], notes: list[str]
) -> CapturedCall | None:
    name = str(e["profiling_name"]).split(":", 1)[-1].split(" ", 1)[0]
    op = OPS.get(name)
    if op is None:
        notes.append(f"ops: {e['profiling_name']!r} is not an op commgate models; its calls are left out")
        return None
    where = f"$.entries[{seq}]"
    side_in = _size(file, e["input_sizes"], e["input_dtypes"], where)
    side_out = _size(file, e["output_sizes"], e["output_dtypes"], where)
    # the larger side, as the capture records a call; an all-to-all's own input (its ranks' splits differ)
    elements, dtype, nbytes = side_in if op == Op.ALL_TO_ALL and e["input_sizes"] else max(side_in, side_out)
    group = groups[_pg(e)[0]]
    if op in (Op.GATHER, Op.SCATTER) and not (e["input_sizes"] and e["output_sizes"]):
        # off the root, the rank's own shard: 1/n of the message, as the capture records it (``_make_collective``)
        elements, nbytes = elements * len(group), nbytes * len(group)
    duration_ms = e.get("duration_ms")
    created = int(e.get("time_created_ns") or 0)
    return CapturedCall(
        rank=rank,
        seq=seq,
        step=0,
        phase="forward",
        op=op,
        group=group,
        peer=None,
        dtype=dtype,
        elements=elements,
        bytes=nbytes,
        tensors=max(len(e["input_sizes"]), len(e["output_sizes"]), 1),
        start_ns=created,
        duration_ns=round(float(duration_ms) * 1e6) if duration_ms is not None else None,
    )


def _key(c: CapturedCall) -> tuple[Any, ...]:
    """What a dump and a capture both say of a call (not the tensor count: a dump gives one shape per side)."""
    return (str(c.op), c.group, c.dtype, c.elements, c.bytes)


def align(dumps: Dumps, capture: Capture) -> tuple[Capture, list[str]]:
    """The dump's calls placed in the capture's steps and phases, call for call (a dump's ring buffer holds
    the last calls: each rank's dump is matched to the end of that rank's captured calls of the ops a dump
    records), with the dump's durations; and where they part, one line a rank."""
    problems: list[str] = []
    placed: list[CapturedCall] = []
    held = {str(c.op) for c in dumps.calls}
    p2p = {Op.SEND, Op.RECV}
    for r in dumps.ranks:
        mine = [c for c in dumps.calls if c.rank == r]
        theirs = [c for c in capture.calls if c.rank == r and (c.op not in p2p or str(c.op) in held)]
        tail = theirs[len(theirs) - len(mine) :] if len(mine) <= len(theirs) else None
        if tail is None:
            problems.append(f"rank {r}: the dump holds {len(mine)} calls, the capture {len(theirs)}")
            continue
        for d, c in zip(mine, tail, strict=True):
            if dumps.gloo and d.op == Op.ALL_REDUCE and c.op == Op.REDUCE_SCATTER:
                d = replace(d, op=c.op)  # gloo's reduce_scatter, recorded as the all_reduce it runs
            if _key(d) != _key(c):
                problems.append(f"rank {r}, dump entry {d.seq}: {_describe(d)} in the dump, {_describe(c)} captured")
                break
            placed.append(replace(d, seq=c.seq, step=c.step, phase=c.phase, tensors=c.tensors, start_ns=c.start_ns))
    calls = tuple(sorted(placed, key=lambda c: (c.rank, c.seq)))
    return replace(capture, calls=calls), problems


def _describe(c: CapturedCall) -> str:
    return f"{c.op} {c.dtype} {c.bytes} B on group {list(c.group)}"
