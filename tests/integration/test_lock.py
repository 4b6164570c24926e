"""One process per workspace: the second run is refused at once, naming the holder; kill -9 frees the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

HOLD = """
import sys, time
from components.state.lock import workspace_lock
with workspace_lock(sys.argv[1], "test holder"):
    print("held", flush=True)
    time.sleep(120)
"""


def _hold(workspace: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workspace)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_naming_the_first_and_kill_9_releases(tmp_path):
    from components.state.lock import WorkspaceBusy, workspace_lock

    holder = _hold(tmp_path)
    try:
        with pytest.raises(WorkspaceBusy, match=rf"test holder \(pid {holder.pid} on "):
            with workspace_lock(tmp_path, "second"):
                pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with workspace_lock(tmp_path, "after the kill") as me:  # no stale lock to delete
        assert me["pid"] == os.getpid()


def test_concurrent_compatflow_run_exits_within_seconds_naming_the_holder(tmp_path):
    from pipelines.config import CONFIG_DIR

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    config["workspace"] = str(tmp_path / "ws")
    config["stream"]["uri"] = str(tmp_path / "ws" / "stream")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    holder = _hold(tmp_path / "ws")
    try:
        started = time.monotonic()
        exe = Path(sys.executable).with_name("compatflow")
        done = subprocess.run(
            [str(exe), "run", "--config", str(tmp_path / "c.yaml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and time.monotonic() - started < 30
        assert f"pid {holder.pid}" in done.stderr and "is in use by test holder" in done.stderr
        assert not (tmp_path / "ws" / "stream").exists()  # refused before doing anything
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_run_ids_started_in_one_second_differ():
    from components.runs import new_run_id

    assert len({new_run_id(3) for _ in range(50)}) == 50


STEP = """
import sys, time
from components.state.lock import step_lock
with step_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_step_outliving_its_runner_keeps_the_workspace_busy(tmp_path):
    from components.state.lock import WorkspaceBusy, workspace_lock

    step = subprocess.Popen([sys.executable, "-c", STEP, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert step.stdout.readline().strip() == "held"
    try:
        with pytest.raises(WorkspaceBusy, match="a step of an earlier run is still running"):
            with workspace_lock(tmp_path, "next run"):
                pass
    finally:
        os.kill(step.pid, signal.SIGKILL)
        step.wait()
    with workspace_lock(tmp_path, "next run"):
        pass
