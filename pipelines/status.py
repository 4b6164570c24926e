"""What ``compatflow status`` shows: registry aliases, the last gate decision, rollout progress, the gallery.

Nothing here loads a model: a local registry is read from its sqlite file, the served copy checked by hash.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.state.run_dir import GATE_FILE, ROLLOUT_STATE_FILE, RunDir
from components.state.workspace import DEFAULT_MODEL_NAME, Workspace

log = logging.getLogger(__name__)


def collect(
    workspace: Workspace | str | Path | None = None,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    count: bool = True,
) -> dict[str, Any]:
    """The status document of a workspace; ``count``: the gallery counted in the index, not just described."""
    from components.runs import StateError

    ws = Workspace.coerce(workspace)
    doc: dict[str, Any] = {
        "workspace": str(ws.root),
        "registry": registry_status(ws, model_name),
        "last_gate": last_gate(ws),
        "rollout": rollout_state(ws),
    }
    unreadable = [part["error"] for part in (doc["last_gate"], doc["rollout"]) if part and part.get("error")]
    try:
        doc["phases"] = phase_history(ws)
    except (StateError, OSError, ValueError) as err:  # a damaged phase record or run file: named below
        doc["phases"] = []
        unreadable.append(str(err))
    doc["production_check"] = production_check(ws, model_name, doc["registry"])
    if unreadable:
        doc["unreadable"] = unreadable  # `compatflow status` exits non-zero over it
    try:
        _deep_merge(doc, gallery_part(ws) if count else served_part(ws))
    except Exception as err:  # noqa: BLE001 - status shows what it can, and names what it could not read
        doc["part_errors"] = [{"part": "gallery", "error": f"{type(err).__name__}: {err}"}]
    return doc


def gallery_part(workspace: Workspace | str | Path) -> dict[str, Any]:
    """The gallery's count per model version and the rollout's progress, from the serving record's index
    (a milvus-lite folder held by a running ``compatflow serve`` is not counted)."""
    from components.adapters.index import gallery_status, is_remote
    from components.adapters.services import live_services
    from components.rollout import RolloutPaths, read_serving
    from components.rollout import status as rollout_status

    paths = RolloutPaths.for_workspace(workspace)
    doc: dict[str, Any] = {"rollout": rollout_status(paths.state)}
    record = read_serving(paths.serving)
    if record is None:
        return {**doc, "gallery": _no_gallery()}
    services = [] if is_remote(record.uri) else live_services(Workspace.coerce(workspace).services_dir)
    counts = (
        {"count": None, "note": f"not counted: {services[0]} holds {record.uri}"}
        if services
        else gallery_status(record.uri, record.alias)
    )
    doc["gallery"] = {**counts, "query_model_version": record.query_model.version}
    return doc


def _no_gallery() -> dict[str, Any]:
    return {"count": 0, "by_version": {}, "collection": None, "query_model_version": None}


INDEX_CONNECT_S = 3.0  # a server index that accepts no connection within this is named as a problem


def served_part(workspace: Workspace | str | Path) -> dict[str, Any]:
    """What :func:`gallery_part` says without opening the index (slow), and whether a server index answers."""
    from components.serving.record import read_serving
    from components.state.rollout_document import RolloutState

    ws = Workspace.coerce(workspace)
    state = RolloutState.read(ws.rollout_state_path, ValueError)
    rollout = {k: getattr(state, k, None) for k in ("stage", "fraction_backfilled", "new_version")}
    doc: dict[str, Any] = {"rollout": {"status": state.status if state else "none", **rollout}}
    record = read_serving(ws.serving_path)
    if record is None:
        return {**doc, "gallery": _no_gallery()}
    _check_reachable(record.uri)
    doc["gallery"] = {
        "collection": record.collection,
        "query_model_version": record.query_model.version,
        "count": None,
        "note": "not counted (`compatflow status --count` counts it)",
    }
    return doc


def _check_reachable(uri: str) -> None:
    """Raise OSError naming ``uri`` when its server refuses connections or its milvus-lite folder is gone."""
    from components.runs import connect

    if "://" not in uri and not Path(uri).exists():
        raise FileNotFoundError(f"the serving record's index {uri} does not exist")
    try:
        connect(uri, INDEX_CONNECT_S)
    except OSError as err:
        raise OSError(f"the index {uri} accepts no connection ({err})") from None


def unfinished_change(doc: Mapping[str, Any]) -> bool:
    """Whether the status document's rollout is a change not yet promoted."""
    from components.state.rollout_document import unpromoted

    production = ((doc.get("registry") or {}).get("production") or {}).get("version")
    rollout = doc.get("rollout") or {}
    return unpromoted(rollout.get("status"), rollout.get("new_version"), production)


def problems(doc: Mapping[str, Any]) -> list[str]:
    """Why a status document is not healthy, one sentence per problem."""
    found = [*doc.get("unreadable", []), *(f"{e['part']}: {e['error']}" for e in doc.get("part_errors", []))]
    check = doc.get("production_check") or {}
    if check.get("ok") is False:
        found.append(f"checksum of production v{check['version']} FAILED: {check['message']}")
    production = (doc.get("registry") or {}).get("production") or {}
    served = (doc.get("gallery") or {}).get("query_model_version")
    if production and served and str(served) != str(production["version"]):
        if not unfinished_change(doc):
            found.append(
                f"the index and the registry disagree: queries are served by v{served} but production is "
                f"v{production['version']}, and no rollout is under way"
            )
    return found


