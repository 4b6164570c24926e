"""Commands run as root touch only their own folders: no link followed under the folders compatflow makes for
itself, `pipeline rehearse --root` only on a folder a rehearsal made (`--fresh` deletes nothing else), its
ownership changes never through a link, and `report` writes only into a run folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compat.io import LinkedFolderError, own_folder, write_in
from pipelines.cli import app
from pipelines.rehearsal import CHECKOUT, MARKER, RehearsalError, _own_tree, claim_root
from pipelines.warm_tasks import ENABLE_ENV, warm_task_host


def victim(tmp_path: Path) -> Path:
    """Someone else's folder, holding a file a link will point at."""
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    (other / "task-python").write_text("keep")
    return other


@pytest.mark.parametrize("linked", ["tmp", "tmp/task-host"])
def test_a_linked_task_host_folder_is_refused_and_nothing_behind_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: str
) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    other, ws = victim(tmp_path), tmp_path / "ws"
    (ws / linked).parent.mkdir(parents=True, exist_ok=True)
    (ws / linked).symlink_to(other if linked.endswith("task-host") else tmp_path)
    if linked == "tmp":
        (tmp_path / "task-host").symlink_to(other)
    with pytest.raises(LinkedFolderError, match=f"{ws / linked} is a symbolic link"):
        with warm_task_host(ws / "tmp" / "task-host"):
            pass
    assert (other / "task-python").read_text() == "keep" and other.stat().st_mode & 0o777 == 0o755


def test_a_file_written_in_an_own_folder_replaces_a_link_not_its_target(tmp_path: Path) -> None:
    other = victim(tmp_path)
    fd = own_folder(tmp_path, "ws", "tmp")
    try:
        (tmp_path / "ws" / "tmp" / "task-python").symlink_to(other / "task-python")
        write_in(fd, "task-python", b"#!/bin/sh\n", 0o700)
    finally:
        os.close(fd)
    launcher = tmp_path / "ws" / "tmp" / "task-python"
    assert not launcher.is_symlink() and launcher.read_bytes() == b"#!/bin/sh\n"
    assert (other / "task-python").read_text() == "keep"


@pytest.mark.parametrize("root", ["/", "/etc", "/home", "~", str(CHECKOUT), str(CHECKOUT.parent)])
def test_rehearse_refuses_a_root_that_is_not_a_folder_of_its_own(root: str) -> None:
    with pytest.raises(RehearsalError, match="must be a folder of its own"):
        claim_root(root, fresh=True)


def test_fresh_deletes_only_a_folder_a_rehearsal_made(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    for fresh in (True, False):
        with pytest.raises(RehearsalError, match=f"holds files no rehearsal made \\(no {MARKER}"):
            claim_root(theirs, fresh=fresh)
    assert (theirs / "notes.txt").read_text() == "mine"
    made = claim_root(tmp_path / "rehearsal")
    assert (made / MARKER).is_file()
    (made / "stream").mkdir()
    assert claim_root(made) == made and (made / "stream").is_dir()  # kept: the next phases ship
    assert (
        claim_root(made, fresh=True) == made and not (made / "stream").exists() and (made / MARKER).is_file()
    )


def test_ownership_is_given_to_links_never_through_them(tmp_path: Path) -> None:
    other, volume = victim(tmp_path), tmp_path / "workspace"
    volume.mkdir()
    (volume / "x").symlink_to(other / "task-python")
    (volume / "d").symlink_to(other)
    before = os.stat(other / "task-python")
    _own_tree(volume, 10001, 10001, read_only=True)
    after = os.stat(other / "task-python")
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    assert os.lstat(volume / "x").st_uid == 10001 and os.stat(volume).st_uid == 10001
    with pytest.raises(RehearsalError, match="is a symbolic link"):
        _own_tree(volume / "d", 10001, 10001)


def test_report_writes_only_into_a_run_folder(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    result = CliRunner().invoke(app, ["report", str(folder), "--workspace", str(tmp_path / "ws")])
    assert result.exit_code == 2 and "is not a run folder" in result.output
    assert list(folder.iterdir()) == []
