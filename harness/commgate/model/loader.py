"""Scenario files: YAML -> JSON-Schema validation -> sweep expansion -> records -> consistency rules.

Every problem of a file is reported at once, one line each, naming the file, its line, the JSON path,
the offending value and what was expected (``commgate.core.errors.Problem``). Only ``yaml.SafeLoader`` is
used, so ``!!python/...`` tags are rejected. The records are ``commgate.model.scenario``'s; the rules are
those of every scenario (``commgate.model.rules``), of the schemes' components (``SCHEMES``) and of the
scenario's trainer (``TRAINERS``).
"""

from __future__ import annotations

import copy
import datetime
import difflib
import fnmatch
import functools
import itertools
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from commgate.core import schemas
from commgate.core.errors import CommgateError, Problem, ScenarioError
from commgate.core.fsutil import MAX_DIGITS, beside, json_path
from commgate.model import dsconfig, rules, trainers
from commgate.model.scenario import (
    Expectations,
    FSDPConfig,
    ModelSpec,
    MoEConfig,
    Parallelism,
    PipelineConfig,
    Scenario,
    Tolerance,
    ZeroConfig,
)
from commgate.model.schemes import RULES, SCHEMES
from commgate.model.schemes.scheme import Bad, Check
from commgate.model.trainers import TRAINERS
from commgate.model.transformer import PRESETS

SCENARIO_SUFFIXES = (".yaml", ".yml")


# --------------------------------------------------------------------------------------------- schema


@functools.cache
def schema() -> dict[str, Any]:
    """The published scenario JSON Schema (draft 2020-12), with the enums of ``parallelism.scheme`` and
    ``trainer`` filled in from their registries (``SCHEMES``, ``TRAINERS``: the one list of each), and each
    trainer's options block from its record."""
    doc = copy.deepcopy(schemas.load("scenario"))
    doc["properties"]["parallelism"]["properties"]["scheme"]["enum"] = list(SCHEMES)
    doc["properties"]["trainer"]["enum"] = list(TRAINERS)
    doc["properties"] |= {name: dict(t.options) for name, t in TRAINERS.items() if t.options is not None}
    return doc


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    cls = schemas.strict()
    cls.check_schema(schema())
    return cls(schema())


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # a date YAML read (``2024-01-01``) as the file spells it, not its repr
        text = value.isoformat() if isinstance(value, datetime.date) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def _forms_of_its_type(err: jsonschema.ValidationError) -> list[int]:
    """The forms (``anyOf``/``oneOf`` branches) of a field whose type the value has: where one does, its own
    problem is the value's (a list too short), not "none of the forms"."""
    checker, forms = _validator().TYPE_CHECKER, err.validator_value
    return [
        i
        for i, form in enumerate(forms if isinstance(forms, list) else [])
        if isinstance(form, Mapping) and any(checker.is_type(err.instance, t) for t in _listed(form.get("type")))
    ]


