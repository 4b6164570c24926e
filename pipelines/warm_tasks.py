"""A warm task host for the local runner: each pipeline task forked from a process whose imports are done.

Under ``kfp.local`` every task is a new Python that imports torch, MLflow, Feast... first: seconds a task.
The host imports :data:`PRELOAD` once per run and serves each task as a fork of itself, reached by a tiny
launcher (:mod:`pipelines.task_client`) over a Unix socket. A task it cannot serve runs as a plain process,
so the host only saves time; ``COMPATFLOW_WARM_TASKS=0`` turns it off and a cluster never uses it. The host
runs no Python thread before forking, and a child's random generators are seeded afresh.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from compat.io import own_folder, write_in
from compat.proc import status_mib

ENABLE_ENV = "COMPATFLOW_WARM_TASKS"
SHARED_ENV = "COMPATFLOW_TASK_HOST"  # the socket of a host that outlives runs: they hand it their tasks
SOCKET_NAME = "task-host.sock"
SOCKET_PATH_MAX = 100  # bytes: a Unix socket's path must fit sun_path (108 on Linux)
CLIENT = Path(__file__).with_name("task_client.py")

# What the steps import, in the order of the pipeline's tasks (step modules import their libraries lazily,
# so both are named).
PRELOAD = (
    "kfp.dsl.executor_main",
    "components.steps",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store",
    "mlflow.pyfunc",
    "components.adapters.registry",
    "great_expectations",
    "components.data.validation",
    "evidently",
    "plotly.graph_objects",
    "components.data.drift",
    "torch",
    "open_clip",
    "webdataset",
    "components.training.continual",
    "compat.training",
    "compat.compat_training",
    "components.training.evaluate",
    "pymilvus",
    "components.adapters.index",
    "components.rollout",
    "components.rollout.workers",
    "feast.feature_store",
    "feast.infra.online_stores.milvus_online_store.milvus",
    "feast.infra.offline_stores.dask",
    "milvus_lite",
    "components.adapters.lineage",
    "components.report",
    "matplotlib.pyplot",
    "components.report.plots",
)
# Environment read when the interpreter starts, not when a module runs: a task whose differs runs plain.
STARTUP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONHASHSEED")


@dataclasses.dataclass(frozen=True)
class TaskHost:
    launcher: Path  # the ``python`` the tasks are started with (it knows the socket)
    socket: Path


@contextlib.contextmanager
def warm_task_host(
    folder: Path, log_path: Path | None = None, preload: Sequence[str] = PRELOAD
) -> Iterator[TaskHost | None]:
    """A warm host for the ``with`` body (None when off), logging to ``log_path`` (``folder/host.log``);
    it stops taking tasks when the body ends and exits when its last task has. With ``$COMPATFLOW_TASK_HOST``
    set, the host listening there (started by another ``with``, which it outlives) serves the body instead,
    its imports made once for every run it serves and its log its own."""
    if os.environ.get(ENABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        yield None
        return
    folder = Path(folder)
    folder.parent.parent.mkdir(parents=True, exist_ok=True)
    folder_fd = own_folder(folder.parent.parent, folder.parent.name, folder.name)  # no link followed there
    shared = os.environ.get(SHARED_ENV)
    socket_path = Path(shared) if shared else folder / SOCKET_NAME
    if not shared and len(os.fsencode(socket_path)) > SOCKET_PATH_MAX:  # a deep workspace: a short folder
        short = "/tmp" if os.path.isdir("/tmp") else None  # not $TMPDIR: a run points it into the workspace
        socket_path = Path(tempfile.mkdtemp(prefix="compatflow-tasks-", dir=short)) / SOCKET_NAME
    launcher = folder / "task-python"
    python, client, sock = (shlex.quote(str(part)) for part in (sys.executable, CLIENT, socket_path))
    try:
        script = f'#!/bin/sh\nexec {python} -I -S {client} {sock} "$@"\n'
        write_in(folder_fd, launcher.name, script.encode(), 0o700)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        log_fd = os.open(os.path.abspath(log_path or folder / "host.log"), flags, 0o600, dir_fd=folder_fd)
    finally:
        os.close(folder_fd)
    log = os.fdopen(log_fd, "ab")
    if shared:
        with log:
            log.write(
                f"tasks handed to the host at {socket_path} (${SHARED_ENV}), which logs them\n".encode()
            )
        yield TaskHost(launcher, socket_path)
        return
    socket_path.unlink(missing_ok=True)
    host = start_host(socket_path, log, preload)
    try:
        yield TaskHost(launcher, socket_path)
    finally:
        assert host.stdin is not None
        host.stdin.close()  # the host stops taking tasks and exits once its last task has
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
        log.close()
        if socket_path.parent != folder:
            shutil.rmtree(socket_path.parent, ignore_errors=True)


def start_host(
    socket_path: Path, log: Any, preload: Sequence[str] = PRELOAD, launch: Sequence[str] = (), **popen: Any
) -> subprocess.Popen:
    """A host process at ``socket_path`` (``launch``: the command it runs under), logging to ``log``; closing
    its stdin makes it stop taking tasks and exit once its last task has."""
    argv = [*launch, sys.executable, "-m", "pipelines.warm_tasks", str(socket_path), ",".join(preload)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, **popen)


def on_host(pipeline: Any, host: TaskHost | None, env: Mapping[str, str] | None = None) -> Any:
    """``pipeline`` with its tasks started by ``host``'s launcher (None: as is) and given ``env``."""
    import yaml
    from kfp import compiler, components

    with tempfile.TemporaryDirectory() as folder:  # the package KFP writes, its pipeline spec changed
        package = Path(folder) / "pipeline.yaml"
        compiler.Compiler().compile(pipeline, str(package))
        spec = next(yaml.safe_load_all(package.read_text()))
    for executor in spec["deploymentSpec"]["executors"].values():
        container = executor.get("container", {})
        if host is not None:
            start = f"{shlex.quote(str(host.launcher))} -m kfp.dsl.executor_main"
            container["command"] = [
                part.replace("python3 -m kfp.dsl.executor_main", start) for part in container["command"]
            ]
        container["env"] = container.get("env", []) + [
            {"name": k, "value": v} for k, v in (env or {}).items()
        ]
    return components.load_component_from_text(yaml.safe_dump(spec))


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The launcher's streams and its request (a cut-short one fails to parse: ValueError)."""
    conn.settimeout(10)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    with conn.makefile("rb") as stream:
        head = stream.read(4)
        body = stream.read(struct.unpack("!I", head)[0]) if len(head) == 4 else b""
    conn.settimeout(None)
    return json.loads(body), fds


