"""The query path's model check: a serving record's query model is loaded only when its folder matches the
digest the registry recorded for that version (a folder re-hashed to match itself passes no more). A
workspace with no registry at all (a gallery indexed by ``compatflow rollout run`` alone) has nothing to
check against; a missing workspace copy (``models/v<version>``) is downloaded from the registry, verified."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.serving.record import ServingError

log = logging.getLogger(__name__)


class RegistryDigestCheck:
    """Check a ``query_model`` mapping against the registry of ``workspace``, raising :class:`ServingError`;
    with ``repair`` a workspace copy that fails is replaced by the registry's files, verified."""

    def __init__(
        self, workspace: Any, model_name: str | None = None, *, repair: bool = False, registry: Any = None
    ) -> None:
        from components.state.workspace import DEFAULT_MODEL_NAME, Workspace

        self.workspace = Workspace.coerce(workspace)
        self.model_name = model_name or DEFAULT_MODEL_NAME
        self.repair = repair
        self._registry: Any = registry

    def __call__(self, query_model: Mapping[str, Any]) -> None:
        uri = str(query_model.get("uri") or "")
        if not uri:
            return
        folder = Path(uri)
        version = str(query_model.get("version", ""))
        if self._registry is None:
            from components.adapters.registry import Registry

            self._registry = Registry(self.workspace, model_name=self.model_name)
        registry = self._registry
        where = f"query model {version or '(no version)'} at {folder}"
        if not registry.exists():  # a bare index (`compatflow rollout run` on a folder): nothing to check
            log.warning("%s: no registry at %s to verify it against", where, registry.tracking_uri)
            return
        from compat.models.integrity import CheckpointIntegrityError
        from components.adapters.registry import RegistryError

        try:
            digest = registry.version_info(version)["tags"].get("checkpoint.sha256")
        except RegistryError as exc:
            raise ServingError(f"{where}: {exc}; refusing to serve it") from exc
        if not digest:
            raise ServingError(
                f"{where}: the registry records no checkpoint.sha256 for version {version}; "
                "refusing to serve it"
            )
        copy = self.workspace.model_dir(version)
        ours = folder.resolve() == copy.resolve()  # the workspace copy: downloaded on use when missing
        try:
            if ours:
                registry.local_copy(version, replace_damaged=self.repair)
            else:
                registry.verify_copy(version, folder)
        except (CheckpointIntegrityError, RegistryError, OSError, ValueError) as exc:
            if self.repair and ours:  # a rollback's returning model: the rollback refuses
                fix = "the registry's own files of that version fail it too: restore the registry's artifacts"
            elif ours:
                fix = f"delete {folder} to download the registered files again on the next query"
                fix += ", or `compatflow rollback`"
            else:
                fix = "restore the folder" if self.repair else "restore the folder, or `compatflow rollback`"
            raise ServingError(f"{where} refused: {exc} (registered digest sha256 {digest}); {fix}") from exc
        log.info("%s matches the registered digest %s", where, digest)


def check_returning_model(registry: Any, query_model: Mapping[str, Any]) -> None:
    """Before a rollback switches queries back to ``query_model``: check it against ``registry``, the
    workspace copy downloaded again when missing or damaged; :class:`ServingError` when it cannot match."""
    RegistryDigestCheck(registry.workspace, registry.model_name, repair=True, registry=registry)(query_model)
