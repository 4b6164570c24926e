"""The warm task host (pipelines.warm_tasks): a task forked from it is a process of its own with the
launcher's arguments, streams, folder and environment, exits as the launcher exits, dies with it, and runs
plain wherever the host cannot serve it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROBE = """
import os, sys, time
from pathlib import Path

mode = sys.argv[1]
if mode == "echo":
    import tempfile
    print(os.getcwd(), os.environ.get("PROBE_VALUE"), sys.stdin.read().strip(), os.getpid(), os.getppid())
    print(tempfile.gettempdir())
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
if mode == "atexit":
    import atexit
    atexit.register(print, "exit function ran")
    sys.stdout.write("buffered, ")  # a pipe's stdout is block-buffered: written out only as the task ends

    class Kept:  # alive until the interpreter's teardown, which a forked task skips
        def __del__(self, write=os.write):
            write(1, b"torn down")

    sys.modules["kept"] = Kept()
if mode == "raise":
    raise ValueError("the task failed")
if mode == "random":
    import numpy
    print(numpy.random.randint(1 << 30))
if mode == "frozen":
    import gc
    print(gc.get_freeze_count())
if mode == "sleep":
    Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(120)
"""


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host serving ``probe`` (a module on this test's PYTHONPATH), preloading numpy and a module that asks
    for the temp folder (as torch's import does: Python keeps the answer)."""
    from pipelines.warm_tasks import warm_task_host

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "probe.py").write_text(PROBE)
    (modules / "asks_for_tmp.py").write_text("import tempfile\ntempfile.gettempdir()\n")
    monkeypatch.setenv("PYTHONPATH", str(modules))
    log = tmp_path / "host.log"
    with warm_task_host(tmp_path / "host", log, preload=("numpy", "asks_for_tmp")) as host:
        launcher, socket_path = host.launcher, tmp_path / "host" / "task-host.sock"
        assert host.socket == socket_path
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield launcher, log, tmp_path


