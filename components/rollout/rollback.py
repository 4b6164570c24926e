"""Undoing a rollout: the source collection and the previous query model back (a switch); finding a version's
rollout."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from compat.io import utc_now
from components.adapters.index import GalleryIndex
from components.rollout.state import exclusive, load_state, save_state
from components.rollout.types import RolloutError, RolloutPaths
from components.serving.record import write_serving
from components.state.rollout_document import RolloutState

log = logging.getLogger(__name__)


def rollback(
    paths: RolloutPaths,
    index: GalleryIndex | None = None,
    state_path: Path | None = None,
    *,
    promoted: bool = True,
    reason: str | None = None,
) -> RolloutState:
    """Undo the rollout in ``paths.state`` (or the archived one at ``state_path``): the serving record and
    the alias back to its source collection, which the rollout never wrote, and the previous query model. A
    switch, whatever the gallery's size; the rollout's own collection stays until the next rollout is planned.
    ``promoted=False``: a completed rollout whose version never became production (the record's rollback
    target goes back to production's); ``reason``: why, kept as its ``halt_reason``. Idempotent; returns the
    state (``rolled_back``)."""
    state_path = Path(state_path or paths.state)
    with exclusive(paths.state):
        state = load_state(state_path, paths.root)
        if state is None:
            raise RolloutError(f"no rollout state at {state_path}: nothing to roll back")
        if state.status == "rolled_back":
            return state
        g = state.gallery
        source = g.source_collection
        if g.collection == source and state.status != "halted":
            raise RolloutError(
                f"rollout {state.rollout_id} ({state_path}) wrote its collection in place (an earlier "
                "release): its rows cannot be switched back; roll it back with that release"
            )
        from components.rollout.operations import deployment_owner

        own = index is None
        index = index or GalleryIndex(g.uri, g.alias, owner=deployment_owner(paths.root))
        try:
            t0 = time.perf_counter()
            started = {"started_at": utc_now(), "from_status": state.status}
            # a completed rollout dropped the collection production's record named as its rollback target
            previous = (g.source_previous or {}).get("collection")
            kept = bool(previous) and index.has_collection(previous)
            keep = state.status != "completed" or (not promoted and kept)
            serve_source(paths, index, state, keep_previous=keep)
            index.switch_alias(source)
            state.status, state.fraction_backfilled = "rolled_back", 0.0
            state.cursor.position = 0
            seconds = round(time.perf_counter() - t0, 3)
            state.rollback = {**started, "finished_at": utc_now(), "seconds": seconds}
            g.versions_after = index.count_by_version(source)
            if reason is not None:
                state.halt_reason = reason
            save_state(state_path, state, paths.root)
            log.info("rollout %s rolled back: alias %s -> %s", state.rollout_id, g.alias, source)
            return state
        finally:
            if own:
                index.close()


def serve_source(
    paths: RolloutPaths, index: GalleryIndex, state: RolloutState, *, keep_previous: bool
) -> None:
    """The serving record back to the rollout's source collection and its previous query model; with
    ``keep_previous`` (the rollout never completed) the record's rollback target stays what it was."""
    g = state.gallery
    write_serving(
        paths.serving,
        uri=g.uri,
        alias=g.alias,
        collection=g.source_collection,
        space=g.source_space,
        dim=index.collection_dim(g.source_collection),
        query_model=state.previous_query_model.document(),
        previous=g.source_previous if keep_previous else None,
        rollout_id=state.rollout_id,
    )
    state.query_model = state.previous_query_model.model_copy()


def rollout_of(paths: RolloutPaths, version: str) -> Path:
    """The state file of the completed rollout that made ``version`` the served model: the current one, or
    one archived in its work directory when a later rollout started. Raises :class:`RolloutError` naming
    the files when none is found or one cannot be read."""
    candidates = [paths.state, *paths.archived_states()]
    for path in candidates:
        state = load_state(path, paths.root)
        if state is not None and state.new_version == str(version) and state.status == "completed":
            return path
    raise RolloutError(
        f"no completed rollout of version {version} in {paths.state} or its archive "
        f"({paths.work_root}/*/{paths.state.name}): the gallery cannot be put back to what it "
        "served before; restore the workspace from a backup or roll the gallery forward with a new upgrade"
    )