def _article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _type_name(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    if isinstance(value, datetime.date):
        return "date"
    return kinds.get(type(value), type(value).__name__)


class _Located:
    """Maps JSON paths of a YAML document to line numbers."""

    def __init__(self, node: yaml.Node | None) -> None:
        self.node = node

    def line(self, parts: Sequence[Any]) -> int | None:
        found = self._find(parts)
        return found[1] if found is not None else None

    def text(self, parts: Sequence[Any]) -> str | None:
        """The scalar at ``parts`` as the file spells it (``1e400``, not the infinity YAML reads), or None."""
        found = self._find(parts)
        if found is None or not found[2] or not isinstance(found[0], yaml.ScalarNode):
            return None
        return str(found[0].value)

    def _find(self, parts: Sequence[Any]) -> tuple[yaml.Node, int, bool] | None:
        """(the node at ``parts``, else the deepest one on the way; the line of its key; whether it is the
        node at ``parts``)."""
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
                return node, best, False
            node = nxt
        return node, best, True


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
    infinite = {json_path(parts): parts for parts in _non_finite(doc, [])}
    problems = [
        Problem(file=file, path=path, message=_not_finite(where.text(parts)) + context, line=where.line(parts))
        for path, parts in infinite.items()
    ]
    for err in _validator().iter_errors(doc):
        for parts, message in _describe(err):
            if json_path(parts) in infinite:  # said once, as written ("Infinity is out of range" said it again)
                continue
            problems.append(
                Problem(file=file, path=json_path(parts), message=message + context, line=where.line(parts))
            )
    # each "required" error is described with every field the object lacks: one line per problem
    return list(dict.fromkeys(problems))


def _not_finite(written: str | None) -> str:
    """What a NaN or infinite number is, with the text YAML read it from (``1e400``: past a float's range)."""
    if written is None:
        return "not a finite number"
    return f"{written} is not a finite number (YAML reads it as {'NaN' if 'nan' in written.lower() else 'infinity'})"


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
            shown = "null" if key is None else key  # YAML reads a key `null:` (or `~:`) as no key at all
            yield [*path, shown], f"unknown field {shown!r}; {hint}expected one of: {', '.join(allowed)}"
    elif kind == "type":
        wanted = [want] if isinstance(want, str) else want
        yield (
            path,
            ("null (no value)" if inst is None else f"{_show(inst)} is {_article(_type_name(inst))}") + ", "
            f"expected {want if isinstance(want, str) else ' or '.join(want)}{_type_hint(inst, wanted)}",
        )
    elif kind == "enum":
        yield path, f"{_show(inst)} is not one of: {', '.join(str(v) for v in want)}"
    elif kind == "const":
        yield path, f"{_show(inst)} is not supported, expected {_show(want)}"
    elif kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        relation = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        yield path, f"{_show(inst)} is out of range, expected a value {relation} {want}"
    elif kind in ("maxLength", "minLength"):
        yield (
            path,
            f"{_show(inst)} is too {'long' if kind == 'maxLength' else 'short'}: {len(inst)} characters, "
            + (f"at most {want}" if kind == "maxLength" else f"at least {want}"),
        )
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
    elif kind in ("oneOf", "anyOf") and len(fits := _forms_of_its_type(err)) == 1:  # that form's own problem
        for inner in err.context or []:
            if inner.relative_schema_path and inner.relative_schema_path[0] == fits[0]:
                yield from _describe(inner)
    elif kind in ("oneOf", "anyOf"):  # jsonschema's own words show Python's repr (None for null)
        kinds = sorted({str(t) for sub in want if isinstance(sub, Mapping) for t in _listed(sub.get("type"))})
        expected = f": expected {' or '.join(kinds)}" if kinds else ""
        yield path, f"{_show(inst)} is not one of the forms this field takes{expected}"
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
            problems = list(_misread(node, file, [])) if node is not None else []
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
    except yaml.YAMLError as exc:  # e.g. a binary file's NUL byte: its several lines made one
        message = f"YAML error: {' '.join(str(exc).split())}"
        raise ScenarioError([Problem(file=file, path="$", message=message)]) from None
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
            else f"a number {len(node.value):,} digits long (Python reads at most {MAX_DIGITS:,})"
            if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":int") and len(node.value) > MAX_DIGITS
            else None
        )
        if problem:
            line = node.start_mark.line + 1 if node.start_mark else None
            raise ScenarioError([Problem(file=file, path="$", message=f"{problem}; not a scenario", line=line)])
        if isinstance(node, yaml.MappingNode):
            stack += [(n, depth + 1) for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(n, depth + 1) for n in node.value]


_OCTAL = re.compile(r"[-+]?0[0-9_]+")
"""An integer YAML 1.1 reads in base 8 (``010`` is 8), or as a string where a digit is 8 or 9 (``09``)."""


def _misread(node: yaml.Node, file: str, path: list[Any]) -> Iterator[Problem]:
    """What YAML would read otherwise than written: a duplicate key (the last kept) and an integer with a leading
    zero (``dp: 010`` was 8 ranks, silently; found by an adversarial pass)."""
    if isinstance(node, yaml.ScalarNode):
        if node.style is None and _OCTAL.fullmatch(str(node.value)):
            digits = str(node.value).lstrip("+-").replace("_", "").lstrip("0") or "0"
            yield Problem(
                file=file,
                path=json_path(path),
                message=(
                    f"{node.value}: YAML reads an integer with a leading zero as octal; write {digits} (or, for a "
                    f"string, quote it: '{node.value}')"
                ),
                line=node.start_mark.line + 1,
            )
    elif isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = str(k.value)
            if key in seen:
                yield Problem(
                    file=file,
                    path=json_path([*path, key]),
                    message=(
                        f"duplicate key {key!r} (first on line {seen[key]}); YAML would keep only the last: "
                        "give it once"
                    ),
                    line=k.start_mark.line + 1,
                )
            else:
                seen[key] = k.start_mark.line + 1
            yield from _misread(v, file, [*path, key])
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            yield from _misread(v, file, [*path, i])


