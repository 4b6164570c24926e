"""Rolling back what is served: an unfinished change (a rollout not promoted), or production to its previous
version."""

from __future__ import annotations

from typing import Any


def rollback_production(registry: Any) -> dict[str, Any]:
    """Undo the newest change to what is served, returning what happened.

    A change is unfinished until it is promoted. A candidate's rollout left unfinished (its run killed or
    failed mid-backfill: a mixed gallery, maybe queried by the candidate) or completed but never promoted
    (its run killed between the backfill and the promotion: the candidate answers every query) is that
    change: it alone is rolled back and production stays, whether or not a previous version exists
    (``{"undone_rollout": ...}``,
    :func:`components.rollout.production_rollback.roll_back_unfinished_rollout`); the next rollback moves
    production. Otherwise ``production`` moves back to ``previous``
    (:meth:`components.adapters.registry.Registry.rollback`) with the gallery's part: refused before anything
    changes when it cannot be done (:func:`components.rollout.production_rollback.prepare_rollback`), the
    index put back before the aliases move (:func:`components.rollout.production_rollback.on_rollback`).
    Either way the returning model is checked against the registry's digest (its workspace copy downloaded
    again when damaged) before anything switches; :class:`RegistryError` when it fails, nothing changed."""
    from components.adapters.registry import RegistryError
    from components.rollout import RolloutError, ServingError, production_rollback

    production = registry.alias_version("production")
    try:
        undone = production_rollback.roll_back_unfinished_rollout(registry)
    except RolloutError:  # an unreadable rollout state: the registry rollback's preparation refuses it,
        undone = None  # naming it, with nothing changed
    except ServingError as err:
        raise RegistryError(f"rollback refused, nothing changed: {err}") from err
    if undone is not None:
        return {"undone_rollout": undone, "production": production}
    return registry.rollback(
        prepare=[production_rollback.prepare_rollback], undo=[production_rollback.on_rollback]
    )
