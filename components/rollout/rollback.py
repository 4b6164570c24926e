"""Undoing a rollout: previous collection or saved rows, previous query model; finding a version's rollout."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compat.io import utc_now
from components.adapters.index import GalleryIndex
from components.adapters.services import live_services
from components.rollout.pacing import Pace, latency_sources
from components.rollout.state import (
    Batch,
    exclusive,
    load_rows,
    load_state,
    save_state,
    saved_batches,
    stage_batches,
)
from components.rollout.types import DEFAULT_FLUSH_ROWS, RolloutError, RolloutPaths
from components.rollout.writes import GalleryWriter
from components.serving.record import write_serving

log = logging.getLogger(__name__)


def recorded_pace(state: Mapping[str, Any]) -> Pace:
    """The pace a rollout ran at (its SLO factor, cap and idle p99), for replaying its saved rows."""
    recorded = state.get("pace") or {}
    return Pace.resumed(recorded, recorded.get("p99_factor"), recorded.get("max_items_per_s"))


def ran_batches(state: Mapping[str, Any]) -> Iterator[Batch]:
    """The batches of ``state`` that may have written: those up to its cursor (the one in flight at a crash
    included), and, while a stage runs fanned out over workers, every batch of that stage's ranges."""
    limit = state["cursor"]["position"] + 1
    for _, hi in state["cursor"].get("ranges") or ():
        limit = max(limit, hi)
    return itertools.takewhile(lambda batch: batch[0] < limit, stage_batches(state))


def replay_rows(
    index: GalleryIndex,
    files: Iterable[Path],
    collection: str,
    pace: Pace | None = None,
    flush_rows: int = DEFAULT_FLUSH_ROWS,
    service_urls: Sequence[str] = (),
) -> int:
    """Upsert the rows saved in restore ``files`` into ``collection`` (:class:`GalleryWriter`: flushed every
    ``flush_rows`` rows and at the end), at ``pace`` (with an SLO factor, it watches the query latency of the
    services at ``service_urls``, or of searches it times, as the backfill does). Idempotent. Returns the
    number of rows written."""
    writer: GalleryWriter | None = None
    for path in files:
        rows = load_rows(path)
        if not rows:
            continue
        if writer is None:
            if pace is not None:
                pace.watch(latency_sources(index, collection, np.asarray(rows[0]["vector"]), service_urls))
                pace.begin()
            writer = GalleryWriter.for_pace(index, collection, pace, flush_rows)
        writer.write(rows)
    if writer is None:
        return 0
    writer.flush()
    return writer.written


def rollback(
    paths: RolloutPaths, index: GalleryIndex | None = None, state_path: Path | None = None
) -> dict[str, Any]:
    """Undo the rollout in ``paths.state`` (or the archived one at ``state_path``, see :func:`rollout_of`):
    previous collection (or the saved rows) and previous query model.

    In place, the saved rows of every batch up to the cursor (the batch in flight at a crash included) are
    replayed at the pace the rollout recorded (its SLO throttle and rate cap), flushed every
    ``DEFAULT_FLUSH_ROWS`` rows so that queries never search thousands of unflushed rows.

    Idempotent: a rollback interrupted at any point can be run again. Returns the state (``rolled_back``).
    """
    state_path = Path(state_path or paths.state)
    with exclusive(paths.state):
        root = paths.root
        state = load_state(state_path, root)
        if state is None:
            raise RolloutError(f"no rollout state at {state_path}: nothing to roll back")
        if state["status"] == "rolled_back":
            return state
        g = state["gallery"]
        own = index is None
        index = index or GalleryIndex(g["uri"], g["alias"])
        try:
            state["rollback"] = {"started_at": utc_now(), "from_status": state["status"]}
            save_state(state_path, state, root)
            source = g["source_collection"]
            if g["collection"] == source:  # in place: replay the saved rows of every batch that may have run
                restore = paths.restore_dir(state["rollout_id"])
                files = saved_batches(restore, ran_batches(state))
                pace = recorded_pace(state)
                replay_rows(index, files, source, pace, service_urls=live_services(paths.services))
                state["rollback"]["pace"] = pace.to_dict()
            write_serving(
                paths.serving,
                uri=g["uri"],
                alias=g["alias"],
                collection=source,
                space=g["source_space"],
                dim=index.collection_dim(source),
                query_model=state["previous_query_model"],
                previous=None,
                rollout_id=state["rollout_id"],
            )
            index.switch_alias(source)
            state.update(
                status="rolled_back", query_model=state["previous_query_model"], fraction_backfilled=0.0
            )
            state["cursor"]["position"] = 0
            state["rollback"]["finished_at"] = utc_now()
            state["gallery"]["versions_after"] = index.count_by_version(source)
            save_state(state_path, state, root)
            log.info("rollout %s rolled back: alias %s -> %s", state["rollout_id"], g["alias"], source)
            return state
        finally:
            if own:
                index.close()


def rollout_of(paths: RolloutPaths, version: str) -> Path:
    """The state file of the completed rollout that made ``version`` the served model: the current one, or
    one archived in its work directory when a later rollout started. Raises :class:`RolloutError` naming
    the files when none is found or one cannot be read."""
    candidates = [paths.state, *paths.archived_states()]
    for path in candidates:
        state = load_state(path, paths.root)
        if (
            state is not None
            and str(state["model_version"]) == str(version)
            and state["status"] == "completed"
        ):
            return path
    raise RolloutError(
        f"no completed rollout of version {version} in {paths.state} or its archive "
        f"({paths.work_root}/*/{paths.state.name}): the gallery cannot be put back to what it "
        "served before; restore the workspace from a backup or roll the gallery forward with a new upgrade"
    )
