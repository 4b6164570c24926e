"""A full disk under a run (a real 256 KiB tmpfs, filled): the run's own log stops being written but the
run goes on and ends like any failed step, a step's error is not buried under the disk's, and what to do
next says to free space (a run resumes where it stopped)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a tmpfs with no space left (root only: mounting needs it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        run_dir = mount / "runs" / "phase-01"
        run_dir.mkdir(parents=True)
        (run_dir / "outcome.json").write_text(json.dumps({"status": "failed"}))
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield run_dir
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_the_run_log_on_a_full_disk_keeps_the_terminal_and_says_what_happened(full_disk: Path) -> None:
    from pipelines.local_runner import _EchoingLog, _failure_of

    terminal = io.StringIO()
    log = _EchoingLog(open(full_disk / "pipeline.log", "w", buffering=1), terminal)
    log.write("12:00:00 - INFO - Executing task 'validate-op'\n")  # line-buffered: written at once
    log.write("more\n")
    log.close_file()
    assert isinstance(log.error, OSError) and log.error.errno == errno.ENOSPC
    assert "Executing task" in terminal.getvalue()  # the terminal still follows the run

    failure = _failure_of(full_disk, full_disk / "pipeline.log", log.error)  # no step recorded one
    assert failure["error"]["type"] == "OSError" and "No space left" in failure["unwritten"]
    assert failure["next_action"].startswith("the disk is full: free space")


def test_a_step_failing_on_a_full_disk_raises_its_own_error(full_disk: Path, tmp_path: Path) -> None:
    from components.deployment import Deployment
    from components.runs import disk_full
    from components.steps.base import step

    @step("drift")
    def broken(deployment, run_dir):
        raise ValueError("the reference sample is empty")

    with pytest.raises(ValueError, match="reference sample is empty") as raised:
        broken(Deployment(workspace=str(tmp_path / "ws")), full_disk)
    assert raised.value.__context__ is None and not disk_full(raised.value)  # not chained to ENOSPC
    assert not (full_disk / "failure.json").exists()  # it could not be written, and that is all


def test_a_step_that_hits_the_full_disk_is_told_to_free_space(full_disk: Path) -> None:
    from components.runs import record_failure

    with pytest.raises(OSError) as raised:
        (full_disk / "checkpoint.safetensors").write_bytes(b"\0" * 65536)
    assert raised.value.errno == errno.ENOSPC
    document = record_failure(full_disk, "continual", raised.value)
    assert document.error.type == "OSError"
    assert document.next_action.startswith("the disk is full: free space")
