"""Atomic writes: complete file or the old one, never half of one; canonical JSON."""

import json
import os
import stat
from pathlib import Path
from unittest import mock

import pytest
from commgate.core.errors import WriteError
from commgate.core.fsutil import atomic_write_json, atomic_write_text, check_writable_dir, dumps


def test_writes_canonical_json(tmp_path: Path) -> None:
    path = atomic_write_json(tmp_path / "sub" / "a.json", {"b": 1, "a": [1, 2]})
    text = path.read_text()
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n' == dumps({"a": [1, 2], "b": 1})
    assert json.loads(text) == {"a": [1, 2], "b": 1}


def test_a_failure_while_writing_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "baseline.json"
    target.write_text("old\n")
    full = OSError(28, "No space left on device")
    with mock.patch("os.fsync", side_effect=full), pytest.raises(WriteError) as info:
        atomic_write_text(target, "new\n")
    assert str(info.value) == (
        f"{target}: cannot be written (No space left on device); make {tmp_path} a writable directory with free space"
    )
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "x.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_write_under_a_regular_file_is_one_line_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteError, match=r"^\S*/file/sub/a\.json: cannot be written \(Not a directory\); make .*$"):
        atomic_write_text(tmp_path / "file" / "sub" / "a.json", "x")


def test_a_name_too_long_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(WriteError, match=r"cannot be written \(File name too long\); shorten the name$"):
        atomic_write_text(tmp_path / ("x" * 300), "x")


def test_a_write_through_a_symbolic_link_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert atomic_write_text(link, "new\n") == link
    assert link.is_symlink() and link.resolve() == target and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["link.json", "real.json", "store"]  # no temporary


def test_a_directory_that_cannot_be_written_is_refused_before_a_run(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # it was "a link to .../loop, which does not exist"
    check_writable_dir(tmp_path / "new" / "deeper", what="the report", fix="give another --report-dir")
    assert not (tmp_path / "new").exists() and len(list(tmp_path.iterdir())) == 3  # it creates nothing
    expected = {
        "file": f"{tmp_path}/file: cannot write the report there: {tmp_path}/file is not a directory; give another "
        "--report-dir",
        "file/sub": f"{tmp_path}/file/sub: cannot write the report there: {tmp_path}/file is not a directory; give "
        "another --report-dir",
        "dangling": f"{tmp_path}/dangling: cannot write the report there: {tmp_path}/dangling is a link to "
        f"{tmp_path}/gone, which does not exist; give another --report-dir",
        "loop": f"{tmp_path}/loop: cannot write the report there: {tmp_path}/loop is a symbolic-link loop; give "
        "another --report-dir",
    }
    for name, message in expected.items():
        with pytest.raises(WriteError) as info:
            check_writable_dir(tmp_path / name, what="the report", fix="give another --report-dir")
        assert str(info.value) == message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: nothing to refuse")
def test_a_read_only_directory_is_refused_before_a_run(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(WriteError, match=r"/ro/baselines: cannot write baselines there \(Permission denied\); fix$"):
        check_writable_dir(ro / "baselines", what="baselines", fix="fix")


@pytest.mark.parametrize("kind", ["fifo", "device", "link to a fifo"])
def test_a_device_or_fifo_is_never_replaced_by_a_file(tmp_path: Path, kind: str) -> None:
    """``commgate import ... -o /dev/null --force`` (the message for an existing output says to give
    ``--force``): the atomic write renamed a regular file over the device node, as root ``/dev/null`` itself
    (found by an adversarial pass, on a copy of it). A FIFO likewise, its reader left blocked."""
    target = tmp_path / "out"
    if kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    else:
        os.mkfifo(tmp_path / "fifo")
        if kind == "fifo":
            (tmp_path / "fifo").rename(target)
        else:
            target.symlink_to(tmp_path / "fifo")
    before = os.stat(target).st_mode
    with pytest.raises(WriteError) as info:
        atomic_write_text(target, "scenario\n")
    assert str(info.value).startswith(f"{target}: a ") and "not a file; commgate writes files only" in str(info.value)
    assert os.stat(target).st_mode == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"out"} | ({"fifo"} if kind == "link to a fifo" else set())
    )


def test_a_number_python_will_not_read_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """A whole number past Python's 4,300 digits made ``json`` raise a plain ``ValueError``, not a
    ``JSONDecodeError``: a baseline, a rank's capture or a report read that way was a traceback, and a DeepSpeed
    JSON's error did not name the file (found by an adversarial pass)."""
    from commgate.core.errors import DocumentError
    from commgate.core.fsutil import read_json, read_json_object

    bad = tmp_path / "b.json"
    bad.write_text('{"elements": ' + "7" * 5000 + "}")
    with pytest.raises(DocumentError) as info:
        read_json(bad, lambda doc: None, hint=": a hint for a truncated file")
    assert str(info.value) == f"{bad}: $: a number of more than 4,300 digits, which no file commgate writes holds"
    with pytest.raises(ValueError, match=r"b\.json: not a DeepSpeed JSON config \(a number of more than 4,300 dig"):
        read_json_object(bad, "DeepSpeed JSON config")
