"""Moving a served gallery to another index (``compatflow index move --to URI``), with nothing lost.

The collections the serving record and rollout states name are copied in bounded batches of idempotent
upserts (a killed move is run again), counted, then the alias, the rollout states and last the serving record
switch to the target; the source is left as it was. Every collection and the alias at the target must be this
deployment's (:meth:`components.adapters.index.GalleryIndex.claim`) before the first write.
"""

from __future__ import annotations

import logging
from typing import Any

from components.adapters.index import ROW_FIELDS, GalleryIndex
from components.rollout.operations import deployment_owner, gallery_collections
from components.rollout.state import exclusive, load_state, save_state
from components.rollout.types import RolloutError, RolloutPaths
from components.serving.record import read_serving, same_index, write_serving
from components.state.rollout_document import UNDER_WAY
from components.state.workspace import Workspace

log = logging.getLogger(__name__)


def move_gallery(workspace: Any, to_uri: str, *, batch_size: int = 2000) -> dict[str, Any]:
    """Move the workspace's served gallery to the index at ``to_uri`` (see the module doc). The caller holds
    the workspace lock. Returns ``{"from", "to", "collections": {name: rows}, "served": collection}``;
    ``collections`` is empty when the gallery is already served from ``to_uri``."""
    ws = Workspace.coerce(workspace)
    paths = RolloutPaths.for_workspace(ws)
    record = read_serving(paths.serving)
    if record is None:
        raise RolloutError(
            f"nothing is served from {ws.root} (no serving record): there is no gallery to move"
        )
    source_uri, served, alias = record.uri, record.collection, record.alias
    if same_index(source_uri, to_uri):
        return {"from": source_uri, "to": to_uri, "collections": {}, "served": served}
    state = load_state(paths.state)
    if state is not None and state.status in UNDER_WAY:
        raise RolloutError(
            f"rollout {state.rollout_id} is {state.status}: let the run finish it (compatflow run) or "
            "roll it back (compatflow rollback) before moving the gallery"
        )
    copied: dict[str, int] = {}
    owner = deployment_owner(ws, legacy=False)  # at the target, only what this deployment marked is its own
    with GalleryIndex(source_uri, alias) as source, GalleryIndex(to_uri, alias, owner=owner) as target:
        names = [name for name in gallery_collections(ws) if source.has_collection(name)]  # the served first
        target.claim(*names, alias=True)  # before the first write: refuses another deployment's names
        for name in names:
            if not target.has_collection(name):
                target.create_collection(
                    source.collection_space(name), source.collection_dim(name), name=name
                )
            written = 0
            for rows in source.iter_rows(ROW_FIELDS, collection=name, batch_size=batch_size):
                written += target.upsert(rows, collection=name)
            target.flush(name, wait_indexed=name == served)
            have, want = target.count(name), source.count(name)
            if have != want:
                raise RolloutError(
                    f"collection {name} holds {have} rows at {to_uri} but {want} at {source_uri} after the "
                    "copy; run the move again (it copies again; nothing is served from the target yet)"
                )
            copied[name] = written
            log.info("moved %s: %d rows to %s", name, written, to_uri)
        target.switch_alias(served)
    for path in [paths.state, *paths.archived_states()]:  # the rollout states name the new index too
        with exclusive(paths.state):
            state = load_state(path, paths.root)
            if state is not None and state.gallery.uri != to_uri:
                state.gallery.uri = to_uri
                save_state(path, state, paths.root)
    write_serving(paths.serving, **{**record.model_dump(exclude_unset=True), "uri": to_uri})
    return {"from": source_uri, "to": to_uri, "collections": copied, "served": served}
