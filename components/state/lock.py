"""One process at a time per workspace: a file lock the OS releases when its holder dies, naming the holder.

``compatflow run`` holds it for the whole run, operator commands that change what is served take it too; a
second process gets :class:`WorkspaceBusy` at once, naming the holder. ``flock`` locks die with their
process, so a killed holder leaves no stale lock. A run's steps (KFP tasks, which can outlive a runner killed
alone) each hold a shared lock while they run (:func:`step_lock`): the workspace lock is refused meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from components.state.workspace import Workspace


class WorkspaceBusy(RuntimeError):
    """Another process holds the workspace; the message names it."""


@contextlib.contextmanager
def workspace_lock(
    workspace: Workspace | str | os.PathLike[str], purpose: str
) -> Iterator[dict[str, object]]:
    """Hold the workspace lock for the block; raises :class:`WorkspaceBusy` when it is taken."""
    ws = Workspace.coerce(workspace)
    ws.root.mkdir(parents=True, exist_ok=True)
    handle = open(os.open(ws.lock_path, os.O_RDWR | os.O_CREAT, 0o644), "r+")  # noqa: SIM115 - held for the block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkspaceBusy(
                f"workspace {ws.root} is in use by {_describe(handle.read())}; wait for it to finish "
                "(a holder that dies releases the lock at once; nothing needs deleting)"
            ) from None
        _refuse_orphaned_steps(ws)
        holder: dict[str, object] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "purpose": purpose,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder))
        handle.flush()
        try:
            yield holder
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"{holder['purpose']} (pid {holder['pid']} on {holder['host']}, since {holder['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


@contextlib.contextmanager
def flocked(path: Path, mode: int = fcntl.LOCK_EX, busy: Exception | None = None) -> Iterator[None]:
    """Hold the flock ``mode`` on ``path`` for the block (the OS releases it even on kill -9); with ``busy``,
    a lock held elsewhere is not waited for: ``busy`` is raised."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, mode if busy is None else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def step_lock(workspace: Workspace | str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Hold the workspace's shared step lock while a pipeline step runs (see the module docstring)."""
    ws = Workspace.coerce(workspace)
    ws.root.mkdir(parents=True, exist_ok=True)
    return flocked(ws.steps_lock_path, fcntl.LOCK_SH)


def _refuse_orphaned_steps(ws: Workspace) -> None:
    path = ws.steps_lock_path
    busy = WorkspaceBusy(
        f"a step of an earlier run is still running in workspace {ws.root} (its runner was stopped alone); "
        f"wait for it to end or stop it (`fuser {path}` shows its pid)"
    )
    if path.exists():
        with flocked(path, busy=busy):
            pass