def load_text(text: str, *, file: str = "<string>") -> list[Scenario]:
    """All scenarios (sweeps expanded) defined by one YAML document."""
    doc, where = _parse_yaml(text, file)
    return load_document(doc, file=file, where=where)


def load_document(doc: Any, *, file: str, where: _Located | None = None) -> list[Scenario]:
    """All scenarios defined by an already parsed document (e.g. one built from command-line flags)."""
    where = where or _Located(None)
    if doc is None:
        raise ScenarioError([Problem(file=file, path="$", message="the file is empty; expected a scenario mapping")])
    doc = _derived(doc, file, where)
    problems = _schema_problems(doc, file, where)
    if problems:
        raise ScenarioError(problems)
    scenarios: list[Scenario] = []
    variants: list[tuple[str, list[Problem]]] = []  # every variant checked: all bad points said at once
    for label, variant in _expand(doc, file, where):
        context = f" (sweep variant {label})" if label else ""
        found = _schema_problems(variant, file, where)
        if not found:
            built, found = _build(variant, file=file, where=where, label=label)
            if built is not None and not (found := _measured(built, file, where)):
                scenarios.append(built)
        variants.append((context, found))
    if problems := _sweep_problems(variants, doc, where):
        raise ScenarioError(problems)
    return scenarios


def _measured(scenario: Scenario, file: str, where: _Located) -> list[Problem]:
    """A model that is a module (the user's, or a trainer's such as Hugging Face's) is measured on the meta
    device when its scenario is predicted: what that refuses (a parameter no gradient reaches, a layer class
    FSDP's wrapping cannot find) is the scenario's problem, said when it is loaded (it stopped a whole run at
    that scenario's prediction, the report half-written: found by an adversarial pass). The measurements are
    kept (cached per scenario), and the prediction made again where it is used."""
    if scenario.model.module is None:
        return []
    from commgate.model.predict import predict

    try:
        predict(scenario)
    except CommgateError as exc:
        block = scenario.trainer if scenario.trainer != "commgate" else "model"
        message = str(exc).removeprefix(f"{file}: ")  # the problem names the file
        return [Problem(file=file, path=f"$.{block}", message=message, line=where.line([block]))]
    return []


def _sweep_problems(variants: list[tuple[str, list[Problem]]], doc: dict[str, Any], where: _Located) -> list[Problem]:
    """The variants' problems: one the whole sweep shares once, as it is (its value is not swept); the others
    each with its variant, at the line of the sweep's key that sets the value (the base value's line named
    what the variant does not hold)."""
    everywhere = set.intersection(*({(p.path, p.message) for p in found} for _, found in variants))
    out = [p for p in variants[0][1] if (p.path, p.message) in everywhere] if len(variants) > 1 else []
    for context, found in variants:
        for p in found:
            if len(variants) > 1 and (p.path, p.message) in everywhere:
                continue
            swept = next(
                (key for key in doc.get("sweep") or {} for part in key.split("+")
                 if p.path == f"$.{part}" or p.path.startswith(f"$.{part}.")),
                None,
            )  # fmt: skip
            line = where.line(["sweep", swept]) if swept is not None else p.line
            out.append(replace(p, message=p.message + context, line=line))
    return out


def _derived(doc: Any, file: str, where: _Located) -> Any:
    """The document completed by its trainer from the trainer's own configuration (``Trainer.derive``:
    Hugging Face's "auto" values resolved as its Trainer resolves them), or as it is."""
    name = doc.get("trainer", "commgate") if isinstance(doc, Mapping) else None
    trainer = TRAINERS.get(name) if isinstance(name, str) else None
    if trainer is None or trainer.derive is None:
        return doc  # (an unknown trainer is the schema's problem)
    block = trainer.name
    if trainer.options is not None and block in doc:  # derive reads a block its schema holds, or nothing
        validator = schemas.strict()(trainer.options)
        problems = [
            Problem(file=file, path=json_path([block, *parts]), message=message, line=where.line([block, *parts]))
            for err in validator.iter_errors(doc[block])
            for parts, message in _describe(err)
        ]
        if problems:
            raise ScenarioError(problems)
    try:
        trainer.require()
        try:
            return trainer.derive(doc, file)
        except ImportError as exc:  # installed, found, but its import raises (a broken install)
            raise trainer.broken(exc) from None
    except CommgateError as exc:
        raise ScenarioError([Problem(file=file, path=f"$.{name}", message=str(exc), line=where.line([name]))]) from None


