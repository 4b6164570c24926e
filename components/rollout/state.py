"""The rollout state file (schema-checked, paths relative to the workspace) and its lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compat.io import utc_now, write_json_atomic
from components.rollout.types import RolloutError
from components.state.rollout_document import read_rollout_state
from components.state.workspace import map_paths, resolved_path, stored_path

# Paths a rollout state names, stored relative to the workspace root (see components.state.workspace).
STATE_PATHS = (
    "gallery.uri",
    "order.centres",
    "query_model.uri",
    "new_query_model.uri",
    "previous_query_model.uri",
)


def load_state(path: str | os.PathLike[str], root: Path | None = None) -> dict[str, Any] | None:
    """The rollout state at ``path`` (checked by its model, an earlier version's brought to this one:
    :mod:`components.state.rollout_document`), or None. Relative paths in it resolve against ``root``, the
    workspace root (default: the file's folder, where the live one is)."""
    path = Path(path)
    archive = path.parent / "rollout"
    doc = read_rollout_state(
        path,
        lambda why: RolloutError(
            f"{why}; it was damaged: restore it from a backup (a rollout's state is archived in "
            f"{archive}/<rollout id>/ only once a later rollout replaces it)"
        ),
    )
    if doc is None:
        return None
    base = Path(root) if root is not None else path.resolve().parent
    return map_paths(doc, STATE_PATHS, lambda value: resolved_path(base, value))


def save_state(path: Path, state: dict[str, Any], root: Path | None = None) -> None:
    """Write ``state`` atomically, its paths relative to ``root`` (default: the file's folder)."""
    state["updated_at"] = utc_now()
    base = Path(root) if root is not None else Path(path).resolve().parent
    write_json_atomic(path, map_paths(state, STATE_PATHS, lambda value: stored_path(base, value)))


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """One rollout or rollback at a time per state file (released by the OS even on kill -9)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RolloutError(
                f"another process is running a rollout or rollback on {path}; wait for it "
                "(or check it with `compatflow rollout status`)"
            ) from exc
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def status(state_path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"status", "stage", "fraction_backfilled", ...}`` of the rollout at ``state_path`` (or "none")."""
    state = load_state(state_path)
    if state is None:
        return {"status": "none", "stage": None, "fraction_backfilled": None}
    return {
        **{key: state[key] for key in ("status", "stage", "fraction_backfilled", "rollout_id", "mode")},
        "new_version": state["new_version"],
        "query_model_version": state["query_model"]["version"],
        "policy": state["order"]["policy"],
        **{key: state.get(key) for key in ("halt_reason", "curve", "pace")},
    }
