"""The published JSON Schemas (draft 2020-12): ``scenario``, ``capture``, ``report``, ``baseline``, ``bandwidth``.

``validator(name)`` is the one validator of each (cross-references such as the report's ``capture``
resolve among these files); ``validate(name, doc)`` raises ``jsonschema.ValidationError``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jsonschema

NAMES = ("scenario", "capture", "report", "baseline", "bandwidth")


@functools.cache
def load(name: str) -> dict[str, Any]:
    """The schema ``commgate/core/schemas/{name}.schema.json``, parsed (cached: treat it as read-only)."""
    text = resources.files("commgate.core.schemas").joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@functools.cache
def validator(name: str) -> jsonschema.protocols.Validator:
    from referencing import Registry, Resource

    registry: Registry[Any] = Registry().with_resources(
        (load(n)["$id"], Resource.from_contents(load(n))) for n in NAMES if n != name
    )
    return strict()(load(name), registry=registry)


def _whole(checker: Any, instance: Any) -> bool:
    """An integer as Python counts one: JSON Schema counts ``2.0`` an integer too, but what a scenario counts
    (ranks, layers, steps) is ranged over and indexed, where ``2.0`` fails far from the file that wrote it."""
    return isinstance(instance, int) and not isinstance(instance, bool)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    """``pattern`` with ECMA-262's ``$`` (JSON Schema's dialect): the end of the string. Python's ``$`` also
    matches before a final newline, which let ``name: "abc\n"`` through to a file name and a console line."""
    import jsonschema

    if not isinstance(instance, str):
        return
    python = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    if re.search(python, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.cache
def strict() -> type[jsonschema.protocols.Validator]:
    """Draft 2020-12 as people mean what they write (scenarios, trainers' option blocks): ``integer`` is a
    whole number written without a fraction, and a pattern's ``$`` is the end of the string."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine("integer", _whole)
    extended: type[jsonschema.protocols.Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        base, validators={"pattern": _pattern}, type_checker=checker
    )
    return extended


def validate(name: str, doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is valid against schema ``name``."""
    validator(name).validate(doc)
