"""The published JSON Schemas (draft 2020-12): ``scenario``, ``capture``, ``report``, ``baseline``, ``bandwidth``.

``validator(name)`` is the one validator of each (cross-references such as the report's ``capture``
resolve among these files); ``validate(name, doc)`` raises ``jsonschema.ValidationError``.
"""

from __future__ import annotations

import functools
import json
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
    import jsonschema
    from referencing import Registry, Resource

    registry: Registry[Any] = Registry().with_resources(
        (load(n)["$id"], Resource.from_contents(load(n))) for n in NAMES if n != name
    )
    return jsonschema.Draft202012Validator(load(name), registry=registry)


def validate(name: str, doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is valid against schema ``name``."""
    validator(name).validate(doc)