def next_step(doc: Mapping[str, Any], found: list[str]) -> str:
    """The one command a person runs next, given the status document and its :func:`problems`."""
    check = doc.get("production_check") or {}
    if check.get("ok") is False:
        return "delete the copy named above (it is downloaded again, verified), or `compatflow rollback`"
    if any("disagree" in problem for problem in found):
        return "`compatflow rollback` serves production's version again (`compatflow rollout status`: why)"
    if found:
        return "restore or remove the file named above (`compatflow state rebuild` rebuilds the phase record)"
    if unfinished_change(doc):
        return "`compatflow run` resumes the rollout (and promotes it), or `compatflow rollback` abandons it"
    if not (doc.get("registry") or {}).get("production"):
        return "`compatflow run` trains and serves the first model"
    return "`compatflow run` runs the next pending phase (`compatflow stream add-phase` adds one)"


def registry_status(ws: Workspace, model_name: str = DEFAULT_MODEL_NAME) -> dict[str, Any]:
    """Aliases of the registered model; never creates a local store just to look at it."""
    from components.adapters.registry import ALIASES, Registry

    registry = Registry(ws, model_name=model_name)
    empty = {
        "model": model_name,
        "tracking_uri": registry.tracking_uri,
        **dict.fromkeys(ALIASES),
        "history": [],
    }
    if not registry.exists():
        return {**empty, "note": f"no registry yet ({ws.mlflow_store} does not exist)"}
    try:
        return registry.status()
    except Exception as err:  # noqa: BLE001 - status must show what it can
        log.warning("cannot read the registry at %s: %s", registry.tracking_uri, err)
        return {**empty, "error": f"{type(err).__name__}: {err}"}


def production_check(ws: Workspace, model_name: str, registry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The production model's workspace copy verified file by file and against the registry's digest."""
    from components.adapters.registry import Registry, RegistryError

    production = registry.get("production")
    if not production:
        return None
    version = str(production["version"])
    copy = ws.model_dir(version)
    if not copy.is_dir():
        return {"version": version, "ok": None, "message": f"no workspace copy at {copy} (downloaded on use)"}
    try:
        Registry(ws, model_name=model_name).verify_copy(version, copy)
    except (RegistryError, OSError, ValueError) as err:
        return {"version": version, "ok": False, "message": f"{err}; delete {copy} to download it again"}
    return {"version": version, "ok": True, "message": f"{copy} matches the registered digest"}


def phase_history(ws: Workspace) -> list[dict[str, Any]]:
    """Every phase's outcome from the phase record, oldest first, with why a run did not ship."""
    from components.runs import RunBlock, RunFailure, read_state

    rows = []
    for phase, entry in sorted(read_state(ws).phases.items(), key=lambda kv: int(kv[0])):
        run = RunDir(ws.runs_dir / entry.run_id)
        row = {"phase": int(phase), **entry.model_dump(), "why": None}
        failure = RunFailure.read(run.failure_file, lenient=True)
        blocked = RunBlock.read(run.blocked_file, lenient=True)
        if failure:
            row["why"] = f"step {failure.step}: {failure.error.type}: {failure.error.message}"
        elif blocked:
            row["why"] = f"{blocked.step}: {blocked.reason}"
        rows.append(row)
    return rows


def last_gate(ws: Workspace) -> dict[str, Any] | None:
    """The newest ``gate.json`` under ``runs/`` (by modification time), summarised."""
    path = _newest(ws.runs_dir.glob(f"*/**/{GATE_FILE}")) if ws.runs_dir.is_dir() else None
    if path is None:
        return None
    from components.gate import GateDecision
    from schemas import SchemaError

    where = {"path": str(path), "run_id": path.relative_to(ws.runs_dir).parts[0]}
    try:
        gate = GateDecision.read(path)
    except SchemaError as err:
        log.warning("%s", err)
        return {**where, "decision": "unreadable", "reasons": [], "error": str(err)}
    return {
        **where,
        "decision": gate.decision,
        "reasons": gate.to_dict()["reasons"],
        "decided_at": gate.decided_at,
    }


def rollout_state(ws: Workspace) -> dict[str, Any] | None:
    """The workspace's rollout state, else the newest one a run kept; ``None`` when none exists."""
    path = ws.rollout_state_path if ws.rollout_state_path.is_file() else None
    if path is None and ws.runs_dir.is_dir():
        path = _newest(ws.runs_dir.glob(f"*/**/{ROLLOUT_STATE_FILE}"))
    if path is None:
        return None
    from components.state.rollout_document import RolloutState

    try:
        state = RolloutState.read(path, ValueError)
    except ValueError as err:  # SchemaError too
        log.warning("%s", err)
        return {"path": str(path), "status": "unreadable", "error": str(err)}
    return {"path": str(path), **(state.document() if state else {})}


def _newest(paths: Any) -> Path | None:
    candidates = [p for p in paths if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def _deep_merge(target: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = value
