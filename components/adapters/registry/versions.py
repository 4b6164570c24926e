"""Model versions and aliases: candidates registered with their gate decision, ``production`` moved only
by a gate pass and a completed rollout, rollback down the production history, verified local copies."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compat.io import utc_now
from compat.models.integrity import file_manifest, manifest_digest, verify_checkpoint
from components.adapters.registry import sqlite_read
from components.adapters.registry.pyfunc import FILES, MLMODEL
from components.adapters.registry.tracking import RUN_TAG, RegistryError, Tracking

if TYPE_CHECKING:
    from components.state.rollout_document import RolloutState

log = logging.getLogger(__name__)

HISTORY_TAG = "compatflow.production_history"
ALIASES = ("production", "candidate", "previous")
ROLLOUT_DONE = "completed"
_TAG_LIMIT = 4000


class PromotionError(RegistryError):
    """``production`` may not move to this version (no gate pass, or rollout not completed)."""


class RollbackHookError(RegistryError):
    """The registry rolled back, but at least one rollback hook failed (``result`` lists them)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


RollbackHook = Callable[[dict[str, Any]], Any]


def _call_all(hooks: Sequence[RollbackHook], event: dict[str, Any]) -> list[dict[str, Any]]:
    """Call each hook with a copy of ``event``; ``{"hook", "ok", "result" | "error"}`` for every one (a
    failing hook never hides the others)."""
    outcomes: list[dict[str, Any]] = []
    for hook in hooks:
        name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
        try:
            outcomes.append({"hook": name, "ok": True, "result": hook(dict(event))})
        except Exception as err:  # noqa: BLE001 - reported to the caller, never swallowed
            log.error("rollback hook %s failed: %s", name, err)
            outcomes.append({"hook": name, "ok": False, "error": f"{type(err).__name__}: {err}"})
    return outcomes


