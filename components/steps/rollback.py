"""Rolling production back: the registry's aliases and the gallery together, or nothing."""

from __future__ import annotations

from typing import Any


def rollback_production(registry: Any) -> dict[str, Any]:
    """Move ``production`` back to ``previous`` (:meth:`components.registry.Registry.rollback`), with the
    gallery's part: refused before anything changes when it cannot be done
    (:func:`components.rollout.production_rollback.prepare_rollback`), the index put back before the aliases
    move (:func:`components.rollout.production_rollback.on_rollback`). Returns what happened."""
    from components.rollout import production_rollback

    return registry.rollback(
        prepare=[production_rollback.prepare_rollback], undo=[production_rollback.on_rollback]
    )