MAX_FILE_BYTES = 1 << 20
"""A scenario file is at most this large (a YAML document larger than 1 MiB is not a scenario)."""


YAML11_FLOAT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")
"""A number YAML 1.1 (PyYAML) reads as a string: an exponent without a dot in the mantissa (``1e-3``), or
without its sign (``1.0e3``)."""


def _type_hint(inst: Any, wanted: list[str]) -> str:
    """How to write what was meant, where the value is one written the other way: ``2.0`` for a count,
    ``1e-3`` (a string to YAML 1.1) for a number."""
    if isinstance(inst, float) and inst.is_integer() and "integer" in wanted and abs(inst) < 1e18:
        return f" (write {int(inst)}, without the fraction)"
    if isinstance(inst, (bool, datetime.date)) and "string" in wanted:  # YAML 1.1's own readings of plain words
        read = "yes, no, on, off, true and false as booleans" if isinstance(inst, bool) else "a date as a date"
        return f" (YAML reads {read}: quote it for a string)"
    if isinstance(inst, str) and "number" in wanted and YAML11_FLOAT.fullmatch(inst.strip()):
        mantissa, _, exponent = inst.strip().lower().partition("e")
        dotted = mantissa if "." in mantissa else f"{mantissa}.0"
        signed = exponent if exponent[0] in "+-" else f"+{exponent}"  # YAML 1.1's exponent has its sign
        return f" (YAML reads {inst} as a string: write {dotted}e{signed})"
    return ""


def load_file(path: str | Path) -> list[Scenario]:
    file = str(path)
    if os.path.islink(path) and not os.path.exists(path):
        message = f"a link to {os.readlink(path)}, which does not exist; restore the file or remove the link"
        raise ScenarioError([Problem(file=file, path="$", message=message)])
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block the read, /dev/zero would fill the memory
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            message = f"{kind}, not a file; a scenario is a YAML file"
            raise ScenarioError([Problem(file=file, path="$", message=message)])
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ScenarioError([Problem(file=file, path="$", message=f"cannot read: {exc.strerror}")]) from None
    if len(data) > MAX_FILE_BYTES:
        message = f"over {MAX_FILE_BYTES:,} bytes: larger than a scenario file can be"
        raise ScenarioError([Problem(file=file, path="$", message=message)])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff"))
        what = "it starts with a UTF-16 byte-order mark" if utf16 else f"byte {exc.start} is 0x{data[exc.start]:02x}"
        message = f"not UTF-8 text ({what}); scenario files are UTF-8 YAML"
        raise ScenarioError([Problem(file=file, path="$", message=message)]) from None
    return load_text(text.removeprefix("\ufeff"), file=file)


_DECLARES = re.compile(r"""^[\s{"']*schema_version\b""", re.MULTILINE)


def declares_scenario(path: Path) -> bool:
    """Whether a YAML file declares ``schema_version`` in its first MiB (a scenario wherever it lies)."""
    from commgate.core.fsutil import text_head

    return _DECLARES.search(text_head(path, 1 << 20) or "") is not None


def not_a_scenario(path: Path) -> str | None:
    """The rule that decides the YAML file ``path`` is not a scenario file, in words (``empty``, ``binary``,
    its top level not a mapping, a mapping with none of a scenario's required keys), or None when it may be
    one: then it is loaded, and what is wrong with it is an error. Nothing is constructed (no alias expanded)."""
    from commgate.core.fsutil import text_head

    text = text_head(path, 1 << 20)
    if text is None:
        return None  # unreadable: loading it says why
    if "\x00" in text:
        return "binary (a NUL character), not YAML text"
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None  # broken YAML may be a broken scenario
    if node is None:
        return "empty (no YAML document)"
    if not isinstance(node, yaml.MappingNode):
        return f"its top level is a {'list' if isinstance(node, yaml.SequenceNode) else 'scalar'}, not a mapping"
    required = schemas.load("scenario")["required"]
    if not {k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)} & set(required):
        return f"a mapping with none of a scenario's required keys ({', '.join(sorted(required))})"
    return None


