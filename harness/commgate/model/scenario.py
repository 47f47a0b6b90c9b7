"""Scenario files: YAML -> JSON-Schema validation -> consistency checks -> sweep expansion -> records.

Every problem of a file is reported at once, one line each, naming the file, its line, the JSON path,
the offending value and what was expected (``commgate.core.errors.Problem``). Only ``yaml.SafeLoader`` is
used, so ``!!python/...`` tags are rejected.
"""

from __future__ import annotations

import copy
import difflib
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import jsonschema
import yaml

from commgate.core import schemas
from commgate.core.errors import CommgateError, Problem, ScenarioError
from commgate.core.fsutil import json_path
from commgate.model import dsconfig
from commgate.model.schemes import SCHEMES
from commgate.model.transformer import PRESETS, ModelSpec

Backend = Literal["gloo", "nccl", "auto"]
Bad = Callable[[list[str | int], str], None]
"""Reports one problem: the JSON path (as parts) and the message."""
MARKERS: tuple[str, ...] = ("gpu", "multinode", "slow", "nightly")
SCENARIO_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroConfig:
    stage: int = 0
    hpz: int = 1
    """ZeRO++ hierarchical partition size (secondary copy of the parameters within hpz ranks)."""
    qwz: bool = False
    """ZeRO++ quantized (int8) weight all-gather."""
    qgz: bool = False
    """ZeRO++ quantized (int4) gradient all-to-all."""
    bucket_elements: int = 500_000_000
    """DeepSpeed reduce_bucket_size / allgather_bucket_size (elements)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPConfig:
    """torch FSDP2 (``fully_shard``) options: one parameter group per transformer block, the root's
    parameters (embeddings, final norm, head) in one more."""

    reshard_after_forward: bool | int | None = None
    """For every group; None leaves torch's choice: the blocks reshard after the forward, the root not; an
    int k (dividing dp) reshards to groups of k ranks, so the backward gathers within them."""
    reshard_after_backward: bool = True
    """Between gradient-accumulation micro-batches (False: ``set_reshard_after_backward(False)`` keeps
    the parameters gathered until the last micro-batch)."""
    param_dtype: Literal["fp32", "bf16"] | None = None
    """``MixedPrecisionPolicy.param_dtype``: what is all-gathered; None: the model's dtype."""
    reduce_dtype: Literal["fp32", "bf16"] | None = None
    """``MixedPrecisionPolicy.reduce_dtype``: what is reduce-scattered; None: ``param_dtype``."""

    @property
    def reshard_group(self) -> int | None:
        """The int ``reshard_after_forward`` (the post-forward group size), None when it is a bool or unset."""
        k = self.reshard_after_forward
        return None if k is None or isinstance(k, bool) else k

    @property
    def reshards(self) -> bool | None:
        """Whether groups reshard after the forward, as torch reads the setting (an int k > 1 does, to groups
        of k; 1 does not); None when unset (torch's choice: the blocks do, the root does not)."""
        k = self.reshard_after_forward
        return k if k is None or isinstance(k, bool) else k > 1

    def compute_dtype(self, model_dtype: str) -> str:
        """The dtype the layers compute in (and the gathers move): ``param_dtype``, else the parameters'."""
        return self.param_dtype or model_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineConfig:
    """The pipeline engine: DeepSpeed's (its own 1F1B) or ``torch.distributed.pipelining`` with a schedule."""

    engine: Literal["deepspeed", "torch"] = "deepspeed"
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    virtual_stages: int = 1
    """Stages per rank (interleaved schedules: stage k on rank k mod pp)."""

    @property
    def looped(self) -> bool:
        """The schedule runs several stages per rank (torch's ``_PipelineScheduleRuntime``)."""
        return self.schedule in ("interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    experts: int
    ep: int = 1
    top_k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4
    every: int = 1
    """Every ``every``-th layer is an MoE layer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    scheme: str
    """A name in ``commgate.model.schemes.SCHEMES``."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism inside the tensor-parallel groups (DTensor ``SequenceParallel``)."""
    dp_replicate: int = 1
    """HSDP replicas (scheme fsdp): the model is sharded over ``dp`` ranks and replicated this many times."""
    cp: int = 1
    """Context-parallel degree (scheme cp, or fsdp): each sequence split over cp ranks, attention by torch's ring."""
    cp_rotate: Literal["allgather", "alltoall"] = "allgather"
    """How torch's ring attention passes K/V (``set_rotate_method``): one all-gather per attention, or
    cp-1 all-to-all rotations."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    moe: MoEConfig | None = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    micro_batch: int = 1
    """Micro-batch size b."""
    micro_batches: int = 1
    """Micro-batches per step m: pipeline micro-batches, or gradient-accumulation steps."""
    activation_checkpointing: bool = False
    ddp_bucket_mb: float | None = None
    """torch DDP ``bucket_cap_mb``; None keeps DDP's default (25 MiB, with a 1 MiB first bucket)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks of one gradient reduction (DDP) or parameter sharding (FSDP2): dp, times cp, since each
        context-parallel rank computes gradients from its own part of the sequences."""
        return self.dp * self.cp

    @property
    def axes(self) -> str:
        """How the world size is made, for messages: ``dp*tp*pp = 2*2*1``."""
        rep = (f"{self.dp_replicate}*", "dp_replicate*") if self.dp_replicate > 1 else ("", "")
        cp = (f"{self.cp}*", "cp*") if self.cp > 1 else ("", "")
        return f"{rep[1]}dp*{cp[1]}tp*pp = {rep[0]}{self.dp}*{cp[0]}{self.tp}*{self.pp}"

    @property
    def ep(self) -> int:
        return self.moe.ep if self.moe else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    rtol: float = 0.0
    atol: int = 0

    def allows(self, obtained: float | Fraction, expected: float | Fraction) -> bool:
        if not self.rtol and not self.atol:
            return obtained == expected  # exact (Fractions stay exact)
        return abs(float(obtained) - float(expected)) <= self.atol + self.rtol * abs(float(expected))


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyRule:
    """How latency is judged against stored runs (``commgate.judge.drift.shifts``)."""

    factor: float = 1.25
    """The least ratio of an op's time per step that counts (raised to the stored runs' own spread)."""
    min_runs: int = 3
    """Stored runs needed before latency is judged."""
    confirm: int = 2
    """Reruns a scenario whose latency looks shifted must show the same shift in too."""
    min_share: float = 0.05
    """Ops under this share of the step time (in the stored runs) are not judged: their time is
    scheduling noise on a shared machine."""
    action: Literal["warn", "fail"] = "warn"


@dataclass(frozen=True, slots=True, kw_only=True)
class ColdStartRule:
    factor: float = 10.0
    min_excess_ms: float = 100.0
    action: Literal["warn", "fail"] = "warn"


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectations:
    model_check: bool = True
    """False: baseline-only mode; the model and the paper are not asserted (the result says so)."""
    model_bytes: Tolerance = field(default_factory=Tolerance)
    model_calls: Tolerance = field(default_factory=Tolerance)
    paper_rtol: float = 0.01
    baseline_bytes: Tolerance = field(default_factory=Tolerance)
    baseline_calls: Tolerance = field(default_factory=Tolerance)
    latency: LatencyRule = field(default_factory=LatencyRule)
    cold_start: ColdStartRule = field(default_factory=ColdStartRule)
    time_max_error: float | None = None
    """``expectations.time.max_error``: the largest |predicted - measured| communication fraction that
    passes (``commgate.report.timemodel``); None: the time model is reported, not judged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One runnable scenario (a sweep expands into several of these)."""

    id: str
    """Unique, readable id: the name, plus ``[key=value,...]`` for a sweep variant."""
    name: str
    model: ModelSpec
    parallelism: Parallelism
    description: str = ""
    file: str | None = None
    backend: Backend = "auto"
    emulate: bool = False
    """Run rank 0 alone at the declared world size, the other ranks emulated (``commgate.run.emulate``)."""
    steps: int = 3
    warmup_steps: int = 1
    deadline_s: float = 300.0
    stall_s: float | None = None
    """The stall watchdog's limit (``commgate.run.launcher``); None: derived from the steps seen."""
    markers: tuple[str, ...] = ()
    workload: str | None = None
    expectations: Expectations = field(default_factory=Expectations)
    deepspeed: str = "{}"
    """The ``deepspeed:`` block as canonical JSON (merged over commgate's own DeepSpeed config)."""
    warnings: tuple[str, ...] = ()
    """What is suspicious but not wrong (e.g. a DeepSpeed key DeepSpeed does not know)."""

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.deepspeed)
        return loaded


