"""The rollout state file (its model: :mod:`components.state.rollout_document`) and its lock."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from components.rollout.types import RolloutError
from components.state.lock import flocked
from components.state.rollout_document import RolloutState


def load_state(path: str | os.PathLike[str], root: Path | None = None) -> RolloutState | None:
    """The rollout state at ``path`` (an earlier version's brought to this one), or None. Relative paths in
    it resolve against ``root``, the workspace root (default: the file's folder, where the live one is)."""
    path = Path(path)
    archive = path.parent / "rollout"
    return RolloutState.read(
        path,
        lambda why: RolloutError(
            f"{why}; it was damaged: restore it from a backup (a rollout's state is archived in "
            f"{archive}/<rollout id>/ only once a later rollout replaces it)"
        ),
        Path(root) if root is not None else path.resolve().parent,
    )


def save_state(path: Path, state: RolloutState, root: Path | None = None) -> None:
    """Write ``state`` atomically, its paths relative to ``root`` (default: the file's folder)."""
    state.write(path, Path(root) if root is not None else Path(path).resolve().parent)


def exclusive(path: Path) -> contextlib.AbstractContextManager[None]:
    """One rollout or rollback at a time per state file (released by the OS even on kill -9)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    busy = RolloutError(
        f"another process is running a rollout or rollback on {path}; wait for it "
        "(or check it with `compatflow rollout status`)"
    )
    return flocked(path.with_name(path.name + ".lock"), busy=busy)


def status(state_path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"status", "stage", "fraction_backfilled", ...}`` of the rollout at ``state_path`` (or "none")."""
    state = load_state(state_path)
    if state is None:
        return {"status": "none", "stage": None, "fraction_backfilled": None}
    doc = state.document()
    return {
        **{key: doc[key] for key in ("status", "stage", "fraction_backfilled", "rollout_id", "mode")},
        "new_version": state.new_version,
        "query_model_version": state.query_model.version,
        "policy": state.order.policy,
        **{key: doc.get(key) for key in ("halt_reason", "curve", "pace")},
    }
