"""The gallery's part of a production rollback: the registry moves its aliases, these put the index back
(:func:`components.steps.rollback_production` passes them to
:meth:`components.adapters.registry.Registry.rollback`): :func:`prepare_rollback` refuses first what cannot be
done, :func:`on_rollback` then undoes the rollouts and re-embeds the items written since.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from compat.production import load_encoder
from components.adapters.index import ROW_FIELDS, GalleryIndex
from components.rollout.encoders import ShardImages
from components.rollout.operations import deployment_owner, open_index
from components.rollout.rollback import rollback, rollout_of
from components.rollout.state import load_state
from components.rollout.types import RolloutError, RolloutPaths, item_ref
from components.rollout.writes import rows_of_other_versions
from components.serving.record import read_serving
from components.serving.verify import check_returning_model
from components.state.rollout_document import RolloutState, unpromoted
from components.state.workspace import Workspace

log = logging.getLogger(__name__)


def prepare_rollback(event: dict[str, Any]) -> None:
    """Refuse (before anything changes) a rollback whose gallery part cannot be done: the rollout that made
    the leaving version served is missing or unreadable, or its source collection or old model is gone."""
    from components.adapters.registry import Registry

    paths = RolloutPaths.for_workspace(event["workspace"])
    if read_serving(paths.serving) is None:
        return  # nothing indexed: nothing to restore
    repo = _lineage_repo(event)
    if not (repo / "feature_store.yaml").is_file():
        raise RolloutError(
            f"the lineage repo {repo} has no feature_store.yaml, so the rollback could not record which "
            "model embeds each item: run it with the config that names the deployment's repo (--config)"
        )
    state = load_state(rollout_of(paths, event["from_version"]), paths.root)
    registry = Registry(
        event["workspace"], tracking_uri=event.get("tracking_uri"), model_name=event["model_name"]
    )
    check_returning_model(registry, state.previous_query_model.document())
    model = Path(str(state.previous_query_model.uri))
    if not model.is_dir():
        raise RolloutError(f"the model version {event['to_version']} served from is gone ({model})")
    g = state.gallery
    with GalleryIndex(g.uri, g.alias) as index:
        if not index.has_collection(g.source_collection):
            raise RolloutError(f"collection {g.source_collection} that served before the rollout is gone")


def on_rollback(event: dict[str, Any]) -> None:
    """Put the gallery back to the version production returns to: undo the rollout that made the leaving
    version served, then give every item written by another model since (items ingested after that
    rollout) the returning model's vector, so queries meet only vectors of the model that answers them."""
    paths = RolloutPaths.for_workspace(event["workspace"])
    record = read_serving(paths.serving)
    if record is None:
        log.info("no gallery indexed in %s: nothing to restore", event["workspace"])
        return
    state_path = rollout_of(paths, event["from_version"])
    with GalleryIndex(record.uri, record.alias, owner=deployment_owner(paths.root)) as index:
        finish_superseded(paths, index, event)
        state = rollback(paths, index, state_path=state_path)
        written = complete_gallery(index, record.collection, state, root=paths.root)
    log.info("rollback: %d item(s) re-embedded by %s", written, state.previous_query_model.version)
    from components.adapters.lineage import sync_from_index

    repo = _lineage_repo(event)
    if (repo / "feature_store.yaml").is_file():  # prepare_rollback refuses a served gallery without one
        sync_from_index(repo, state.gallery.uri, state.gallery.alias)
    else:
        log.warning("no lineage repo at %s: item lineage not updated", repo)


def _lineage_repo(event: dict[str, Any]) -> Any:
    """The lineage repo the rollback event names, else its workspace's."""
    return Path(event.get("lineage_repo") or Workspace.coerce(event["workspace"]).lineage_dir)


def unfinished_rollout(paths: Any, production: str | None) -> RolloutState | None:
    """The rollout state in ``paths.state`` when its change is not promoted yet
    (:func:`components.state.rollout_document.unpromoted`), else None."""
    current = load_state(paths.state)
    if current is None or not unpromoted(current.status, current.new_version, production):
        return None
    return current


def _roll_back_unfinished(
    paths: Any, index: Any, current: RolloutState, why: str
) -> tuple[RolloutState, int]:
    """Undo the unfinished rollout ``current`` (a completed one's items indexed since are embedded again by
    the returning model), its state ``rolled_back`` with ``why`` and where it stood in ``halt_reason``, so no
    run takes it for one in progress. Returns the state and how many items were embedded again."""
    completed = current.status == "completed"
    where = "completed, never promoted" if completed else f"{current.status} at stage {current.stage}"
    state = rollback(paths, index, promoted=not completed, reason=f"{why} while this rollout was {where}")
    written = complete_gallery(index, current.gallery.collection, state, paths.root) if completed else 0
    return state, written


