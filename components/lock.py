"""One process at a time per workspace: a file lock the OS releases when its holder dies, naming the holder.

``compatflow run`` holds it for the whole run (its KFP tasks are its children and run under it); operator
commands that change what is served (``rollback``, ``rollout run`` / ``rollout rollback``) take it too. A
second process gets :class:`WorkspaceBusy` at once, with the holder's pid, host, command and start time. A
holder killed with SIGKILL leaves no stale lock: ``flock`` locks die with their process.
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

LOCK_FILE = ".compatflow.lock"


class WorkspaceBusy(RuntimeError):
    """Another process holds the workspace; the message names it."""


@contextlib.contextmanager
def workspace_lock(workspace: str | os.PathLike[str], purpose: str) -> Iterator[dict[str, object]]:
    """Hold ``<workspace>/.compatflow.lock`` for the block; raises :class:`WorkspaceBusy` when it is taken."""
    root = Path(workspace)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")  # noqa: SIM115 - held for the block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkspaceBusy(
                f"workspace {root} is in use by {_describe(handle.read())}; wait for it to finish "
                "(a holder that dies releases the lock at once; nothing needs deleting)"
            ) from None
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