def scenario_files(paths: Iterable[str | Path]) -> list[Path]:
    """The scenario files named by ``paths`` (directories are searched recursively; a link to a missing
    file is one, whose loading says so), each once: a file named twice, or with its folder, is one file, not
    a second scenario of the same name."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out += sorted(f for f in _walk(p) if f.suffix in SCENARIO_SUFFIXES and (f.is_file() or not f.exists()))
        else:
            out.append(p)
    once: dict[Path, Path] = {}
    for f in out:
        once.setdefault(f.absolute(), f)
    return list(once.values())


NORECURSE = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")
"""The folders under a directory that are not searched: pytest's own default ``norecursedirs``, so that
``commgate validate .`` and ``pytest .`` read the same files (the CLI read ``.venv/``'s and ``.github/``'s YAML
as broken scenarios; found by an adversarial pass). A folder named on the command line is searched."""


def _walk(root: Path) -> Iterator[Path]:
    """Every entry under ``root`` that is not a directory, links to directories not followed, the folders
    ``NORECURSE`` names passed over; a directory that disappears or cannot be read during the walk (another
    job's temporary one) is passed over."""
    for where, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not any(fnmatch.fnmatch(d, pattern) for pattern in NORECURSE)]
        yield from (Path(where) / name for name in files)


def dangling(dirs: Iterable[Path]) -> list[Path]:
    """The scenario-named links under ``dirs`` whose target is missing (a scenario linked from a checkout
    that is gone): never left out in silence."""
    return sorted({f for d in dirs if d.is_dir() for f in _walk(d) if f.suffix in SCENARIO_SUFFIXES and not f.exists()})


def trainers_named(paths: Iterable[str | Path]) -> frozenset[str]:
    """The trainers the scenario files under ``paths`` name at their top level (``trainer:``), read without
    loading them (no alias expanded, nothing validated): what to start before they load (the ranks'
    forkserver, ``commgate run``), never what runs. A file that cannot be read or parsed names none."""
    from commgate.core.fsutil import text_head

    named: set[str] = set()
    for f in scenario_files(paths):
        try:
            node = yaml.compose(text_head(f, 1 << 20) or "", Loader=yaml.SafeLoader)
        except (yaml.YAMLError, RecursionError, ValueError):
            continue
        if isinstance(node, yaml.MappingNode):
            named |= {v.value for k, v in node.value if k.value == "trainer" and isinstance(v, yaml.ScalarNode)}
    return frozenset(named)


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
    problems += duplicate_ids(scenarios, {})
    if problems:
        raise ScenarioError(problems)
    return scenarios


def duplicate_ids(scenarios: Iterable[Scenario], seen: dict[str, str | None]) -> list[Problem]:
    """A problem for each scenario whose id one before it has (``seen``: id -> its file, from earlier
    files too; updated): two scenarios named alike would share one baseline and one report entry."""
    problems = []
    for s in scenarios:
        if s.id in seen:
            message = f"scenario id {s.id!r} is also defined in {seen[s.id]}"
            problems.append(Problem(file=s.file or "?", path="$.name", message=message))
        seen.setdefault(s.id, s.file)
    return problems


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
    swept: dict[str, str] = {}
    for key, values in sweep.items():
        paths = key.split("+")
        for path in paths:  # a path swept by two keys: its variants would be named by both, and run by one
            if (other := swept.setdefault(path, key)) != key or paths.count(path) > 1:
                msg = f"{path} is swept twice (also by {other!r}): sweep each path under one key"
                raise ScenarioError(
                    [Problem(file=file, path=f"$.sweep.{key}", message=msg, line=where.line(["sweep", key]))]
                )
        if len(paths) == 1:
            axes.append([[(key, v)] for v in values])
            continue
        bad = [v for v in values if not isinstance(v, list) or len(v) != len(paths)]
        if bad:
            msg = f"{_show(bad[0])}: each value of a joined key is a list of {len(paths)} values, one per path"
            raise ScenarioError(
                [Problem(file=file, path=f"$.sweep.{key}", message=msg, line=where.line(["sweep", key]))]
            )
        axes.append([list(zip(paths, v, strict=True)) for v in values])
    limit = doc.get("sweep_limit", SWEEP_LIMIT)
    if (variants := math.prod(len(a) for a in axes)) > limit:
        most = schema()["properties"]["sweep_limit"]["maximum"]
        fix = f"raise it with sweep_limit: N (at most {most:,}) if you mean it" if limit < most else "split the sweep"
        counts = " x ".join(str(len(a)) for a in axes) + " = " if len(axes) > 1 else ""
        msg = f"{counts}{variants:,} variants, more than the sweep limit {limit:,}; {fix}"
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


# --------------------------------------------------------------------------------------------- build


