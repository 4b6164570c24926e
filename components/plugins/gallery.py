"""Gallery plugin: ``compatflow status`` shows the index and rollout; a registry rollback restores the index.

``status`` adds ``gallery.count`` / ``gallery.by_version`` (vectors per model version, adding up to the
count) and ``rollout.state`` / ``rollout.stage`` / ``rollout.fraction_backfilled``. ``on_rollback``
rolls back the rollout of the version that leaves production (previous collection or vectors, previous
query model) and records the restored versions in the item lineage.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def status(workspace: Any) -> dict[str, Any]:
    from components.index import gallery_status
    from components.rollout import RolloutPaths
    from components.rollout import status as rollout_status
    from components.search import read_serving

    paths = RolloutPaths.for_workspace(workspace)
    doc: dict[str, Any] = {"rollout": rollout_status(paths.state)}
    record = read_serving(paths.serving)
    if record is None:
        doc["gallery"] = {"count": 0, "by_version": {}, "collection": None, "query_model_version": None}
    else:
        doc["gallery"] = {
            **gallery_status(record["uri"], record["alias"]),
            "query_model_version": record["query_model"]["version"],
        }
    return doc


def on_rollback(event: dict[str, Any]) -> None:
    from components.rollout import RolloutError, RolloutPaths, load_state, rollback

    paths = RolloutPaths.for_workspace(event["workspace"])
    state = load_state(paths.state)
    if state is None or state["state"] == "rolled_back":
        log.info("no rollout to undo in %s", paths.state)
        return
    if state["model_version"] != str(event["from_version"]):
        raise RolloutError(
            f"production moved back from version {event['from_version']}, but the rollout in "
            f"{paths.state} serves version {state['model_version']}; run `compatflow rollout "
            "rollback` after checking which model the gallery should serve"
        )
    state = rollback(paths)
    from components.lineage import sync_from_index
    from components.workspace import Workspace

    repo = Workspace.coerce(event["workspace"]).feast_dir
    if (repo / "feature_store.yaml").is_file():
        sync_from_index(repo, state["gallery"]["uri"], state["gallery"]["alias"])
