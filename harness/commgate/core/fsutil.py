"""Writing files so that a crash or a kill never leaves a half-written one behind, and reading JSON
documents so that a bad one is a one-line error naming the file and the place."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commgate.core.errors import CommgateError


def read_json(path: Path, validate: Callable[[Any], None], *, hint: str = "") -> Any:
    """The JSON document at ``path`` after ``validate`` (which raises ``jsonschema.ValidationError``);
    ``CommgateError`` with one line otherwise (``hint`` follows a parse error: how to get a good file)."""
    import jsonschema

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        validate(doc)
    except OSError as exc:
        raise CommgateError(f"{path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CommgateError(f"{path}: not JSON ({exc}){hint}") from None
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise CommgateError(f"{path}: {where}: {exc.message}") from None
    return doc


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def dumps(doc: Any) -> str:
    """Canonical JSON: sorted keys, indent 2, trailing newline."""
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def atomic_write_json(path: str | Path, doc: Any) -> Path:
    return atomic_write_text(path, dumps(doc))