def _run_task(request: dict, fds: list[int]) -> int:
    """In the forked child: become the task and run it; the exit status ``python -m MODULE`` would have."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    preloaded, host_log = set(sys.modules), os.dup(1)  # the host's log: what the task imported itself
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the task's TMPDIR, not the folder the host's imports asked for and Python kept
    if "numpy" in sys.modules:  # seeded afresh, as a new process is (random reseeds itself at fork)
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    import runpy

    sys.argv = [request["argv"][1], *request["argv"][2:]]
    code = 1
    try:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter ends: an int is the status, anything else is printed
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if code and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    imported = set(sys.modules) - preloaded  # what PRELOAD could still hold
    tops = sorted({name.split(".", 1)[0] for name in imported if not name.startswith("ephemeral_component")})
    line = f"task {os.getpid()}: imported {len(imported)} modules itself ({', '.join(tops[:12]) or 'none'})\n"
    with contextlib.suppress(OSError):
        os.write(host_log, line.encode())
        os.close(host_log)
    return code


class _Host:
    """The host's loop, one thread: preloads while no launcher waits, forks a task per launcher, tells each
    its task's exit status, and ends once stdin closes and its last task has ended."""

    def __init__(self, socket_path: Path, preload: Sequence[str]) -> None:
        self.socket_path = socket_path
        self.pending = list(preload)
        self.started = time.monotonic()
        self.tasks: dict[int, socket.socket] = {}
        self.accepting = True
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(socket_path))
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()  # SIGCHLD wakes the selector
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(sys.stdin, selectors.EVENT_READ, self._parent)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._woken)

    def run(self) -> tuple[dict, list[int]] | None:
        """None in the host once it ends; in a forked child, the task to become (the host's files closed)."""
        while self.accepting or self.tasks:
            events = self.selector.select(timeout=0 if self.pending else 1.0)
            for key, _ in events:
                task = key.data(key.fileobj)
                if task is not None:
                    return task
            self._reap()
            if self.pending and not events:
                self._preload_next()

    def _preload_next(self) -> None:
        name, start = self.pending.pop(0), time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module that cannot load here is loaded by the task that needs it
            print(f"preload {name}: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"preload {name}: {time.monotonic() - start:.2f} s", flush=True)
        if not self.pending:  # the threads: Python's and the libraries' own (BLAS pools, jemalloc)
            threads = []
            with contextlib.suppress(OSError):
                tasks = sorted(os.listdir("/proc/self/task"))
                threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
            print(
                f"preloaded in {time.monotonic() - self.started:.1f} s, "
                f"{status_mib('VmRSS') or 0:.0f} MiB resident, threads: {', '.join(threads)}",
                flush=True,
            )

    def _accept(self, _listener: object) -> tuple[dict, list[int]] | None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError) as exc:
            print(f"refused a launcher: {exc}", flush=True)
            conn.close()
            return None
        differs = [name for name in STARTUP_ENV if request["env"].get(name) != os.environ.get(name)]
        refusal = f"{differs[0]} differs from the host's" if differs else None
        # Libraries' own pools (BLAS, jemalloc) are fork-safe by their atfork handlers; a Python thread is not
        # (it may hold a lock the child then waits on forever).
        if refusal is None and threading.active_count() != 1:
            refusal = f"Python threads {[t.name for t in threading.enumerate()]}"
        if refusal is not None:
            print(f"refused {_function_of(request['argv'])}: {refusal}", flush=True)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        # The preloaded objects leave the collector's view (gc.freeze, as its docs advise before a fork): a
        # task's pages stay shared, and its interpreter's exit collects only its own objects (5 s less).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            for own in (self.listener, self.selector, conn, *self.tasks.values()):
                own.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            return request, fds
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # a launcher gone already: its connection's end kills the task
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.tasks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, functools.partial(self._launcher, pid))
        print(f"task {pid}: {_function_of(request['argv'])} ({len(self.pending)} preloads to go)", flush=True)
        return None

    def _parent(self, stdin: object) -> None:
        if os.read(sys.stdin.fileno(), 4096):
            return
        self.accepting = False  # the run ended (or died): take no more tasks, import no more
        self.pending.clear()
        for fileobj in (self.listener, sys.stdin):
            self.selector.unregister(fileobj)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _woken(self, _fd: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 4096)

    def _launcher(self, pid: int, conn: socket.socket) -> None:
        """Task ``pid``'s launcher connection is readable: EOF is its death, and the task dies with it."""
        with contextlib.suppress(OSError):
            if conn.recv(64):
                return
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.tasks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.tasks.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            print(f"task {pid}: exit {code}", flush=True)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            conn.close()


def _function_of(argv: list[str]) -> str:
    return argv[argv.index("--function_to_execute") + 1] if "--function_to_execute" in argv else ""


_TASK_STATUS: list[int] = []  # in a forked task once it has run: the status it exits with


def _end_task_without_teardown() -> None:
    """A forked task's last exit function (the host registers it before any other; they run last registered
    first): the task's own have run, so its streams and logging are flushed and it ends with ``os._exit``, as
    the ``os`` docs advise for a child after ``fork()``. Tearing the host's preloaded objects down would free,
    and so first copy, every page of them: a second a task. The host itself exits the usual way."""
    if not _TASK_STATUS:
        return
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_TASK_STATUS[0])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipelines.warm_tasks SOCKET MODULE,...  (started by warm_task_host)")
    atexit.register(_end_task_without_teardown)
    # Serve tasks until the run ends (exit 0); a forked child comes back with its task, and exits as it does.
    task = _Host(Path(sys.argv[1]), [name for name in sys.argv[2].split(",") if name]).run()
    if task is not None:
        _TASK_STATUS.append(_run_task(*task))
    sys.exit(_TASK_STATUS[0] if _TASK_STATUS else 0)