class Registry(Tracking):
    """Versions and aliases of one registered model in one workspace, and its runs (:class:`Tracking`)."""

    # --- model versions --------------------------------------------------------------------

    def register_candidate(
        self,
        run_id: str,
        checkpoint_dir: str | Path,
        *,
        data_phase: int,
        method: str,
        gate: Any = None,
        tags: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Log the checkpoint, register it as a new version, tag it, point ``candidate`` at it. Idempotent per
        MLflow run: an earlier attempt's version with the same weights is reused; one with other weights that
        was never served is deleted first, so interrupted runs orphan no version."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(self.model_name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        digest = manifest_digest(file_manifest(Path(checkpoint_dir)))
        for earlier in self.client.search_model_versions(f"name='{self.model_name}' and run_id='{run_id}'"):
            if earlier.tags.get("checkpoint.sha256") == digest:
                self.client.set_registered_model_alias(self.model_name, "candidate", str(earlier.version))
                log.info("version %s already registers these weights (resumed run)", earlier.version)
                return self.version_info(earlier.version)
            if {"production", "previous"} & set(getattr(earlier, "aliases", []) or []):
                raise RegistryError(
                    f"run {run_id} registered version {earlier.version}, which is served, with other weights "
                    f"than {checkpoint_dir}: start a new pipeline run instead of resuming this one"
                )
            log.info("deleting version %s: an interrupted attempt of this run registered it", earlier.version)
            self.client.delete_model_version(self.model_name, str(earlier.version))
            self._remove_copy(str(earlier.version), earlier.tags.get("checkpoint.sha256"))
        logged, manifest = self.log_model(run_id, checkpoint_dir)
        run = self.client.get_run(run_id)
        version_tags = {
            "data_phase": str(data_phase),
            "method": method,
            "checkpoint.sha256": manifest_digest(manifest),
            RUN_TAG: run.data.tags.get(RUN_TAG, ""),
            **_gate_tags(gate),
            **{k: str(v)[:_TAG_LIMIT] for k, v in (tags or {}).items()},
        }
        version = str(
            self.client.create_model_version(
                self.model_name, source=f"{run.info.artifact_uri}/{logged}", run_id=run_id, tags=version_tags
            ).version
        )
        self.client.set_registered_model_alias(self.model_name, "candidate", version)
        log.info(
            "registered %s version %s (gate: %s)", self.model_name, version, version_tags["gate.decision"]
        )
        return self.version_info(version)

    def _remove_copy(self, version: str, digest: str | None) -> None:
        """Delete the workspace copy of a deleted version (``models/v<version>``), only when its manifest is
        that version's (a folder of another model's version of the same number is left alone)."""
        from compat.models.integrity import MANIFEST

        copy = self.workspace.model_dir(version)
        try:
            ours = digest is not None and manifest_digest(json.loads((copy / MANIFEST).read_text())) == digest
        except (OSError, ValueError):
            ours = False
        if ours:
            shutil.rmtree(copy)
            log.info("deleted %s, the workspace copy of deleted version %s", copy, version)

    def version_info(self, version: str | int) -> dict[str, Any]:
        """A version's run, source, creation time, aliases and tags; :class:`RegistryError` when not held."""
        missing = f"{self.model_name} version {version} is not in the registry {self.tracking_uri}"
        db = self.sqlite_file()
        if db is not None:
            info = sqlite_read.version_info(db, self.model_name, str(version))
            if info is None:
                raise RegistryError(missing)
            return info
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version(self.model_name, str(version))
        except MlflowException as err:
            raise RegistryError(f"{missing} ({err.error_code})") from err
        aliases = getattr(mv, "aliases", []) or []
        return sqlite_read.version_record(
            mv.version, mv.run_id, mv.source, mv.creation_timestamp, aliases, mv.tags
        )

    def alias_version(self, alias: str) -> str | None:
        """The version an alias points at, or None (also when the model is not registered yet)."""
        db = self.sqlite_file()
        if db is not None:
            return sqlite_read.alias_version(db, self.model_name, alias)
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None

    def promote(self, version: str | int | None = None, *, rollout: RolloutState | None) -> dict:
        """Move ``production`` to ``version`` (default: ``candidate``); old production becomes ``previous``.
        Refuses unless the version's gate decision is ``pass`` and ``rollout`` is a ``completed`` rollout of
        it; ``None`` (no rollout) only for the first production model, whose gallery it indexed itself."""
        version = str(version) if version is not None else self.alias_version("candidate")
        if version is None:
            raise PromotionError(f"{self.model_name} has no candidate version to promote")
        info = self.version_info(version)
        decision = info["tags"].get("gate.decision")
        if decision != "pass":
            why = info["tags"].get("gate.reasons", "")
            raise PromotionError(
                f"{self.model_name} version {version} cannot become production: gate decision is "
                f"{decision or 'missing'}{f' ({why})' if why and why != '[]' else ''}"
            )
        current = self.alias_version("production")
        if rollout is None and current not in (None, version):
            raise PromotionError(
                f"{self.model_name} version {version} cannot replace production {current} without a "
                "completed rollout of it (run `compatflow rollout run` first)"
            )
        if rollout is not None and rollout.status != ROLLOUT_DONE:
            raise PromotionError(
                f"{self.model_name} version {version} cannot become production: rollout status is "
                f"{rollout.status!r}, not {ROLLOUT_DONE!r} (finish `compatflow rollout` first)"
            )
        if rollout is not None and rollout.new_version != version:
            raise PromotionError(f"the completed rollout is of version {rollout.new_version}, not {version}")
        if current == version:
            return self.status()
        history = self._history()
        if current is not None:
            self.client.set_registered_model_alias(self.model_name, "previous", current)
            if not history or history[-1] != current:
                history.append(current)
        history.append(version)
        self.client.set_registered_model_alias(self.model_name, "production", version)
        self.client.set_model_version_tag(self.model_name, version, "promoted_at", utc_now())
        self._set_history(history)
        log.info("%s production: %s -> %s", self.model_name, current, version)
        return self.status()

    def rollback(
        self, *, prepare: Sequence[RollbackHook] = (), undo: Sequence[RollbackHook] = ()
    ) -> dict[str, Any]:
        """Move ``production`` back to ``previous``, all or nothing; returns what happened. The ``prepare``
        hooks may refuse first (nothing changed); the idempotent ``undo`` hooks (the serving side,
        :func:`components.steps.rollback_production`) run before the aliases move, so a failing hook leaves
        the registry where it was (:class:`RollbackHookError`) and running the rollback again completes it."""
        current = self.alias_version("production")
        previous = self.alias_version("previous")
        if current is None:
            raise RegistryError(f"{self.model_name} has no production version: nothing to roll back")
        if previous is None:
            raise RegistryError(
                f"{self.model_name} version {current} is production and there is no previous version "
                "to restore"
            )
        stack = self._history()
        if stack and stack[-1] == current:
            stack.pop()
        if not stack or stack[-1] != previous:
            stack.append(previous)
        new_previous = stack[-2] if len(stack) >= 2 else None
        at = utc_now()
        event = {
            "workspace": str(self.workspace.root),
            "lineage_repo": str(self.workspace.lineage_dir),
            "model_name": self.model_name,
            "tracking_uri": self.tracking_uri,
            "from_version": current,
            "to_version": previous,
            "previous_version": new_previous,
            "rolled_back_at": at,
        }
        result = {**event, "hooks": []}
        if prepare or undo:
            refused = [h for h in _call_all(prepare, event) if not h["ok"]]
            if refused:
                raise RegistryError(
                    f"rollback of {self.model_name} from version {current} to {previous} refused, nothing "
                    "changed: " + "; ".join(f"{h['hook']}: {h['error']}" for h in refused)
                )
            result["hooks"] = _call_all(undo, event)
            failed = [h for h in result["hooks"] if not h["ok"]]
            if failed:
                raise RollbackHookError(
                    f"rollback hooks failed, so production stays version {current} in the registry: "
                    + "; ".join(f"{h['hook']}: {h['error']}" for h in failed)
                    + " (the hooks are idempotent: fix the cause and run the rollback again)",
                    result,
                )
        self.client.set_registered_model_alias(self.model_name, "production", previous)
        if new_previous is not None:
            self.client.set_registered_model_alias(self.model_name, "previous", new_previous)
        else:
            self.client.delete_registered_model_alias(self.model_name, "previous")
        self.client.set_model_version_tag(self.model_name, current, "rolled_back_at", at)
        self._set_history(stack)
        log.info("%s rolled back: production %s -> %s", self.model_name, current, previous)
        return result

    def status(self) -> dict[str, Any]:
        """Production, candidate and previous versions with their tags, and the production history."""
        doc: dict[str, Any] = {"model": self.model_name, "tracking_uri": self.tracking_uri}
        for alias in ALIASES:
            version = self.alias_version(alias)
            doc[alias] = self.version_info(version) if version is not None else None
        doc["history"] = self._history()
        return doc

    def verify_copy(self, version: str, directory: str | Path) -> dict[str, str]:
        """Check a local copy of ``version`` file by file against its manifest, and the manifest against
        the digest recorded at registration (a copy with swapped weights and re-hashed sidecar and
        manifest is refused); raises :class:`CheckpointIntegrityError`."""
        return verify_checkpoint(directory, self.version_info(version)["tags"].get("checkpoint.sha256"))

    def local_copy(self, version: str, *, replace_damaged: bool = False) -> Path:
        """The workspace copy of ``version``, checked against the registered digest; a missing or interrupted
        one is downloaded beside it, verified, then renamed into place (no reader sees half a copy). A copy
        that differs raises :class:`CheckpointIntegrityError`, or with ``replace_damaged`` is replaced."""
        from compat.models.integrity import MANIFEST, CheckpointIntegrityError

        target = self.workspace.model_dir(version)
        damaged: CheckpointIntegrityError | None = None
        if (target / MANIFEST).is_file():
            try:
                self.verify_copy(version, target)
                return target
            except CheckpointIntegrityError as exc:
                if not replace_damaged:
                    raise
                damaged = exc
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            self.download(version, staging)  # verified against the registered digest
            if damaged is not None:
                log.warning("%s fails its check (%s): the registry's files replace it", target, damaged)
                aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-damaged-", dir=target.parent))
                target.rename(aside / target.name)  # out of the way first: its name is free for the good copy
                shutil.rmtree(aside, ignore_errors=True)
            elif target.is_dir() and not (target / MANIFEST).is_file():
                log.warning("%s holds no %s (an interrupted download): replacing it", target, MANIFEST)
                shutil.rmtree(target, ignore_errors=True)
            try:
                staging.rename(target)
            except OSError:  # another process put a copy there first: use it if it is the registered one
                if not (target / MANIFEST).is_file():
                    raise
                self.verify_copy(version, target)
            else:
                log.info("downloaded %s version %s to %s", self.model_name, version, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def download(
        self, ref: str = "production", dst: str | Path | None = None, *, verify: bool = True
    ) -> Path:
        """Download a version's model files (``ref``: an alias or a version number) into ``dst``: the MLflow
        model's ``data/checkpoint`` (or a plain-files version's source), with ``verify`` checked against the
        manifest and the manifest against the digest tagged at registration."""
        version = ref if ref.isdigit() else self.alias_version(ref)
        if version is None:
            raise RegistryError(f"{self.model_name} has no {ref!r} alias")
        dst = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix=f"{self.model_name}-{version}-"))
        if dst.exists() and any(dst.iterdir()):
            shutil.rmtree(dst)
        dst.mkdir(parents=True, exist_ok=True)
        mv = self.client.get_model_version(self.model_name, version)
        source = self.local_artifacts(mv.source)
        if source is not None:  # this workspace's copy of the version's files (see local_artifacts)
            if not source.is_dir():
                raise RegistryError(f"{self.model_name} version {version}: its files {source} are missing")
            files = source / FILES if (source / MLMODEL).is_file() else source
            local = Path(shutil.copytree(files, dst, dirs_exist_ok=True))
        else:
            local = self._download_remote(mv, dst)
        if verify:
            expected_digest = self.version_info(version)["tags"].get("checkpoint.sha256")
            verify_checkpoint(local, expected_digest)
        return local

    def _download_remote(self, mv: Any, dst: Path) -> Path:
        """A version's files from the tracking server's artifact store (through the run's artifacts)."""
        root = self.client.get_run(mv.run_id).info.artifact_uri.rstrip("/")
        if not mv.source.startswith(root + "/"):
            raise RegistryError(
                f"{self.model_name} version {mv.version}: its source {mv.source} is not an artifact of run "
                f"{mv.run_id} ({root}); register it again"
            )
        path = mv.source[len(root) + 1 :]
        names = {Path(f.path).name for f in self.client.list_artifacts(mv.run_id, path)}
        files = f"{path}/{FILES}" if MLMODEL in names else path
        with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
            fetched = Path(self.client.download_artifacts(mv.run_id, files, tmp))
            shutil.copytree(fetched, dst, dirs_exist_ok=True)
        return dst

    # --- history tag -----------------------------------------------------------------------

    def _history(self) -> list[str]:
        db = self.sqlite_file()
        if db is not None:
            raw = sqlite_read.model_tag(db, self.model_name, HISTORY_TAG) or "[]"
        else:
            from mlflow.exceptions import MlflowException

            try:
                raw = self.client.get_registered_model(self.model_name).tags.get(HISTORY_TAG, "[]")
            except MlflowException:
                return []
        try:
            return [str(v) for v in json.loads(raw)]
        except (json.JSONDecodeError, TypeError):
            log.warning("ignoring unreadable %s tag on %s: %r", HISTORY_TAG, self.model_name, raw)
            return []

    def _set_history(self, history: list[str]) -> None:
        trimmed = history[-200:]
        self.client.set_registered_model_tag(self.model_name, HISTORY_TAG, json.dumps(trimmed))

    def register_run(
        self,
        pipeline_run_id: str,
        checkpoint_dir: str | Path,
        *,
        data_phase: int,
        method: str,
        gate: Any = None,
        compat_report: str | Path | None = None,
        training_metrics: str | Path | None = None,
        reports: Iterable[str | Path] = (),
        params: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Log a pipeline run's params, reports and metrics to its MLflow run; register ``checkpoint_dir``."""
        run_id = self.start_run(pipeline_run_id, params=params)
        if compat_report is not None:
            self.log_artifact(run_id, compat_report)
            report = json.loads(Path(compat_report).read_text())
            self.log_metrics(
                run_id, {k: report.get(k, {}) for k in ("retrieval", "margins")}, step=data_phase
            )
        if training_metrics is not None:
            self.log_artifact(run_id, training_metrics)
            doc = json.loads(Path(training_metrics).read_text())
            if not self.client.get_metric_history(run_id, "train.loss"):  # else the training step logged it
                log_point = self.step_logger(run_id, "train.", every=500)
                for point in doc.get("curve") or []:
                    if isinstance(point.get("step"), int):
                        log_point(point)
                log_point.flush()
            per_domain = {k: doc[k] for k in ("domains", "forgetting_r1") if isinstance(doc.get(k), Mapping)}
            self.log_metrics(run_id, {"phase": per_domain}, step=data_phase)
        for path in reports:
            if Path(path).exists():
                self.log_artifact(run_id, path)
        info = self.register_candidate(
            run_id, checkpoint_dir, data_phase=data_phase, method=method, gate=gate
        )
        return {
            "mlflow_run_id": run_id,
            "model_name": self.model_name,
            "tracking_uri": self.tracking_uri,
            **info,
        }


def _gate_tags(gate: Any) -> dict[str, str]:
    """``gate.decision`` / ``gate.reasons`` / ``gate.report_sha256`` tags from a decision, dict or path."""
    if gate is None:
        return {"gate.decision": "none", "gate.reasons": "[]"}
    if isinstance(gate, str | Path):
        gate = json.loads(Path(gate).read_text())
    elif hasattr(gate, "to_dict"):
        gate = gate.to_dict()
    reasons = [f"[{r.get('code')}] {r.get('message')}" for r in gate.get("reasons", [])]
    text = json.dumps(reasons)
    while len(text) > _TAG_LIMIT and reasons:
        reasons = reasons[:-1]
        text = json.dumps(reasons + ["... (truncated; see gate.json)"])
    return {
        "gate.decision": str(gate.get("decision", "none")),
        "gate.reasons": text,
        "gate.report_sha256": str(gate.get("report_sha256") or ""),
    }