# --------------------------------------------------------------------------------------------- schema


@functools.cache
def schema() -> dict[str, Any]:
    """The published scenario JSON Schema (draft 2020-12), with ``parallelism.scheme``'s enum filled in from
    the scheme registry (``commgate.model.schemes.SCHEMES``, the one list of schemes)."""
    doc = copy.deepcopy(schemas.load("scenario"))
    scheme = doc["properties"]["parallelism"]["properties"]["scheme"]
    scheme["enum"] = list(SCHEMES)
    return doc


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema())
    cls.check_schema(schema())
    return cls(schema())


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


class _Located:
    """Maps JSON paths of a YAML document to line numbers."""

    def __init__(self, node: yaml.Node | None) -> None:
        self.node = node

    def line(self, parts: Sequence[Any]) -> int | None:
        node = self.node
        if node is None:
            return None
        best = node.start_mark.line + 1
        for part in parts:
            nxt: yaml.Node | None = None
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == str(part):
                        nxt = v
                        best = k.start_mark.line + 1
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                nxt = node.value[part]
                best = nxt.start_mark.line + 1
            if nxt is None:
                break
            node = nxt
        return best


def _non_finite(doc: Any, path: list[Any]) -> Iterator[list[Any]]:
    """Paths of NaN and infinite numbers (YAML's ``.nan``, ``.inf``): a schema's bounds cannot catch them."""
    if isinstance(doc, float) and not math.isfinite(doc):
        yield path
    elif isinstance(doc, Mapping):
        for k, v in doc.items():
            yield from _non_finite(v, [*path, k])
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _non_finite(v, [*path, i])


def _schema_problems(doc: Any, file: str, where: _Located, context: str = "") -> list[Problem]:
    problems = [
        Problem(file=file, path=json_path(parts), message="not a finite number" + context, line=where.line(parts))
        for parts in _non_finite(doc, [])
    ]
    for err in _validator().iter_errors(doc):
        for parts, message in _describe(err):
            problems.append(
                Problem(file=file, path=json_path(parts), message=message + context, line=where.line(parts))
            )
    return problems


def _describe(err: jsonschema.ValidationError) -> Iterator[tuple[list[Any], str]]:
    """One or more (path, message) pairs for a jsonschema error, worded for people."""
    path = list(err.absolute_path)
    inst: Any = err.instance
    kind: Any = err.validator
    want: Any = err.validator_value
    sub: Any = err.schema
    if kind == "required":
        for name in want:
            if isinstance(inst, Mapping) and name not in inst:
                yield path, f"missing required field {name!r}"
    elif kind == "additionalProperties" and isinstance(inst, Mapping):
        allowed = sorted(sub.get("properties", {}))
        for key in sorted(set(inst) - set(allowed), key=str):
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            yield [*path, key], f"unknown field {key!r}; {hint}expected one of: {', '.join(allowed)}"
    elif kind == "type":
        yield (
            path,
            f"{_show(inst)} is {'an' if _type_name(inst)[0] in 'aeiou' else 'a'} {_type_name(inst)}, "
            f"expected {want if isinstance(want, str) else ' or '.join(want)}",
        )
    elif kind == "enum":
        yield path, f"{_show(inst)} is not one of: {', '.join(str(v) for v in want)}"
    elif kind == "const":
        yield path, f"{_show(inst)} is not supported, expected {_show(want)}"
    elif kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        relation = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        yield path, f"{_show(inst)} is out of range, expected a value {relation} {want}"
    elif kind == "pattern" and "propertyNames" not in err.schema_path:
        yield path, f"{_show(inst)} is malformed; {sub.get('description', 'expected pattern ' + want)}"
    elif kind in ("propertyNames", "pattern"):
        yield (
            path,
            (
                f"sweep key {_show(inst)} is not a field path; expected a dotted path under "
                "model, parallelism, steps, warmup_steps or backend (e.g. 'model.s')"
            ),
        )
    elif kind == "uniqueItems":
        yield path, f"{_show(inst)} has duplicate items"
    elif kind in ("minItems", "minProperties"):
        yield path, "must not be empty"
    else:  # pragma: no cover - wording for validators the schema does not use yet
        yield path, err.message