def _launch(launcher: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [str(launcher), "-m", "probe", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def _alive(pid: int) -> bool:
    try:  # reaped between the two looks counts as gone
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"  # a zombie has ended


def test_a_forked_task_has_the_launchers_streams_folder_environment_and_status(host):
    launcher, log, tmp_path = host
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PROBE_VALUE": "seen", "TMPDIR": str(work)}
    proc = _launch(launcher, "echo", "3", cwd=work, env=env)
    out, err = proc.communicate("from-stdin", timeout=60)
    assert proc.returncode == 3, err
    cwd, value, stdin, pid, ppid, tmp = out.split()
    assert (cwd, value, stdin, tmp) == (str(work), "seen", "from-stdin", str(work))
    assert int(pid) != proc.pid  # forked by the host, not the launcher turned into Python
    assert f"task {pid}: exit 3" in log.read_text()
    assert err.strip() == "to stderr"


def test_a_task_that_raises_prints_its_traceback_and_exits_1(host):
    launcher, _, _ = host
    proc = _launch(launcher, "raise")
    _, err = proc.communicate("", timeout=60)
    assert proc.returncode == 1
    assert "ValueError: the task failed" in err and "Traceback" in err


def test_a_task_ends_after_its_exit_functions_and_output_without_the_interpreters_teardown(host):
    launcher, _, _ = host
    proc = _launch(launcher, "atexit")
    out, err = proc.communicate("", timeout=60)
    assert proc.returncode == 0 and out == "buffered, exit function ran\n", (out, err)


def test_a_task_starts_with_the_hosts_objects_frozen_so_its_exit_collects_only_its_own(host):
    launcher, _, _ = host
    out, err = _launch(launcher, "frozen").communicate("", timeout=60)
    assert int(out) > 10_000, err  # numpy's preloaded objects, outside the task's collections


def test_forked_tasks_draw_fresh_random_numbers(host):
    launcher, _, _ = host
    drawn = {_launch(launcher, "random").communicate("", timeout=60)[0].strip() for _ in range(3)}
    assert len(drawn) == 3


def test_a_task_dies_with_its_launcher_killed(host):
    launcher, _, tmp_path = host
    pid_file = tmp_path / "task.pid"
    proc = _launch(launcher, "sleep", str(pid_file))
    task = int(_wait_for(pid_file))
    assert task != proc.pid and _alive(task)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(task):
        assert time.monotonic() < deadline, "the task outlived its launcher"
        time.sleep(0.05)


def test_sigterm_to_the_launcher_reaches_the_task_and_its_status_comes_back(host):
    launcher, _, tmp_path = host
    pid_file = tmp_path / "task.pid"
    proc = _launch(launcher, "sleep", str(pid_file))
    _wait_for(pid_file)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM


def test_a_task_with_another_pythonpath_runs_plain(host):
    launcher, log, tmp_path = host
    other = tmp_path / "other"
    other.mkdir()
    (other / "probe.py").write_text(PROBE)
    proc = _launch(launcher, "echo", "0", env={**os.environ, "PYTHONPATH": str(other)})
    out, err = proc.communicate("x", timeout=120)
    assert proc.returncode == 0, err
    assert int(out.split()[3]) == proc.pid  # the launcher became the task itself
    assert "refused : PYTHONPATH differs from the host's" in log.read_text()


def test_without_a_host_the_launcher_runs_the_task_plain(host):
    from pipelines.warm_tasks import CLIENT

    _, _, tmp_path = host
    no_host = tmp_path / "no-host"
    no_host.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {CLIENT} {tmp_path / "none"} "$@"\n')
    no_host.chmod(0o700)
    proc = _launch(no_host, "echo", "5")
    out, err = proc.communicate("x", timeout=120)
    assert proc.returncode == 5, err
    assert int(out.split()[3]) == proc.pid


def test_the_host_stops_when_its_run_ends_and_changes_nothing_of_this_process(tmp_path):
    from pipelines.warm_tasks import warm_task_host

    python, environment = sys.executable, dict(os.environ)
    with warm_task_host(tmp_path / "host", tmp_path / "host.log", preload=()) as host:
        assert host.socket == tmp_path / "host" / "task-host.sock"
        assert sys.executable == python and dict(os.environ) == environment
    assert not (tmp_path / "host" / "task-host.sock").exists()
    hosts = subprocess.run(
        ["pgrep", "-f", f"pipelines.warm_tasks {tmp_path}"], capture_output=True, text=True
    )
    assert hosts.stdout == ""


def test_turned_off_it_starts_nothing(tmp_path, monkeypatch):
    from pipelines.warm_tasks import ENABLE_ENV, warm_task_host

    monkeypatch.setenv(ENABLE_ENV, "0")
    python = sys.executable
    with warm_task_host(tmp_path / "host") as host:
        assert host is None and sys.executable == python
    assert not (tmp_path / "host").exists()


def test_a_workspace_too_deep_for_a_socket_path_is_still_served(tmp_path, monkeypatch):
    from pipelines.warm_tasks import warm_task_host

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(modules))
    deep = tmp_path.joinpath(*["a-long-folder-name"] * 6)
    with warm_task_host(deep, tmp_path / "host.log", preload=()) as host:
        launcher, socket_path = host.launcher, host.socket
        assert len(str(socket_path)) <= 100 and socket_path.parent != deep
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc = _launch(launcher, "echo", "0")
        out, err = proc.communicate("x", timeout=60)
        assert proc.returncode == 0 and int(out.split()[3]) != proc.pid, err
    assert not socket_path.parent.exists()


def test_a_run_hands_its_tasks_to_the_host_named_in_the_environment_and_starts_none(host, monkeypatch):
    from pipelines.warm_tasks import SHARED_ENV, warm_task_host

    launcher, log, tmp_path = host
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "host" / "task-host.sock"))
    with warm_task_host(tmp_path / "run", tmp_path / "run.log") as handed:
        assert handed.socket == tmp_path / "host" / "task-host.sock" and handed.launcher != launcher
        proc = _launch(handed.launcher, "echo", "0")
        out, err = proc.communicate("x", timeout=60)
    assert proc.returncode == 0, err
    assert f"task {out.split()[3]}: exit 0" in log.read_text()  # forked by the host that was running
    assert (tmp_path / "run.log").read_text().startswith("tasks handed to the host at")
    hosts = subprocess.run(["pgrep", "-f", f"pipelines.warm_tasks {tmp_path / 'run'}"], capture_output=True)
    assert hosts.stdout == b""


def test_a_launcher_gone_mid_request_or_before_the_answer_leaves_the_host_serving(host):
    """A request cut short is refused; a launcher gone before the host's answer has its task ended."""
    import json
    import socket
    import struct

    launcher, log, tmp_path = host
    argv = ["-m", "probe", "sleep", str(tmp_path / "pid")]
    request = json.dumps({"argv": argv, "cwd": str(tmp_path), "env": dict(os.environ)}).encode()
    for sent, logged in ((request[:10], "refused a launcher"), (request, ": exit -9")):
        with open(os.devnull, "r+") as null, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(tmp_path / "host" / "task-host.sock"))
            socket.send_fds(conn, [b"F"], [null.fileno()] * 3)
            conn.sendall(struct.pack("!I", len(request)) + sent)  # and gone before the host's answer
        deadline = time.monotonic() + 60
        while logged not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    proc = _launch(launcher, "echo", "0")
    out, err = proc.communicate("x", timeout=60)
    assert proc.returncode == 0 and int(out.split()[3]) != proc.pid, err  # forked by the same host
