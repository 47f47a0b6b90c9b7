"""Atomic writes: complete file or the old one, never half of one; canonical JSON."""

import json
import os
import stat
from pathlib import Path
from unittest import mock

import pytest
from commgate.core.fsutil import atomic_write_json, atomic_write_text, dumps


def test_writes_canonical_json(tmp_path: Path) -> None:
    path = atomic_write_json(tmp_path / "sub" / "a.json", {"b": 1, "a": [1, 2]})
    text = path.read_text()
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n' == dumps({"a": [1, 2], "b": 1})
    assert json.loads(text) == {"a": [1, 2], "b": 1}


def test_a_failure_while_writing_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "baseline.json"
    target.write_text("old\n")
    with mock.patch("os.fsync", side_effect=OSError("disk full")), pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "x.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