# ------------------------------------------------------------------------------------------- loading


def _parse_yaml(text: str, file: str) -> tuple[Any, _Located]:
    """Safe-load one YAML document, rejecting duplicate keys; raises ScenarioError on syntax errors."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _bounded(node, file)
            problems = list(_duplicate_keys(node, file, [])) if node is not None else []
            if problems:
                raise ScenarioError(problems)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        what = exc.problem or str(exc)
        if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in what:
            what = f"{what.split(' for the tag ')[-1].strip()} tag is not allowed; scenarios are plain YAML"
            kind = "unsupported YAML tag"
        else:
            kind = "YAML syntax error"
        raise ScenarioError([Problem(file=file, path="$", message=f"{kind}: {what}", line=line)]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError([Problem(file=file, path="$", message=f"YAML error: {exc}")]) from None
    except RecursionError:
        message = "YAML nested too deeply to read (thousands of levels); a scenario is a few levels deep"
        raise ScenarioError([Problem(file=file, path="$", message=message)]) from None
    return data, _Located(node)


MAX_NODES, MAX_DEPTH = 100_000, 64
"""Bounds on a scenario document, counted with YAML aliases expanded (an alias "bomb" of a few lines
expands to billions of nodes, which validation would walk)."""


def _bounded(root: yaml.Node, file: str) -> None:
    """Raise ScenarioError if the document, aliases expanded, has more than MAX_NODES nodes or is nested
    deeper than MAX_DEPTH (an iterative walk that stops at the bound)."""
    stack, seen = [(root, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        problem = (
            f"the document expands to more than {MAX_NODES:,} YAML nodes (aliases expanded)"
            if seen > MAX_NODES
            else f"nested deeper than {MAX_DEPTH} levels"
            if depth > MAX_DEPTH
            else None
        )
        if problem:
            line = node.start_mark.line + 1 if node.start_mark else None
            raise ScenarioError([Problem(file=file, path="$", message=f"{problem}; not a scenario", line=line)])
        if isinstance(node, yaml.MappingNode):
            stack += [(n, depth + 1) for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(n, depth + 1) for n in node.value]


def _duplicate_keys(node: yaml.Node, file: str, path: list[Any]) -> Iterator[Problem]:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = str(k.value)
            if key in seen:
                yield Problem(
                    file=file,
                    path=json_path([*path, key]),
                    message=f"duplicate key {key!r} (first on line {seen[key]}); YAML would keep only the last",
                    line=k.start_mark.line + 1,
                )
            else:
                seen[key] = k.start_mark.line + 1
            yield from _duplicate_keys(v, file, [*path, key])
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            yield from _duplicate_keys(v, file, [*path, i])


def load_text(text: str, *, file: str = "<string>") -> list[Scenario]:
    """All scenarios (sweeps expanded) defined by one YAML document."""
    doc, where = _parse_yaml(text, file)
    return load_document(doc, file=file, where=where)


def load_document(doc: Any, *, file: str, where: _Located | None = None) -> list[Scenario]:
    """All scenarios defined by an already parsed document (e.g. one built from command-line flags)."""
    where = where or _Located(None)
    if doc is None:
        raise ScenarioError([Problem(file=file, path="$", message="the file is empty; expected a scenario mapping")])
    problems = _schema_problems(doc, file, where)
    if problems:
        raise ScenarioError(problems)
    scenarios: list[Scenario] = []
    for label, variant in _expand(doc, file, where):
        context = f" (sweep variant {label})" if label else ""
        problems += _schema_problems(variant, file, where, context)
        if not problems:
            built, found = _build(variant, file=file, where=where, label=label)
            problems += [replace(p, message=p.message + context) for p in found]
            if built is not None:
                scenarios.append(built)
    if problems:
        raise ScenarioError(problems)
    return scenarios


MAX_FILE_BYTES = 1 << 20
"""A scenario file is at most this large (a YAML document larger than 1 MiB is not a scenario)."""


def load_file(path: str | Path) -> list[Scenario]:
    file = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ScenarioError([Problem(file=file, path="$", message=f"cannot read: {exc.strerror}")]) from None
    if len(data) > MAX_FILE_BYTES:
        message = f"{len(data):,} bytes: larger than a scenario file can be ({MAX_FILE_BYTES:,} bytes)"
        raise ScenarioError([Problem(file=file, path="$", message=message)])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff"))
        what = "it starts with a UTF-16 byte-order mark" if utf16 else f"byte {exc.start} is 0x{data[exc.start]:02x}"
        message = f"not UTF-8 text ({what}); scenario files are UTF-8 YAML"
        raise ScenarioError([Problem(file=file, path="$", message=message)]) from None
    return load_text(text.removeprefix("\ufeff"), file=file)


def scenario_files(paths: Iterable[str | Path]) -> list[Path]:
    """The scenario files named by ``paths`` (directories are searched recursively)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in SCENARIO_SUFFIXES and f.is_file())
        else:
            out.append(p)
    return out


def load_paths(paths: Iterable[str | Path]) -> list[Scenario]:
    """Scenarios of every file under ``paths``; all problems of all files are raised together."""
    files = scenario_files(paths)
    problems: list[Problem] = []
    scenarios: list[Scenario] = []
    for f in files:
        try:
            scenarios += load_file(f)
        except ScenarioError as exc:
            problems += exc.problems
    if not files and not problems:
        problems.append(Problem(file=", ".join(map(str, paths)) or ".", path="$", message="no scenario files (*.yaml)"))
    seen: dict[str, str | None] = {}
    for s in scenarios:
        if s.id in seen:
            problems.append(
                Problem(
                    file=s.file or "?", path="$.name", message=f"scenario id {s.id!r} is also defined in {seen[s.id]}"
                )
            )
        seen[s.id] = s.file
    if problems:
        raise ScenarioError(problems)
    return scenarios


# -------------------------------------------------------------------------------------------- sweeps


SWEEP_LIMIT = 64
"""The most variants a sweep expands into unless the scenario's ``sweep_limit`` raises it."""


