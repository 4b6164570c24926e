"""The one atomic writer: whole files or none, created like any other file (the process's umask)."""

from __future__ import annotations

import os
import stat

import pytest

from compat.io import atomic_write, write_json_atomic


def test_written_files_follow_the_umask(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "doc.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_text() == '{\n  "a": 1\n}\n'


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "doc.txt"
    path.write_text("old")

    def half_then_fail(tmp) -> None:
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old" and not list(tmp_path.glob(".doc.txt.*"))
    with pytest.raises(ValueError):  # strict JSON: no NaN
        write_json_atomic(path, {"x": float("nan")})
    assert path.read_text() == "old"


def test_a_write_reaches_the_disk_before_and_after_the_rename(tmp_path, monkeypatch) -> None:
    """The file's bytes are synced before it replaces the old one, and the folder after the rename."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = write_json_atomic(tmp_path / "state.json", {"a": 1})
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".state.json."))
    assert synced[1] == str(tmp_path) and path.read_text() == '{\n  "a": 1\n}\n'