def finish_superseded(paths: Any, index: Any, event: dict[str, Any]) -> RolloutState | None:
    """Roll back the rollout in ``paths.state`` when its change is unfinished, a production rollback
    superseding it; returns its final state, or None when there was none."""
    current = unfinished_rollout(paths, event["from_version"])
    if current is None:
        return None
    log.warning(
        "rolling back unfinished rollout %s of %s first: production %s -> %s supersedes it",
        current.rollout_id,
        current.new_version,
        event["from_version"],
        event.get("to_version"),
    )
    why = f"superseded: production rolled back from {event['from_version']} to {event.get('to_version')}"
    return _roll_back_unfinished(paths, index, current, why)[0]


def roll_back_unfinished_rollout(registry: Any) -> dict[str, Any] | None:
    """What ``compatflow rollback`` undoes when a change is unfinished (:func:`unfinished_rollout`): that
    rollout alone, back to the ``registry``'s production (checked against its digest first; no alias moves),
    the item lineage synced. Returns what it undid, or None."""
    from components.adapters.lineage import sync_from_index

    ws, production = registry.workspace, registry.alias_version("production")
    paths = RolloutPaths.for_workspace(ws)
    current = unfinished_rollout(paths, production)
    if current is None:
        return None
    check_returning_model(registry, current.previous_query_model.document())
    log.warning("rolling back unfinished rollout %s of %s", current.rollout_id, current.new_version)
    why = f"rolled back by compatflow rollback (production stays {production})"
    with open_index(ws) as index:
        state, written = _roll_back_unfinished(paths, index, current, why)
    if (ws.lineage_dir / "feature_store.yaml").is_file():
        g = state.gallery
        sync_from_index(ws.lineage_dir, g.uri, g.alias, definition=ws.lineage_definition)
    return {
        "rollout_id": current.rollout_id,
        "candidate": str(current.new_version),
        "was": current.status,
        "stage": current.stage,
        "production": production,
        "state": state.document(),
        "reembedded": written,
    }


def complete_gallery(index: Any, leaving: str, state: RolloutState, root: Any = None) -> int:
    """After a rolled-back rollout: embed with the restored query model every item of the serving collection
    written by another version, and every item indexed into the ``leaving`` collection since the rollout
    (relative source URIs lie under ``root``); returns how many were written."""
    g, model = state.gallery, state.previous_query_model
    target, version = g.source_collection, model.version
    batches = _stale_batches(index, target, leaving, version)
    first = next(batches, None)
    if first is None:
        return 0
    from compat.compat_training import decode_size

    encoder = load_encoder(str(model.uri))
    images = ShardImages(image_size=decode_size(encoder), root=str(root) if root else None)
    space = index.collection_space(target)
    written = 0
    for rows in itertools.chain([first], batches):
        refs = [item_ref(r) for r in rows]
        vectors = np.asarray(encoder.encode_images(images.load(refs)).numpy(), dtype=np.float32)
        written += index.index_items(
            [r["item_id"] for r in rows],
            vectors,
            version,
            space,
            phase=[int(r["phase"]) for r in rows],
            source_uris=[r["source_uri"] for r in rows],
            collection=target,
        )
    index.flush(target)
    return written


def _stale_batches(
    index: Any, target: str, leaving: str, version: str, size: int = 256
) -> Iterator[list[Any]]:
    """Batches of at most ``size`` rows to re-embed with ``version`` into ``target``: its rows of another
    version (until none is left: each write takes its rows out of the filter), then the rows of ``leaving``
    that no rollout took from ``target`` and ``target`` lacks."""
    yield from rows_of_other_versions(index, target, version, size)
    if leaving != target and index.has_collection(leaving):
        # rows a rollout did not take from its source (backfill_stage 0: indexed into it since); a collection
        # made before per-row keys is read whole
        added = "backfill_stage == 0" if index.has_order_keys(leaving) else ""
        for page in index.iter_rows(ROW_FIELDS, leaving, filter=added, batch_size=size):
            have = index.existing_ids([r["item_id"] for r in page], target)
            missing = [r for r in page if r["item_id"] not in have]
            if missing:
                yield missing