def _build(doc: dict[str, Any], *, file: str, where: _Located, label: str) -> tuple[Scenario | None, list[Problem]]:
    """The scenario a (sweep variant's) document describes, or None and its problems: the records built
    from it, then every consistency rule run on them."""
    problems: list[Problem] = []

    preset = doc["model"].get("preset") if isinstance(doc.get("model"), Mapping) else None
    written = set(doc["model"]) if preset else set()  # the model fields the file (or its deepspeed block) sets

    source = _deepspeed_file(doc, file)

    def bad(parts: list[Any], message: str) -> None:
        if preset and len(parts) == 2 and parts[0] == "model" and parts[1] not in written:
            message += f" ({parts[1]} is preset {preset}'s)"  # a field the file does not write: say whose
        if source is not None and len(parts) > 1 and parts[0] == "deepspeed":  # a key of the JSON file it names
            problems.append(Problem(file=str(source), path=json_path(parts[1:]), message=message, line=None))
            return
        problems.append(Problem(file=file, path=json_path(parts), message=message, line=where.line(parts)))

    ds = _deepspeed_block(doc, file, bad)
    if ds is None:
        return None, problems
    if any(dsconfig.enabled(ds, key) for key in ("bf16", "fp16")):
        written.add("dtype")  # the block's precision sets it
    _capture_dir(doc, file, bad, sweep=bool(label))
    trainer = TRAINERS[doc.get("trainer", "commgate")]
    model_doc, par_doc = _from_deepspeed(
        ds, dict(doc["model"]), dict(doc["parallelism"]), bad, accumulates=trainer.accumulates
    )
    model = _build_model(model_doc, bad)
    par = _build_parallelism(par_doc, bad)
    if model is None:
        return None, problems
    if trainer.model is not None and model.module is not None:  # the trainer builds the model it names
        model = replace(model, builder=trainer.model)
    check = Check(
        doc=doc,
        model=model,
        par=par,
        ds=ds,
        scheme=SCHEMES[par.scheme],
        schemes=SCHEMES,
        bad=bad,
        splits_stages=trainer.splits_stages,
        trainer=trainer.name,
    )
    for rule in (*rules.RULES, *RULES, *trainers.rules(trainer)):
        rule(check)
    if problems:
        return None, problems
    return _scenario(doc, model, par, ds, file=file, label=label), problems


def _capture_dir(doc: dict[str, Any], file: str, bad: Bad, *, sweep: bool) -> None:
    """The ``capture:`` directory, resolved beside the scenario file (a missing one is a problem naming it;
    what is in it is read when the scenario is judged, ``commgate.run.captured.load``). A capture is one
    job: a sweep's variants, each a different job, cannot share it."""
    path = beside(file, doc["capture"]) if "capture" in doc else None
    if path is not None and sweep:
        bad(["capture"], f"{doc['capture']!r}: a capture is one job, a sweep's variants are several; drop the sweep")
    elif path is not None and not path.is_dir():
        what = "no such directory" if not path.exists() else "not a directory"
        bad(["capture"], f"{doc['capture']!r} ({path}): {what}; give the -o directory of commgate capture")


def _deepspeed_file(doc: dict[str, Any], file: str) -> Path | None:
    """The DeepSpeed JSON file the scenario's DeepSpeed keys come from (``deepspeed: FILE``, or a trainer's
    ``hf.deepspeed``), or None where they are written in the scenario: a problem with one of its keys names
    that file and the key's path in it (it named line 1 of the scenario and a ``$.deepspeed`` path the
    scenario does not hold: found by an adversarial pass)."""
    named = doc.get("deepspeed")
    hf = doc.get("hf")
    if not isinstance(named, str) and isinstance(hf, Mapping):
        named = hf.get("deepspeed")
    return beside(file, named) if isinstance(named, str) else None


def _deepspeed_block(doc: dict[str, Any], file: str, bad: Bad) -> dict[str, Any] | None:
    """The ``deepspeed:`` block with a file it names merged in (None when it cannot be read)."""
    try:
        ds = dsconfig.load(doc.get("deepspeed", {}), scenario_file=file)
    except ValueError as exc:
        bad(["deepspeed"], str(exc))
        return None
    wrong = dsconfig.not_mappings(ds)
    for key, message in wrong:
        bad(["deepspeed", key], message)
    switches = [] if wrong else dsconfig.not_switches(ds)
    for path, message in switches:
        bad(["deepspeed", *path], message)
    return None if wrong or switches else ds


