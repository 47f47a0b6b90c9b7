"""Writing files so that a crash or a kill never leaves a half-written one behind, and reading JSON
documents so that a bad one is a one-line error naming the file and the place."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from commgate.core.errors import DocumentError, Problem, WriteError

CONFIG_BYTES = 16 << 20
"""A configuration file another tool reads (a DeepSpeed JSON, a Hugging Face config, a GPT-NeoX YAML, a
torchtitan TOML) is at most this large: they are a few kilobytes."""
DOCUMENT_BYTES = 1 << 30
"""A document commgate wrote (a report, a baseline, a capture) is at most this large."""


def read_bytes(path: Path, *, limit: int, what: str) -> bytes:
    """A regular file's bytes, at most ``limit`` of them: a FIFO would block the read and ``/dev/zero``
    fill the memory. Otherwise an ``OSError`` whose ``strerror`` says why in words (callers print it in one
    line as they print a missing file's)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, f"{_kind(mode)}, not a file; a {what} is a file")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"over {limit:,} bytes: larger than a {what} can be")
    return data


def _kind(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    return "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"


def read_text(path: Path, *, limit: int, what: str) -> str:
    """``read_bytes`` decoded as UTF-8 (a ``UnicodeDecodeError`` where it is not)."""
    return read_bytes(path, limit=limit, what=what).decode("utf-8")


def json_path(parts: Iterable[str | int]) -> str:
    """``$.a[0].b``: a place in a document, as every one-line error names it."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def read_json(
    path: Path,
    validate: Callable[[Any], None],
    *,
    migrate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    hint: str = "",
    mend: str = "",
    version: int | None = None,
) -> Any:
    """The one way commgate reads a JSON document: read, parse, ``migrate`` (an object, to the current
    schema version), then ``validate`` (which raises ``jsonschema.ValidationError``). Any failure is a
    ``DocumentError`` with one ``Problem`` naming the file, the place and the value; ``hint`` follows a
    parse error (how to get a good file), ``mend`` a document that is not one this commgate writes (a number
    or nesting no such file holds, not an object, a failed migration, a field the schema refuses: how to mend
    it). A document whose ``schema_version`` is past ``version`` (the one this commgate reads) is said to be
    a newer commgate's before anything else in it is checked: its other fields differ too ("1 was expected",
    or an unknown field, did not say so)."""
    import jsonschema

    def fail(where: str, message: str, line: int | None = None) -> DocumentError:
        return DocumentError([Problem(file=str(path), path=where, message=message, line=line)])

    try:
        doc = json.loads(read_text(path, limit=DOCUMENT_BYTES, what="JSON document commgate writes"))
    except OSError as exc:
        raise fail("$", f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise fail("$", f"not UTF-8 text ({exc.reason} at byte {exc.start}){hint}") from None
    except json.JSONDecodeError as exc:
        raise fail("$", f"not valid JSON ({exc.msg}){hint}", exc.lineno) from None
    except ValueError:  # a whole number past MAX_DIGITS
        raise fail(
            "$", f"a number of more than {MAX_DIGITS:,} digits, which no file commgate writes holds{mend}"
        ) from None
    except RecursionError:
        raise fail("$", f"nested too deeply{mend}") from None
    later = doc.get("schema_version") if isinstance(doc, dict) else None
    if version is not None and isinstance(later, int) and not isinstance(later, bool) and later > version:
        raise fail("$.schema_version", f"{later} is newer than this commgate reads ({version}); upgrade commgate")
    if migrate is not None:
        if not isinstance(doc, dict):
            raise fail("$", f"expected a JSON object, found {type(doc).__name__}{mend}")
        try:
            doc = migrate(doc)
        except DocumentError as exc:
            raise type(exc)([dataclasses.replace(p, message=p.message + mend) for p in exc.problems]) from None
    try:
        validate(doc)
    except jsonschema.ValidationError as exc:
        raise fail(json_path(exc.absolute_path), exc.message + mend) from None
    return doc


_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)


MAX_DIGITS = 4300
"""The longest whole number Python converts from text (``sys.get_int_max_str_digits``' default): json and
PyYAML raise a plain ``ValueError`` past it (a traceback before: found by an adversarial pass)."""


def beside(file: str | None, name: str) -> Path:
    """A path a scenario names: relative to the scenario ``file`` (a name like ``<string>`` is no file: then
    to the working directory)."""
    path = Path(name)
    if not path.is_absolute() and file and not file.startswith("<"):
        return Path(file).parent / path
    return path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object another tool reads (a DeepSpeed config, a Hugging Face ``config.json``), or a one-line
    ``ValueError`` naming the file and what it should be."""
    try:
        doc = json_once(read_text(path, limit=CONFIG_BYTES, what=what))
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    except KeyError as exc:
        raise ValueError(f"{path}: {exc.args[0]}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a {what} ({exc})") from None
    except ValueError:  # a whole number past MAX_DIGITS
        raise ValueError(f"{path}: not a {what} (a number of more than {MAX_DIGITS:,} digits)") from None
    except RecursionError:
        raise ValueError(f"{path}: not a {what} (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a {what} is a JSON object, found {type(doc).__name__}")
    return doc


def json_once(text: str) -> Any:
    """A JSON document, a key given twice in one object refused: a ``KeyError`` whose one argument names its
    place and both values (``json`` keeps the last one silently)."""
    twice: list[tuple[dict[str, Any], str, Any]] = []  # (the object, the key, its first value), kept alive

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                twice.append((obj, key, obj[key]))
            obj[key] = value
        return obj

    doc = json.loads(text, object_pairs_hook=pairs)
    if twice:  # one of them (the first found), named by its place in the document
        places = dict(_objects(doc, []))
        obj, key, first = next((t for t in twice if id(t[0]) in places), twice[0])
        where = ".".join(map(str, [*places.get(id(obj), []), key]))
        raise KeyError(
            f"{where}: given twice ({_short(first)}, then {_short(obj[key])}); JSON keeps only the last silently: "
            "give it once"
        )
    return doc


def _objects(doc: Any, place: list[str | int]) -> Iterator[tuple[int, list[str | int]]]:
    """(id, place) of every JSON object in ``doc``, in the document's order."""
    if isinstance(doc, dict):
        yield id(doc), place
        for key, value in doc.items():
            yield from _objects(value, [*place, key])
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _objects(value, [*place, i])


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_head(path: Path, limit: int) -> str | None:
    """The first ``limit`` bytes of a text file, decoded as UTF-8 or, after their byte-order mark, as
    UTF-16/32 (undecodable bytes replaced, no byte-order mark left); None when it cannot be read or is not a
    regular file (a FIFO would block the read)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with path.open("rb") as f:
            head = f.read(limit)
    except OSError:
        return None
    codec = next((codec for bom, codec in _BOMS if head.startswith(bom)), "utf-8")
    return head.decode(codec, errors="replace").lstrip("\ufeff")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, then ``os.replace``;
    through a symbolic link, which stays one (its target is replaced). A failure leaves no file behind and
    is a one-line ``WriteError`` naming ``path``."""
    path = Path(path)
    try:
        target = path.resolve() if path.is_symlink() else path
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(mode := os.stat(target).st_mode) and not stat.S_ISDIR(mode):
                # replacing it would put a regular file where a device or a FIFO was (``-o /dev/null --force``)
                raise WriteError(f"{path}: {_kind(mode)}, not a file; commgate writes files only, give a file's path")
        _replace_atomically(target, data)
    except OSError as exc:
        raise WriteError(_cannot_write(path, exc)) from None
    except RuntimeError:  # Python 3.11's pathlib on a link that leads back to itself
        raise WriteError(f"{path}: a symbolic-link loop; remove it, or give another path") from None
    return path


def _replace_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary file's name is bounded: a name near the file system's limit must not fail for its prefix
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
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


def _cannot_write(path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENAMETOOLONG:
        return f"{path}: cannot be written ({reason}); shorten the name"
    return f"{path}: cannot be written ({reason}); make {path.parent} a writable directory with free space"


def check_writable_dir(path: Path, *, what: str, fix: str) -> None:
    """Before a run spends minutes on ranks: a ``WriteError`` naming ``path`` unless ``what`` (e.g. "the
    report") can be written into the directory ``path``, existing or to be created. Creates nothing: it
    probes the nearest directory that exists with a temporary file it removes."""
    try:
        where = _nearest_existing(path, what=what, fix=fix)
        fd, probe = tempfile.mkstemp(prefix=".commgate-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise WriteError(f"{path}: cannot write {what} there ({exc.strerror or exc}); {fix}") from None


def check_outputs(folder: Path, *, files: tuple[str, ...], dirs: tuple[str, ...] = (), fix: str) -> None:
    """Before a command spends time: a one-line ``WriteError`` where a file it writes into ``folder``
    (``files``, relative paths) exists there as a directory, or a directory it writes into (``dirs``) as
    something else; a writable folder does not make those writable."""
    for name in dirs:
        if (folder / name).exists() and not (folder / name).is_dir():
            raise WriteError(f"{folder / name}: not a directory, and commgate writes into a directory there; "
                             f"remove it, or {fix}")  # fmt: skip
    for name in files:
        if (folder / name).is_dir():
            raise WriteError(f"{folder / name}: a directory where commgate writes a file; remove it, or {fix}")


def is_loop(path: Path) -> bool:
    """Whether ``path`` is a symbolic link that leads back to itself (``bd6 -> bd6`` was said to be "a link to
    bd6, which does not exist")."""
    if not path.is_symlink():
        return False
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11's pathlib: "Symlink loop from ..."
        return True
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _nearest_existing(path: Path, *, what: str, fix: str) -> Path:
    """The directory ``path`` is or would be created in; a ``WriteError`` where that is not a directory."""
    where = path
    while not where.exists():
        if where.is_symlink():  # a dangling link, the path itself or a directory above it, or a loop
            if is_loop(where):
                raise WriteError(f"{path}: cannot write {what} there: {where} is a symbolic-link loop; {fix}")
            raise WriteError(f"{path}: cannot write {what} there: {where} is a link to {os.readlink(where)}, which "
                             f"does not exist; {fix}")  # fmt: skip
        where = where.parent
    if not where.is_dir():
        raise WriteError(f"{path}: cannot write {what} there: {where} is not a directory; {fix}")
    return where


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