def _expand(doc: dict[str, Any], file: str, where: _Located) -> Iterator[tuple[str, dict[str, Any]]]:
    sweep: dict[str, list[Any]] = doc.get("sweep") or {}
    base = {k: v for k, v in doc.items() if k not in ("sweep", "sweep_limit")}
    if not sweep:
        yield "", base
        return
    # A key "a.b+c.d" moves its paths together: each of its values is a list with one value per path
    # (a strong-scaling sweep: dp up while micro-batches go down). Keys are combined as a product.
    axes: list[list[list[tuple[str, Any]]]] = []
    for key, values in sweep.items():
        paths = key.split("+")
        if len(paths) == 1:
            axes.append([[(key, v)] for v in values])
            continue
        bad = [v for v in values if not isinstance(v, list) or len(v) != len(paths)]
        if bad:
            msg = f"{bad[0]!r}: each value of a joined key is a list of {len(paths)} values, one per path"
            raise ScenarioError(
                [Problem(file=file, path=f"$.sweep.{key}", message=msg, line=where.line(["sweep", key]))]
            )
        axes.append([list(zip(paths, v, strict=True)) for v in values])
    limit = doc.get("sweep_limit", SWEEP_LIMIT)
    if (variants := math.prod(len(a) for a in axes)) > limit:
        msg = (
            f"{' x '.join(str(len(a)) for a in axes)} = {variants:,} variants, more than the sweep limit {limit}; "
            "raise it with sweep_limit: N if you mean it"
        )
        raise ScenarioError([Problem(file=file, path="$.sweep", message=msg, line=where.line(["sweep"]))])
    for combo in itertools.product(*axes):
        variant = copy.deepcopy(base)
        assignments = [pair for group in combo for pair in group]
        for key, value in assignments:
            node = variant
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ScenarioError(
                        [
                            Problem(
                                file=file,
                                path=f"$.sweep.{key}",
                                message=f"{part!r} is not a mapping",
                                line=where.line(["sweep", key]),
                            )
                        ]
                    )
            node[parts[-1]] = value
        yield ",".join(f"{k.split('.')[-1]}={v}" for k, v in assignments), variant


# -------------------------------------------------------------------------------- consistency, build


def _build(doc: dict[str, Any], *, file: str, where: _Located, label: str) -> tuple[Scenario | None, list[Problem]]:
    problems: list[Problem] = []

    def bad(parts: list[Any], message: str) -> None:
        problems.append(Problem(file=file, path=json_path(parts), message=message, line=where.line(parts)))

    try:
        ds = dsconfig.load(doc.get("deepspeed", {}), scenario_file=file)
    except ValueError as exc:
        bad(["deepspeed"], str(exc))
        return None, problems
    for key, message in dsconfig.not_mappings(ds):
        bad(["deepspeed", key], message)
    if problems:
        return None, problems
    model_doc, par_doc = _from_deepspeed(ds, dict(doc["model"]), dict(doc["parallelism"]), bad)
    model = _build_model(model_doc, bad)
    par = _build_parallelism(par_doc, bad)
    if model is None:
        return None, problems
    _check_consistency(doc, model, par, bad)
    checked = doc.get("expectations", {}).get("model", {}).get("check", True)
    for key, message in dsconfig.refused_keys(ds):
        bad(["deepspeed", "zero_optimization", key], message)
    if checked:
        dsconfig.unmodelled(ds, par.zero.stage, bad)
    if SCHEMES[par.scheme].deepspeed:
        _check_optimizer(ds, model.dtype, par, checked, bad)
    zo = ds.get("zero_optimization", {})
    if par.moe is not None and isinstance(zo, Mapping) and zo.get("reduce_scatter", True) is False:
        bad(
            ["deepspeed", "zero_optimization", "reduce_scatter"],
            "false: DeepSpeed's MoE needs reduce_scatter (it asserts 'Reduce Scatter ... must be set to True for MoE')",
        )
    if par.moe is not None and par.zero.stage in (1, 2) and isinstance(zo, Mapping):
        if zo.get("contiguous_gradients", True) is False and par.zero.stage == 2:
            bad(
                ["deepspeed", "zero_optimization", "contiguous_gradients"],
                "false: DeepSpeed's MoE at ZeRO-2 needs contiguous gradients (it asserts 'Contiguous Gradients in "
                "ZeRO Stage 2 must be set to True for MoE')",
            )
        elif zo.get("contiguous_gradients", True) is False and checked:
            bad(
                ["deepspeed", "zero_optimization", "contiguous_gradients"],
                "false: MoE at ZeRO-1 without contiguous gradients (DeepSpeed's experimental path) is not modelled "
                "yet; expectations: {model: {check: false}} runs it as a baseline-only gate",
            )
    batch = ds.get("train_batch_size", "auto")
    if dsconfig.given(batch) and batch != par.dp * par.micro_batch * par.micro_batches:
        bad(
            ["deepspeed", "train_batch_size"],
            f"{batch} != dp*b*m = {par.dp}*{par.micro_batch}*{par.micro_batches}",
        )
    if problems:
        return None, problems
    markers = tuple(doc.get("markers", ()))
    backend = doc.get("backend", "auto")
    if backend == "nccl" and "gpu" not in markers:
        markers += ("gpu",)
    name = doc["name"]
    return (
        Scenario(
            id=f"{name}[{label}]" if label else name,
            name=name,
            description=doc.get("description", ""),
            file=file,
            model=model,
            parallelism=par,
            backend=backend,
            emulate=bool(doc.get("emulate", False)),
            steps=doc.get("steps", 3),
            warmup_steps=doc.get("warmup_steps", 1),
            deadline_s=float(doc.get("deadline_s", 300.0)),
            stall_s=float(doc["stall_s"]) if "stall_s" in doc else None,
            markers=markers,
            workload=doc.get("workload"),
            expectations=_build_expectations(doc.get("expectations", {})),
            deepspeed=json.dumps(ds, sort_keys=True),
            warnings=tuple(dsconfig.unknown_keys(ds)),
        ),
        problems,
    )


