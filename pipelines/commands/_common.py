"""Helpers shared by command modules: fatal errors with a clear message, JSON output."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def write_json(path: Path, document: Any) -> None:
    """Write ``document`` as indented JSON, atomically (temp file + rename)."""
    from compat.io import write_json_atomic

    write_json_atomic(path, document)


def echo_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


@contextlib.contextmanager
def holding_workspace(workspace: Any, purpose: str) -> Iterator[None]:
    """Hold the workspace lock (:mod:`components.lock`) for the block; exit 1 naming the holder if taken."""
    from components.lock import WorkspaceBusy, workspace_lock
    from components.workspace import Workspace

    try:
        with workspace_lock(Workspace.coerce(workspace).root, purpose):
            yield
    except WorkspaceBusy as err:
        fail(str(err), code=1)