def _scenario(
    doc: dict[str, Any], model: ModelSpec, par: Parallelism, ds: dict[str, Any], *, file: str, label: str
) -> Scenario:
    markers = tuple(doc.get("markers", ()))
    backend = doc.get("backend", "auto")
    if backend == "nccl" and "gpu" not in markers:
        markers += ("gpu",)
    name = doc["name"]
    return Scenario(
        id=f"{name}[{label}]" if label else name,
        name=name,
        description=doc.get("description", ""),
        file=file,
        capture=str(beside(file, doc["capture"]).resolve()) if "capture" in doc else None,
        model=model,
        parallelism=par,
        backend=backend,
        emulate=bool(doc.get("emulate", False)),
        steps=doc.get("steps", 3),
        warmup_steps=doc.get("warmup_steps", 1),
        deadline_s=float(doc.get("deadline_s", 300.0)),
        stall_s=float(doc["stall_s"]) if "stall_s" in doc else None,
        markers=markers,
        trainer=doc.get("trainer", "commgate"),
        trainer_options=json.dumps(doc.get(doc.get("trainer", "commgate"), {}), sort_keys=True),
        workload=doc.get("workload"),
        expectations=_build_expectations(doc.get("expectations", {})),
        deepspeed=json.dumps(ds, sort_keys=True),
        warnings=(
            *dsconfig.unknown_keys(ds),
            *dsconfig.inert_keys(ds, par.zero.stage),
            *_trainer_warnings(doc),
            *_filled(ds, model, par, doc.get("trainer", "commgate")),
            *(_client_optimizer(ds) if doc.get("trainer", "commgate") == "commgate" else ()),  # commgate's own
            *(_no_engine(ds, par) if doc.get("trainer", "commgate") == "commgate" else ()),
            *(_module_checkpointing(model, par) if doc.get("trainer", "commgate") == "commgate" else ()),
        ),
        notes=tuple(doc.get("notes", ())),
    )


def _filled(ds: dict[str, Any], model: ModelSpec, par: Parallelism, trainer: str) -> tuple[str, ...]:
    """What the ``deepspeed:`` block's ``"auto"`` values become when commgate's own workloads run it (a
    trainer that resolves them itself, such as Hugging Face's, has replaced them by then)."""
    found = [".".join(path) for path in dsconfig.autos(ds)]
    if not found:
        return ()
    z = par.zero
    ours = {
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.micro_batches,
        "train_batch_size": par.dp * par.micro_batch * par.micro_batches,
        "zero_optimization.stage": z.stage,
        "zero_optimization.reduce_bucket_size": z.bucket_elements,
        "zero_optimization.allgather_bucket_size": z.bucket_elements,
        "bf16.enabled": model.dtype == "bf16",
        "fp16.enabled": model.dtype == "fp16",
    }
    filled = ", ".join(f"{key} = {ours[key]}" for key in found if key in ours)
    left = ", ".join(key for key in found if key not in ours)
    parts = [
        f"filled from the scenario: {filled}" if filled else "",
        f"left to DeepSpeed's defaults: {left}" if left else "",
    ]
    return (
        f'deepspeed "auto" values, as trainer {trainer!r} runs them: {"; ".join(p for p in parts if p)} '
        "(a Hugging Face Trainer resolves them from its TrainingArguments and the model: trainer hf)",
    )