def _from_deepspeed(
    ds: dict[str, Any], model: dict[str, Any], par: dict[str, Any], bad: Bad
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The scenario's model and parallelism with what the DeepSpeed block states filled in; a value the
    scenario states otherwise is a problem naming both."""
    zero = dict(par.get("zero", {}))
    zo = ds.get("zero_optimization", {})
    zo = zo if isinstance(zo, Mapping) else {}

    def take(target: dict[str, Any], field: str, value: Any, key: str, where: str) -> None:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:  # JSON's 5e8
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad(["deepspeed", *key.split(".")], f"{value!r}: expected a whole number >= 1")
            return
        if field in target and target[field] != value:
            bad(["deepspeed", *key.split(".")], f"{value!r} contradicts {where}.{field} = {target[field]!r}")
        target[field] = value

    if dsconfig.given(ds.get("gradient_accumulation_steps", "auto")):
        take(par, "micro_batches", ds["gradient_accumulation_steps"], "gradient_accumulation_steps", "parallelism")
    if dsconfig.given(ds.get("train_micro_batch_size_per_gpu", "auto")):
        take(par, "micro_batch", ds["train_micro_batch_size_per_gpu"], "train_micro_batch_size_per_gpu", "parallelism")
    buckets = {zo[k] for k in ("reduce_bucket_size", "allgather_bucket_size") if dsconfig.given(zo.get(k, "auto"))}
    if dsconfig.given(zo.get("reduce_bucket_size", "auto")):
        take(
            zero,
            "bucket_elements",
            zo["reduce_bucket_size"],
            "zero_optimization.reduce_bucket_size",
            "parallelism.zero",
        )
    elif buckets:  # allgather_bucket_size alone: DeepSpeed asserts it is even; torch >= 1.13 ignores it
        zero.setdefault("bucket_elements", ZeroConfig().bucket_elements)
    if dsconfig.given(zo.get("zero_hpz_partition_size", "auto")):
        take(
            zero, "hpz", zo["zero_hpz_partition_size"], "zero_optimization.zero_hpz_partition_size", "parallelism.zero"
        )
    if dsconfig.given(zo.get("stage", "auto")):
        implied = SCHEMES[par["scheme"]].zero_stage if par.get("scheme") in SCHEMES else None
        stage = zero.get("stage", implied if implied is not None else 0)
        if zo["stage"] != stage:
            bad(
                ["deepspeed", "zero_optimization", "stage"],
                f"{zo['stage']} contradicts scheme {par.get('scheme')!r} (ZeRO stage {stage})",
            )
    for key, dtype in (("bf16", "bf16"), ("fp16", "fp16")):
        if dsconfig.enabled(ds, key):
            if model.get("dtype", dtype) != dtype:
                bad(["deepspeed", key, "enabled"], f"True contradicts model.dtype = {model['dtype']!r}")
            model["dtype"] = dtype
    if zero:
        par["zero"] = zero
    return model, par


_DIMS = ("L", "h", "a", "V", "s")


def _build_model(m: dict[str, Any], bad: Bad) -> ModelSpec | None:
    explicit = {k: v for k, v in m.items() if k != "preset"}
    if "x" in explicit and "ffn_hidden" in explicit:
        bad(
            ["model", "ffn_hidden"], f"{explicit['ffn_hidden']} and x={explicit['x']} both give the MLP width; keep one"
        )
    if "module" in explicit:  # a user's own model: its parameters come from the module, not dimensions
        if set(explicit) & {"L", "h", "a", "V", "architecture", "kv_heads", "ffn_hidden", "x"} or "preset" in m:
            bad(["model", "module"], "a user's module takes no preset or dimensions (only s and dtype)")
        return ModelSpec(L=1, h=1, a=1, V=1, s=explicit.get("s", 1), dtype=explicit.get("dtype", "fp32"),
                         autocast=explicit.get("autocast"), module=explicit["module"], position="none")  # fmt: skip
    if explicit.get("architecture") == "llama" and "position" not in explicit:
        explicit["position"] = "rotary"  # Llama's; a gpt-neox preset's learned positions do not carry over
    if "preset" in m:
        return replace(PRESETS[m["preset"]], **explicit)
    missing = [d for d in _DIMS if d not in m]
    for d in missing:
        bad(["model"], f"missing field {d!r}; give a preset (e.g. preset: 19M-cpu) or all of {', '.join(_DIMS)}")
    return None if missing else ModelSpec(**explicit)


USER_MODULE_SCHEMES = ("ddp", "zero1", "zero2", "zero3")
"""Schemes whose model a user's module can stand in for (their engines see only its parameters)."""


def _check_module(spec: str, scheme: str, bad: Bad) -> None:
    from commgate.model.usermodule import resolve

    if scheme not in USER_MODULE_SCHEMES:
        bad(
            ["model", "module"],
            f"{spec!r}: a user's module is modelled under {', '.join(USER_MODULE_SCHEMES)}, not {scheme!r} "
            "(for another scheme, give your own training step as workload:)",
        )
        return
    try:
        resolve(spec)
    except CommgateError as exc:
        bad(["model", "module"], str(exc).removeprefix(f"model.module {spec!r}: "))


def _check_workload(spec: str, bad: Bad) -> None:
    """``workload:`` names an importable callable (imported now, so that validate finds what a run would)."""
    from commgate.model.usermodule import resolve

    try:
        fn = resolve(spec)
    except CommgateError as exc:
        bad(["workload"], str(exc).removeprefix(f"model.module {spec!r}: "))
        return
    if not callable(fn):
        bad(["workload"], f"{spec!r} is a {type(fn).__name__}, not a callable")


def _check_architecture(m: ModelSpec, tp: int, bad: Bad) -> None:
    """What the architecture's shapes need, including what tensor parallelism over ``tp`` ranks splits."""
    if m.llama and m.position != "rotary":
        bad(["model", "position"], f"{m.position!r}: architecture llama uses rotary positions")
    if m.kv_heads is not None and not m.llama:
        bad(["model", "kv_heads"], f"{m.kv_heads}: grouped-query attention needs architecture: llama")
    if m.a % m.kv:
        bad(["model", "kv_heads"], f"{m.kv}: heads a={m.a} are not divisible by kv_heads")
    if m.position == "rotary" and (m.h // m.a) % 2:
        bad(["model", "h"], f"{m.h}: rotary positions need an even head dimension, h/a = {m.h}/{m.a} is odd")
    if tp > 1 and m.llama and m.kv % tp:
        bad(
            ["parallelism", "tp"],
            f"{tp}: key/value heads kv_heads={m.kv} are not divisible by tp (each rank holds whole heads)",
        )
    if tp > 1 and m.ffn_hidden is not None and m.ffn % tp:  # x*h divides when the heads do
        bad(["parallelism", "tp"], f"{tp}: the MLP width ffn={m.ffn} is not divisible by tp")


def _build_parallelism(p: dict[str, Any], bad: Bad) -> Parallelism:
    scheme = p["scheme"]
    implied = SCHEMES[scheme].zero_stage
    zero_doc = dict(p.get("zero", {}))
    if implied is not None:
        if zero_doc.get("stage", implied) != implied:
            bad(
                ["parallelism", "zero", "stage"],
                f"{zero_doc['stage']} contradicts scheme {scheme!r} (ZeRO stage {implied})",
            )
        zero_doc["stage"] = implied
    moe = MoEConfig(**p["moe"]) if "moe" in p else None
    rest = {k: v for k, v in p.items() if k not in ("zero", "moe", "fsdp", "pipeline")}
    return Parallelism(
        **rest,
        zero=ZeroConfig(**zero_doc),
        moe=moe,
        fsdp=FSDPConfig(**p.get("fsdp", {})),
        pipeline=PipelineConfig(**p.get("pipeline", {})),
    )


def _check_optimizer(
    cfg: dict[str, Any], dtype: str, par: Parallelism, checked: bool, bad: Callable[[list[Any], str], None]
) -> None:
    """The optimizer wrapper DeepSpeed's engine would choose (``dsconfig.optimizer``): a mix it refuses
    is an error, one the model does not follow yet an error unless the model check is off."""
    where = ["deepspeed", "data_types", "grad_accum_dtype"]
    section = cfg.get("data_types")
    acc = section.get("grad_accum_dtype") if isinstance(section, Mapping) else None
    if acc is not None and str(acc) not in dsconfig.DTYPES:
        bad(where, f"{acc!r}: DeepSpeed's dtypes are {', '.join(sorted(dsconfig.DTYPES))}")
        return
    try:
        wrapper = dsconfig.optimizer(cfg, dtype, par.zero.stage, pipeline=par.pp > 1)
    except ValueError as exc:
        bad(where, str(exc))
        return
    if wrapper == "BF16_Optimizer" and par.tp > 1:
        bad(
            where if acc is not None else ["model", "dtype"],
            f"{acc or dtype}: DeepSpeed's BF16_Optimizer fails with tensor parallelism on DTensor (tp={par.tp}): "
            "its gradient norm skips every parameter not marked model_parallel and stacks an empty list on "
            "tensor-parallel ranks > 0; use ZeRO-1 with bf16 gradient accumulation, or fp32",
        )
    elif checked and wrapper == "BF16_Optimizer" and par.moe is not None:
        bad(
            where if acc is not None else ["model", "dtype"],
            f"{acc or dtype}: MoE under DeepSpeed's BF16_Optimizer is not modelled yet; "
            "expectations: {model: {check: false}} runs it as a baseline-only gate",
        )


MAX_WORLD = 1 << 20
"""The most ranks a scenario may have (a million: beyond any cluster, and what a prediction enumerates)."""


TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}
"""The ``torch.distributed.pipelining`` schedule class of each ``pipeline.schedule``."""


def _check_pipeline(doc_par: Any, m: ModelSpec, par: Parallelism, bad: Bad) -> None:
    P, pl, s = ("parallelism", "pipeline"), par.pipeline, par.scheme
    rule = SCHEMES[s]
    if "pipeline" in doc_par and not (rule.pipeline or (rule.optional_pipeline and par.pp > 1)):
        bad([*P], f"a pipeline engine needs a pipeline scheme (pp or 3d, or fsdp with pp > 1), not {s!r}")
        return
    interleaved = pl.looped
    if rule.optional_pipeline and par.pp > 1:
        _check_fsdp_pipeline(pl, par, bad)
    if pl.engine == "deepspeed":
        if pl.schedule != "1f1b" or pl.virtual_stages != 1:
            bad([*P, "schedule"], f"{pl.schedule}: DeepSpeed's engine runs its own 1F1B; engine: torch for others")
        return
    if s not in ("pp", "fsdp"):
        bad([*P, "engine"], f"torch: torch.distributed.pipelining is modelled under schemes 'pp' and 'fsdp', not {s!r}")
    if "zero" in doc_par:
        bad(
            ["parallelism", "zero"],
            "DeepSpeed's ZeRO options do not apply to torch.distributed.pipelining (engine: torch)",
        )
    if par.dp > 1 and not rule.optional_pipeline:
        bad(["parallelism", "dp"], f"{par.dp}: data parallelism inside torch's stages is FSDP2's: use scheme 'fsdp'")
    if par.activation_checkpointing:
        bad(["parallelism", "activation_checkpointing"], "true: not modelled with torch.distributed.pipelining yet")
    if not interleaved and pl.virtual_stages != 1:
        bad([*P, "virtual_stages"], f"{pl.virtual_stages}: schedule {pl.schedule!r} runs one stage per rank")
    if interleaved and pl.schedule == "interleaved-1f1b" and pl.virtual_stages < 2:
        bad([*P, "virtual_stages"], f"{pl.virtual_stages}: an interleaved schedule needs virtual_stages >= 2")
    rounds = max(1, par.micro_batches // par.pp)  # torch's interleaved schedules run m in rounds of p
    if interleaved and par.micro_batches % rounds:
        bad(
            ["parallelism", "micro_batches"],
            f"{par.micro_batches}: torch's {TORCH_SCHEDULES[pl.schedule]} needs a multiple of its {rounds} rounds",
        )
    if pl.schedule == "1f1b" and par.micro_batches < par.pp:
        bad(["parallelism", "micro_batches"], f"{par.micro_batches}: torch's Schedule1F1B needs at least pp={par.pp}")
    stages = par.pp * pl.virtual_stages
    if m.module is None and m.L % stages:
        bad(
            [*P, "virtual_stages"],
            f"{pl.virtual_stages}: layers L={m.L} are not divisible by pp*virtual_stages={stages}",
        )


def _check_fsdp_pipeline(pl: PipelineConfig, par: Parallelism, bad: Bad) -> None:
    """FSDP2 inside torch.distributed.pipelining's stages (3-D with tp): GPipe or 1F1B, one stage per rank."""
    P = "parallelism"
    if pl.engine != "torch":
        bad([P, "pipeline", "engine"], "deepspeed: FSDP2 runs in torch.distributed.pipelining's stages: engine: torch")
    elif pl.schedule not in ("gpipe", "1f1b"):
        bad(
            [P, "pipeline", "schedule"],
            f"{pl.schedule}: FSDP2 in pipeline stages is modelled under gpipe and 1f1b (one stage per rank) yet",
        )
    if par.dp_replicate > 1:
        bad([P, "dp_replicate"], f"{par.dp_replicate}: HSDP in pipeline stages is not modelled yet (pp={par.pp})")
    if par.fsdp.reshard_group is not None:
        k = par.fsdp.reshard_group
        bad([P, "fsdp", "reshard_after_forward"], f"{k}: an int in pipeline stages is not modelled yet")
    if par.cp > 1:
        bad([P, "cp"], f"{par.cp}: context parallelism in pipeline stages is not modelled yet (pp={par.pp})")


def _check_consistency(doc: dict[str, Any], m: ModelSpec, par: Parallelism, bad: Bad) -> None:
    P = "parallelism"
    s = par.scheme
    rule = SCHEMES[s]
    if par.world_size > MAX_WORLD:
        bad([P], f"{par.axes} = {par.world_size:,} ranks, more than {MAX_WORLD:,}")
    if "world_size" in doc and doc["world_size"] != par.world_size:
        bad(["world_size"], f"{doc['world_size']} != {par.axes} = {par.world_size}")
    if isinstance(doc.get("workload"), str):
        _check_workload(doc["workload"], bad)
    if m.module is None and m.h % m.a:
        bad(["model", "a"], f"hidden size h={m.h} is not divisible by heads a={m.a}")
    # Which axes each scheme allows (beyond dp, which all allow).
    need_tp, need_pp = rule.tensor, rule.pipeline
    if need_tp and par.tp < 2:
        bad([P, "tp"], f"{par.tp}: scheme {s!r} needs tp >= 2")
    if not need_tp and not rule.optional_tensor and par.tp != 1:
        bad([P, "tp"], f"{par.tp}: scheme {s!r} has no tensor parallelism; use scheme 'tp', '3d' or 'fsdp'")
    if rule.optional_tensor and par.tp > 1 and par.dp_replicate > 1:
        bad([P, "dp_replicate"], f"{par.dp_replicate}: HSDP with tensor parallelism is not modelled yet (tp={par.tp})")
    if need_pp and par.pp < 2:
        bad([P, "pp"], f"{par.pp}: scheme {s!r} needs pp >= 2")
    if not need_pp and not rule.optional_pipeline and par.pp != 1:
        bad([P, "pp"], f"{par.pp}: scheme {s!r} has no pipeline parallelism; use scheme 'pp' or '3d'")
    if par.data_ranks < rule.min_dp:  # FSDP2 shards over dp x cp: dp = 1 with cp = 2 shards over 2 ranks
        bad([P, "dp"], f"{par.dp}: scheme {s!r} needs dp >= {rule.min_dp}")
    if m.autocast is not None and (s != "ddp" or m.dtype != "fp32"):
        bad(
            ["model", "autocast"],
            f"{m.autocast}: autocast is run under scheme ddp with fp32 parameters (the model's dtype {m.dtype!r}, "
            f"scheme {s!r}); for 16-bit parameters set model.dtype instead",
        )
    if m.module is not None:  # its own parameters: no dimensions to check
        _check_module(m.module, s, bad)
    else:
        if par.tp > 1 and m.a % par.tp:
            bad([P, "tp"], f"{par.tp}: heads a={m.a} are not divisible by tp")
        _check_architecture(m, par.tp, bad)
        if par.tp > 1 and m.V % par.tp:
            bad([P, "tp"], f"{par.tp}: vocabulary V={m.V} is not divisible by tp (vocab-parallel embedding)")
        if par.pp > 1 and m.L % par.pp:
            bad([P, "pp"], f"{par.pp}: layers L={m.L} are not divisible by pp")
    stage = par.zero.stage
    if not rule.zero and stage:
        bad([P, "zero", "stage"], f"{stage}: {rule.summary} has no ZeRO; use scheme 'zero{stage}'")
    if stage in (1, 2) and par.zero.bucket_elements % 2:
        bad(
            [P, "zero", "bucket_elements"],
            f"{par.zero.bucket_elements}: DeepSpeed's ZeRO-1/2 need an even bucket size "
            "(allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2)",
        )
    if par.pp > 1 and stage >= 2:
        bad([P, "zero", "stage"], f"{stage}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only")
    if par.tp > 1 and stage >= 3:
        bad([P, "zero", "stage"], f"{stage}: ZeRO-3 with tensor parallelism (tp={par.tp}) is unsupported")
    zpp = par.zero.hpz > 1 or par.zero.qwz or par.zero.qgz
    zpp_schemes = " or ".join(repr(n) for n, r in SCHEMES.items() if r.zero_plus_plus)
    if rule.zero_plus_plus and not zpp:
        bad([P, "zero"], f"scheme {s!r} needs at least one of hpz > 1, qwz: true, qgz: true")
    if not rule.zero_plus_plus and zpp:
        bad([P, "zero"], f"ZeRO++ options (hpz, qwz, qgz) need scheme {zpp_schemes}, not {s!r}")
    if par.zero.hpz > 1 and par.dp % par.zero.hpz:
        bad([P, "zero", "hpz"], f"{par.zero.hpz}: dp={par.dp} is not divisible by the hpZ partition size")
    if "fsdp" in doc.get(P, {}) and not rule.fsdp:
        fsdp_schemes = " or ".join(repr(n) for n, r in SCHEMES.items() if r.fsdp)
        bad([P, "fsdp"], f"FSDP2 options need scheme {fsdp_schemes}, not {s!r}")
    if par.sequence_parallel and not (rule.tensor or (rule.optional_tensor and par.tp > 1)):
        bad([P, "sequence_parallel"], f"true: sequence parallelism runs inside tensor parallelism, not scheme {s!r}")
    elif par.sequence_parallel and par.pp > 1:
        where = "under DeepSpeed's pipeline engine yet (scheme 3d); use tp" if s == "3d" else "in pipeline stages yet"
        bad([P, "sequence_parallel"], f"true: not modelled {where}")
    _check_pipeline(doc.get(P, {}), m, par, bad)
    if par.pipeline.engine == "torch" and "deepspeed" in doc:
        bad(
            ["deepspeed"],
            "DeepSpeed keys do not apply to torch.distributed.pipelining (parallelism.pipeline.engine: torch)",
        )
    k = par.fsdp.reshard_group
    if rule.fsdp and k is not None and par.dp % k:
        bad([P, "fsdp", "reshard_after_forward"], f"{k}: an int must divide dp={par.dp} (reshards to groups of it)")
    elif rule.fsdp and k is not None and k not in (1, par.dp) and par.tp > 1:
        bad(
            [P, "fsdp", "reshard_after_forward"],
            f"{k}: an int with tensor parallelism hangs torch 2.13's first forward (seen here: ranks wait in "
            "different collectives while the post-forward mesh is built); use true or false with tp",
        )
    _check_context(doc.get(P, {}), m, par, bad)
    if doc.get("emulate"):
        _check_emulation(doc, bad)
    if par.dp_replicate > 1 and not rule.fsdp:
        bad([P, "dp_replicate"], f"{par.dp_replicate}: replicas of a sharded model are HSDP, scheme 'fsdp', not {s!r}")
    if rule.moe:
        if par.moe is None:
            bad([P], f"scheme {s!r} needs a 'moe' block with 'experts'")
        else:
            moe = par.moe
            if par.dp % moe.ep:
                bad([P, "moe", "ep"], f"{moe.ep}: dp={par.dp} is not divisible by the expert-parallel size")
            if moe.experts % moe.ep:
                bad([P, "moe", "ep"], f"{moe.ep}: experts={moe.experts} are not divisible by the expert-parallel size")
            if moe.every > m.L:
                bad([P, "moe", "every"], f"{moe.every}: greater than layers L={m.L}, so no layer would be MoE")
            if stage >= 3:
                bad([P, "zero", "stage"], f"{stage}: DeepSpeed MoE supports ZeRO stage 0-2 only")
    elif par.moe is not None:
        moe_schemes = " or ".join(repr(n) for n, r in SCHEMES.items() if r.moe)
        bad([P, "moe"], f"MoE settings need scheme {moe_schemes}, not {s!r}")


def emulation_refusal(backend: str, workload: str | None) -> str | None:
    """Why a scenario cannot run emulated, or None. A started rank stands for the ranks that run the same
    code on the same shapes as it: its data-parallel peers (data, context, expert parallelism); pipeline
    stages hold different layers and run as real processes, one per stage and tensor shard
    (``commgate.run.emulate.started_ranks``)."""
    if backend == "nccl":
        return "an emulated run exchanges nothing, on CPU (backend gloo or auto, not nccl)"
    if workload is not None:
        return "your own workload runs on real ranks only (its step may rely on its peers' data)"
    return None


def _check_emulation(doc: dict[str, Any], bad: Bad) -> None:
    workload = doc.get("workload") if isinstance(doc.get("workload"), str) else None
    if why := emulation_refusal(doc.get("backend", "auto"), workload):
        bad(["emulate"], f"true: {why}")


def _check_context(doc_par: Any, m: ModelSpec, par: Parallelism, bad: Bad) -> None:
    """Context parallelism: schemes cp and fsdp, whose sequences split evenly over the cp ranks."""
    P, s, rule = "parallelism", par.scheme, SCHEMES[par.scheme]
    cp_schemes = " or ".join(repr(n) for n, r in SCHEMES.items() if r.context or r.optional_context)
    if rule.context and par.cp < 2:
        bad([P, "cp"], f"{par.cp}: scheme {s!r} needs cp >= 2")
    elif not (rule.context or rule.optional_context) and par.cp != 1:
        bad([P, "cp"], f"{par.cp}: scheme {s!r} has no context parallelism; use scheme {cp_schemes}")
    elif par.cp > 1:
        if m.module is None and m.s % par.cp:  # (a user's module is refused under scheme cp with the others)
            bad([P, "cp"], f"{par.cp}: sequence length s={m.s} is not divisible by cp")
        if par.sequence_parallel:
            bad([P, "sequence_parallel"], "true: sequence parallelism with context parallelism is not modelled yet")
        if par.dp_replicate > 1 and rule.fsdp:
            bad([P, "dp_replicate"], f"{par.dp_replicate}: HSDP with context parallelism is not modelled yet")
        if par.fsdp.reshard_group not in (None, 1, par.data_ranks):
            bad(
                [P, "fsdp", "reshard_after_forward"],
                f"{par.fsdp.reshard_group}: an int with context parallelism is not modelled yet; use true or false",
            )
    if isinstance(doc_par, dict) and "cp_rotate" in doc_par and par.cp < 2:
        bad([P, "cp_rotate"], f"{par.cp_rotate}: rotates K/V between context-parallel ranks; needs scheme {cp_schemes}")


def _build_expectations(e: dict[str, Any]) -> Expectations:
    def tol(d: dict[str, Any] | None, default: Tolerance) -> Tolerance:
        return replace(default, **d) if d else default

    base = Expectations()
    model, paper, baseline = e.get("model", {}), e.get("paper", {}), e.get("baseline", {})
    return Expectations(
        model_check=model.get("check", True),
        model_bytes=tol(model.get("bytes"), base.model_bytes),
        model_calls=tol(model.get("calls"), base.model_calls),
        paper_rtol=paper.get("rtol", base.paper_rtol),
        baseline_bytes=tol(baseline.get("bytes"), base.baseline_bytes),
        baseline_calls=tol(baseline.get("calls"), base.baseline_calls),
        latency=replace(base.latency, **baseline.get("latency", {})),
        cold_start=replace(base.cold_start, **e.get("drift", {}).get("cold_start", {})),
        time_max_error=e.get("time", {}).get("max_error"),
    )


def field_names(cls: type) -> tuple[str, ...]:
    """Field names of a record dataclass (used by tests to keep schema and records in step)."""
    return tuple(f.name for f in fields(cls))
