"""The published JSON Schemas (draft 2020-12): ``scenario``, ``capture``, ``report``, ``baseline``, ``bandwidth``."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any


@functools.cache
def load(name: str) -> dict[str, Any]:
    """The schema ``commgate/core/schemas/{name}.schema.json``, parsed (cached: treat it as read-only)."""
    text = resources.files("commgate.core.schemas").joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded
