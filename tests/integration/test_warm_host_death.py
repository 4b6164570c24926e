"""The warm task host killed while a task runs: the task ends with it, and the run's failure names the step
kfp.local ran (``sleeper``), with the launcher's word that the host died, not "failed step: unknown"."""

# No "from __future__ import annotations": KFP reads the component's annotations at run time.

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest


@pytest.fixture
def sleepy_pipeline():
    from kfp import dsl

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def sleeper_op(path: str) -> str:
        import os
        import time
        from pathlib import Path

        Path(path).write_text(str(os.getpid()))
        time.sleep(120)
        return "done"

    @dsl.pipeline
    def sleepy(path: str) -> None:
        sleeper_op(path=path)

    return sleepy


def _kill_host_when(started: Path, host_pids: list[int]) -> None:
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in host_pids:
        os.kill(pid, signal.SIGKILL)


def test_the_host_dying_mid_task_names_the_failed_step(tmp_path: Path, monkeypatch, sleepy_pipeline) -> None:
    import psutil
    from kfp import local

    from pipelines.local_runner import _failure_of
    from pipelines.warm_tasks import ENABLE_ENV, on_host, warm_task_host

    monkeypatch.setenv(ENABLE_ENV, "1")
    started, log = tmp_path / "started", tmp_path / "pipeline.log"
    with warm_task_host(tmp_path / "ws" / "tmp" / "task-host", preload=()) as task_host:
        socket_path = task_host.socket  # a deep temp folder puts it in a short one under /tmp
        deadline = time.monotonic() + 60
        while not socket_path.exists():  # served by the host, not run plain
            assert time.monotonic() < deadline, f"the warm host never listened on {socket_path}"
            time.sleep(0.05)
        children = [c for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE]
        host = [c.pid for c in children if str(socket_path) in c.cmdline()]  # not the session's own host
        assert len(host) == 1
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
        killer = threading.Thread(target=_kill_host_when, args=(started, host))
        killer.start()
        with open(log, "w") as out, contextlib.redirect_stdout(out), pytest.raises(RuntimeError) as failed:
            on_host(sleepy_pipeline, task_host)(path=str(started))
        killer.join()
    failure = _failure_of(tmp_path, log, failed_task=str(failed.value))
    assert failure["step"] == "sleeper" and failure["error"]["type"] == "TaskHostDied", failure