READ_WITHOUT_ENGINE = frozenset(
    {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16", "fp16"}
)
"""The ``deepspeed:`` keys a scenario reads (``_from_deepspeed``) where no DeepSpeed engine runs it."""


def _no_engine(ds: dict[str, Any], par: Parallelism) -> tuple[str, ...]:
    """Under a scheme commgate's own workloads run on torch alone (DDP, FSDP2, tensor or context parallelism,
    torch's pipelining), the block's keys besides its batch and precision ones do nothing: said, not dropped
    in silence (an optimizer offload under DDP was taken without a word)."""
    scheme = SCHEMES[par.scheme]
    if scheme.deepspeed or (par.pipeline.engine == "deepspeed" and par.pp > 1):
        return ()
    idle = [k for k in ds if k not in READ_WITHOUT_ENGINE]
    if not idle:
        return ()
    return (
        f"deepspeed {', '.join(idle)}: scheme {par.scheme} runs on torch alone, no DeepSpeed engine: of the "
        f"block only {', '.join(sorted(READ_WITHOUT_ENGINE))} are read (the batch and the precision); the rest "
        "does nothing",
    )


def _module_checkpointing(model: ModelSpec, par: Parallelism) -> tuple[str, ...]:
    """``activation_checkpointing`` on a user's module: the switch wraps the built-in decoder's layers only;
    the module's own forward runs as it is written, in the run and in the model alike (said, not ignored in
    silence)."""
    if not (model.module and par.activation_checkpointing):
        return ()
    return (
        "parallelism.activation_checkpointing: true checkpoints the built-in decoder's layers; model.module "
        f"{model.module!r} runs its own forward as written, in the run and the prediction alike (checkpoint "
        "inside your module if you mean it)",
    )


def _client_optimizer(ds: dict[str, Any]) -> tuple[str, ...]:
    """Where commgate's own DeepSpeed workloads step another optimizer than the config names (the one
    optimizer substitution they make; it sends nothing of its own)."""
    section = ds.get("optimizer")
    if not isinstance(section, Mapping) or dsconfig.offloads_optimizer(ds):
        return ()
    return (
        f"deepspeed optimizer {section.get('type', '?')!r}: commgate's own workloads step torch's AdamW as the "
        "client optimizer, which DeepSpeed takes over the config's (an optimizer sends nothing of its own; "
        "under ZeRO-Offload the config's optimizer is DeepSpeed's to build)",
    )


def _trainer_warnings(doc: dict[str, Any]) -> tuple[str, ...]:
    """What the scenario's trainer warns of: its options' own (``Trainer.warnings``) and, where it is not
    installed, that it predicts but does not run here."""
    name = doc.get("trainer", "commgate")
    trainer = TRAINERS[name]
    own = trainer.warnings(doc) if trainer.warnings else ()
    why = trainer.unavailable()
    return own + ((f"{why} (predict works; a run is refused)",) if why else ())


def _from_deepspeed(
    ds: dict[str, Any], model: dict[str, Any], par: dict[str, Any], bad: Bad, *, accumulates: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The scenario's model and parallelism with what the DeepSpeed block states filled in; a value the
    scenario states otherwise is a problem naming both. ``accumulates``: the trainer counts the micro-batches
    (``Trainer.accumulates``), and the block's ``gradient_accumulation_steps`` does not set them."""
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

    if not accumulates and dsconfig.given(ds.get("gradient_accumulation_steps", "auto")):
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
    for key, field in (("zero_quantized_weights", "qwz"), ("zero_quantized_gradients", "qgz")):
        if zo.get(key) is False and zero.get(field) is True:
            bad(["deepspeed", "zero_optimization", key], f"False contradicts parallelism.zero.{field} = True")
    if dsconfig.given(zo.get("stage", "auto")):
        implied = SCHEMES[par["scheme"]].zero_stage if par.get("scheme") in SCHEMES else None
        stage = zero.get("stage", implied if implied is not None else 0)
        if isinstance(zo["stage"], str):  # "1": DeepSpeed's pydantic config would read it as 1
            bad(["deepspeed", "zero_optimization", "stage"], f"{zo['stage']!r} is a string; write it as a number")
        elif zo["stage"] != stage:
            named = [s.name for s in SCHEMES.values() if s.zero_stage == zo["stage"] and s.deepspeed]
            fix = (
                (
                    f"set parallelism.zero.stage: {zo['stage']} (the pipeline engine runs stage 0 or 1)"
                    if zo["stage"] in (0, 1)
                    else "DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only (it refuses 2 and 3): give 0 or 1"
                )
                if par.get("scheme") in SCHEMES and SCHEMES[par["scheme"]].pipeline
                else f"use scheme {named[0]}"
                if named
                else "make the two agree"
            )
            bad(
                ["deepspeed", "zero_optimization", "stage"],
                f"{zo['stage']} contradicts scheme {par.get('scheme')!r} (ZeRO stage {stage}); {fix}",
            )
    enabled = [key for key in ("bf16", "fp16") if dsconfig.enabled(ds, key)]
    if len(enabled) > 1:  # DeepSpeedConfig asserts it: "bfloat16 and fp16 modes cannot be simultaneously enabled"
        bad(["deepspeed", "fp16", "enabled"], "True, and bf16.enabled too: DeepSpeed runs one precision; enable one")
    for dtype in enabled[:1]:
        if model.get("dtype", dtype) != dtype:
            bad(["deepspeed", dtype, "enabled"], f"True contradicts model.dtype = {model['dtype']!r}")
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
        if (
            set(explicit) & {"L", "h", "a", "V", "architecture", "kv_heads", "ffn_hidden", "x", "qkv_bias"}
            or "preset" in m
        ):
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
