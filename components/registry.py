"""MLflow tracking and model registry for compatflow.

One MLflow run per pipeline run (found again by its ``compatflow.run_id`` tag, so a retried task
resumes it), holding parameters, per-phase metrics, the reports as artifacts and the weights as
safetensors artifacts with a sha256 manifest. Candidates are registered as model versions whose
source is the run's ``checkpoint`` artifact directory.

Aliases:

* ``candidate``  -- the latest registered candidate, whatever the gate said (its tags say it).
* ``production`` -- moves only through :meth:`Registry.promote`, which needs a gate pass and a
  completed rollout; the version it replaces becomes ``previous``.
* ``previous``   -- what :meth:`Registry.rollback` restores.

Rollback history: the registered model's tag ``compatflow.production_history`` keeps the versions
that were production, oldest first (a stack). Promote pushes; rollback pops the current version,
makes the top of the stack production again and points ``previous`` at the entry below it (the
alias is removed when there is none), so repeated rollbacks walk further back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from compat.models.checkpoint import sha256_file
from components.workspace import DEFAULT_MODEL_NAME, Workspace

log = logging.getLogger(__name__)

EXPERIMENT = "compatflow"
RUN_TAG = "compatflow.run_id"
HISTORY_TAG = "compatflow.production_history"
CHECKPOINT_PATH = "checkpoint"
MANIFEST = "MANIFEST.sha256.json"
ALIASES = ("production", "candidate", "previous")
ROLLOUT_DONE = "completed"
PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"}
_TAG_LIMIT = 4000
_ROLLBACK_HOOKS: list[Callable[[dict[str, Any]], None]] = []


class RegistryError(RuntimeError):
    """A registry operation cannot be done; the message says why and what to do."""


class CheckpointIntegrityError(RegistryError):
    """A workspace copy of a registered model differs from the manifest it was registered with."""


class PromotionError(RegistryError):
    """``production`` may not move to this version (no gate pass, or rollout not completed)."""


class RollbackHookError(RegistryError):
    """The registry rolled back, but at least one rollback hook failed (``result`` lists them)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def register_rollback_hook(hook: Callable[[dict[str, Any]], None]) -> None:
    """Call ``hook(event)`` after every rollback in this process (plugins in ``components.plugins`` too)."""
    _ROLLBACK_HOOKS.append(hook)


def unregister_rollback_hook(hook: Callable[[dict[str, Any]], None]) -> None:
    _ROLLBACK_HOOKS.remove(hook)


def metric_key(name: str) -> str:
    """An MLflow-legal metric/param name: ``R@1`` -> ``R_at_1``, other illegal characters -> ``_``."""
    return re.sub(r"[^\w./\- :]", "_", name.replace("@", "_at_"))


def file_manifest(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` (the manifest itself excluded)."""
    manifest = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            manifest[rel] = sha256_file(path)
    return manifest


class Registry:
    """MLflow runs, model versions and aliases of one registered model in one workspace."""

    def __init__(
        self,
        workspace: Workspace | str | Path | None = None,
        *,
        tracking_uri: str | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        experiment: str = EXPERIMENT,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.workspace = Workspace.coerce(workspace)
        self.tracking_uri = tracking_uri or self.workspace.mlflow_uri
        self.model_name = model_name
        self.experiment = experiment
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            if self.tracking_uri.startswith("sqlite:///"):
                Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        return self._client

    def exists(self) -> bool:
        """Whether the store is there (a local sqlite file is not created by asking)."""
        if self.tracking_uri.startswith("sqlite:///"):
            return Path(self.tracking_uri.removeprefix("sqlite:///")).is_file()
        return True

    # --- runs ------------------------------------------------------------------------------

    def experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        location = self.workspace.artifacts_dir.as_uri() if self.tracking_uri.startswith("sqlite:") else None
        if location:
            self.workspace.artifacts_dir.mkdir(parents=True, exist_ok=True)
        return self.client.create_experiment(self.experiment, artifact_location=location)

    def start_run(
        self,
        pipeline_run_id: str,
        *,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """The MLflow run id of pipeline run ``pipeline_run_id``: resumed when it exists, else created."""
        experiment_id = self.experiment_id()
        quoted = pipeline_run_id.replace("'", "\\'")
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{quoted}'", max_results=1
        )
        if found:
            run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            log.info("resuming MLflow run %s of pipeline run %s", run_id, pipeline_run_id)
        else:
            run = self.client.create_run(
                experiment_id, run_name=pipeline_run_id, tags={RUN_TAG: pipeline_run_id, **(tags or {})}
            )
            run_id = run.info.run_id
            log.info("started MLflow run %s for pipeline run %s", run_id, pipeline_run_id)
        if params:
            self.log_params(run_id, params)
        return run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log (nested) parameters as ``a.b`` keys; a value differing from an earlier one is an error."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        flat = {metric_key(k): str(v)[:6000] for k, v in _flatten(params).items()}
        try:
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in flat.items()])
        except MlflowException as err:
            raise RegistryError(f"MLflow run {run_id}: cannot log parameters ({err.message})") from err

    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log (nested) numeric metrics, e.g. per data phase with ``step=phase``."""
        from mlflow.entities import Metric

        now = int(datetime.now(UTC).timestamp() * 1000)
        batch = [
            Metric(metric_key(k), float(v), now, step or 0)
            for k, v in _flatten(metrics).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        for start in range(0, len(batch), 500):
            self.client.log_batch(run_id, metrics=batch[start : start + 500])

    def log_compat_report(
        self, run_id: str, report: Mapping[str, Any] | str | Path, step: int | None = None
    ) -> None:
        """Retrieval matrix and margins of a compat_report as metrics, the file itself as an artifact."""
        if not isinstance(report, Mapping):
            self.log_artifact(run_id, report)
            report = json.loads(Path(report).read_text())
        phase = report.get("data_phase") if step is None else step
        self.log_metrics(
            run_id,
            {"retrieval": report.get("retrieval", {}), "margins": report.get("margins", {})},
            step=phase if isinstance(phase, int) else None,
        )

    def local_artifacts(self, artifact_uri: str) -> Path | None:
        """Where a ``file:`` artifact URI of a workspace-local store lives in *this* workspace.

        MLflow records absolute artifact locations; the part after ``mlartifacts/`` is resolved under this
        workspace's artifacts folder, so a copied or restored workspace reads and writes its own artifacts
        and never the original's. None for a tracking server (its artifact store is not the workspace's).
        """
        from urllib.parse import unquote, urlparse

        if not self.tracking_uri.startswith("sqlite:") or not artifact_uri.startswith("file:"):
            return None
        parts = Path(unquote(urlparse(artifact_uri).path)).parts
        marker = self.workspace.artifacts_dir.name
        if marker not in parts:
            return None
        at = len(parts) - 1 - parts[::-1].index(marker)
        return self.workspace.artifacts_dir.joinpath(*parts[at + 1 :])

    def _log(self, run_id: str, source: Path, artifact_path: str) -> None:
        """Log a file or a directory's content under ``artifact_path`` of the run."""
        local = self.local_artifacts(self.client.get_run(run_id).info.artifact_uri)
        if local is None:
            log_fn = self.client.log_artifacts if source.is_dir() else self.client.log_artifact
            log_fn(run_id, str(source), artifact_path)
        elif source.is_dir():
            shutil.copytree(source, local / artifact_path, dirs_exist_ok=True)
        else:
            (local / artifact_path).mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, local / artifact_path / source.name)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str = "reports") -> None:
        """A report file (or a directory of them) as artifacts of the run."""
        path = Path(path)
        if path.is_dir():
            self._log(run_id, path, f"{artifact_path}/{path.name}")
        elif path.is_file():
            self._log(run_id, path, artifact_path)
        else:
            raise RegistryError(f"cannot log {path}: no such file or directory")

    def log_weights(
        self, run_id: str, checkpoint_dir: str | Path, artifact_path: str = CHECKPOINT_PATH
    ) -> dict[str, str]:
        """Log a safetensors checkpoint directory plus its sha256 manifest; returns the manifest."""
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.is_dir():
            raise RegistryError(f"checkpoint {checkpoint_dir} is not a directory")
        manifest = file_manifest(checkpoint_dir)
        pickled = [p for p in manifest if Path(p).suffix.lower() in PICKLE_SUFFIXES]
        if pickled:
            raise RegistryError(
                f"checkpoint {checkpoint_dir} holds pickle-format files {pickled}: "
                "registered weights must be safetensors (save with safetensors.torch.save_file)"
            )
        if not any(p.endswith(".safetensors") for p in manifest):
            raise RegistryError(f"checkpoint {checkpoint_dir} has no .safetensors file to register")
        self._log(run_id, checkpoint_dir, artifact_path)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            self._log(run_id, Path(tmp) / MANIFEST, artifact_path)
        return manifest

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
        """Log the checkpoint, register it as a new version, tag it, point ``candidate`` at it.

        Idempotent per MLflow run (a resumed pipeline run keeps its MLflow run): the version an earlier
        attempt registered with the same weights is reused; one with other weights that was never served
        (no ``production`` / ``previous`` alias) is deleted first, so interrupted runs orphan no version.
        """
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(self.model_name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        digest = _manifest_digest(file_manifest(Path(checkpoint_dir)))
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
        manifest = self.log_weights(run_id, checkpoint_dir)
        artifact_uri = self.client.get_run(run_id).info.artifact_uri
        pipeline_run = self.client.get_run(run_id).data.tags.get(RUN_TAG, "")
        version_tags = {
            "data_phase": str(data_phase),
            "method": method,
            "checkpoint.sha256": _manifest_digest(manifest),
            RUN_TAG: pipeline_run,
            **_gate_tags(gate),
            **{k: str(v)[:_TAG_LIMIT] for k, v in (tags or {}).items()},
        }
        version = str(
            self.client.create_model_version(
                self.model_name, source=f"{artifact_uri}/{CHECKPOINT_PATH}", run_id=run_id, tags=version_tags
            ).version
        )
        self.client.set_registered_model_alias(self.model_name, "candidate", version)
        log.info(
            "registered %s version %s (gate: %s)", self.model_name, version, version_tags["gate.decision"]
        )
        return self.version_info(version)

    def version_info(self, version: str | int) -> dict[str, Any]:
        mv = self.client.get_model_version(self.model_name, str(version))
        return {
            "version": str(mv.version),
            "run_id": mv.run_id,
            "source": mv.source,
            "created_at": datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC).isoformat(
                timespec="seconds"
            ),
            "aliases": sorted(getattr(mv, "aliases", []) or []),
            "tags": dict(mv.tags),
        }

    def alias_version(self, alias: str) -> str | None:
        """The version an alias points at, or None (also when the model is not registered yet)."""
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None

    def promote(
        self, version: str | int | None = None, *, rollout_state: Mapping[str, Any] | str | Path
    ) -> dict:
        """Move ``production`` to ``version`` (default: ``candidate``); old production becomes ``previous``.

        Refuses unless the version's gate decision is ``pass`` and ``rollout_state`` (the rollout's
        state document or its path) has ``state == "completed"`` (and names this version when it
        names one, under ``model_version`` or ``candidate_version``).
        """
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
        state = _load_state(rollout_state)
        if state.get("state") != ROLLOUT_DONE:
            raise PromotionError(
                f"{self.model_name} version {version} cannot become production: rollout state is "
                f"{state.get('state')!r}, not {ROLLOUT_DONE!r} (finish `compatflow rollout` first)"
            )
        named = state.get("model_version", state.get("candidate_version"))
        if named is not None and str(named) != version:
            raise PromotionError(f"the completed rollout is of version {named}, not {version}")

        current = self.alias_version("production")
        if current == version:
            return self.status()
        history = self._history()
        if current is not None:
            self.client.set_registered_model_alias(self.model_name, "previous", current)
            if not history or history[-1] != current:
                history.append(current)
        history.append(version)
        self.client.set_registered_model_alias(self.model_name, "production", version)
        self.client.set_model_version_tag(self.model_name, version, "promoted_at", _now())
        self._set_history(history)
        log.info("%s production: %s -> %s", self.model_name, current, version)
        return self.status()

    def rollback(self, *, run_hooks: bool = True) -> dict[str, Any]:
        """Move ``production`` back to ``previous``, all or nothing; returns what happened.

        Every plugin's ``prepare_rollback`` hook first checks that its part can be done (the gallery: the
        rollout that put production there is found and readable, the index reachable); any refusal raises
        :class:`RegistryError` with nothing changed. Then the rollback hooks undo the serving side
        (idempotent) and only then do the aliases move, so a hook that fails leaves the registry where it was
        (:class:`RollbackHookError`) and running the rollback again completes it. Raises
        :class:`RegistryError` when there is nothing to roll back to.
        """
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
        at = _now()
        event = {
            "workspace": str(self.workspace.root),
            "lineage_repo": str(self.workspace.feast_dir),
            "model_name": self.model_name,
            "tracking_uri": self.tracking_uri,
            "from_version": current,
            "to_version": previous,
            "previous_version": new_previous,
            "rolled_back_at": at,
        }
        result = {**event, "hooks": []}
        if run_hooks:
            from components import plugins

            refused = [
                h for h in plugins.call_all(plugins.hooks("prepare_rollback"), dict(event)) if not h["ok"]
            ]
            if refused:
                raise RegistryError(
                    f"rollback of {self.model_name} from version {current} to {previous} refused, nothing "
                    "changed: " + "; ".join(f"{h['hook']}: {h['error']}" for h in refused)
                )
            functions = [(getattr(h, "__qualname__", repr(h)), h) for h in _ROLLBACK_HOOKS]
            result["hooks"] = plugins.call_all(functions + plugins.hooks("on_rollback"), dict(event))
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

    def download(
        self, ref: str = "production", dst: str | Path | None = None, *, verify: bool = True
    ) -> Path:
        """Download a version's checkpoint (``ref``: an alias or a version number) via ``models:/``.

        With ``verify`` every file is checked against the manifest, and the manifest against
        the digest tagged on the version at registration; any mismatch raises.
        """
        import mlflow.artifacts

        is_version = ref.isdigit()
        version = ref if is_version else self.alias_version(ref)
        if version is None:
            raise RegistryError(f"{self.model_name} has no {ref!r} alias")
        uri = f"models:/{self.model_name}/{ref}" if is_version else f"models:/{self.model_name}@{ref}"
        dst = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix=f"{self.model_name}-{version}-"))
        if dst.exists() and any(dst.iterdir()):
            shutil.rmtree(dst)
        dst.mkdir(parents=True, exist_ok=True)
        source = self.local_artifacts(self.client.get_model_version(self.model_name, version).source)
        if source is not None:  # this workspace's copy of the version's files (see local_artifacts)
            if not source.is_dir():
                raise RegistryError(f"{self.model_name} version {version}: its files {source} are missing")
            local = Path(shutil.copytree(source, dst, dirs_exist_ok=True))
        else:
            with _mlflow_uris(self.tracking_uri):
                local = Path(
                    mlflow.artifacts.download_artifacts(
                        artifact_uri=uri,
                        dst_path=str(dst),
                        tracking_uri=self.tracking_uri,
                        registry_uri=self.tracking_uri,
                    )
                )
        if verify:
            expected_digest = self.version_info(version)["tags"].get("checkpoint.sha256")
            verify_checkpoint(local, expected_digest)
        return local

    # --- history tag -----------------------------------------------------------------------

    def _history(self) -> list[str]:
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
        """Resume the pipeline run's MLflow run, log what the run produced, register the candidate.

        Logs ``params``, the compatibility report (metrics at step ``data_phase`` + the file), the
        training metrics (per-domain recalls at step ``data_phase``, the loss curve by training step,
        + the file), any other ``reports`` (e.g. gate.json, drift.json, the Evidently HTML), and registers
        ``checkpoint_dir`` as a candidate version tagged with the phase, method and gate decision.
        """
        run_id = self.start_run(pipeline_run_id, params=params)
        if compat_report is not None:
            self.log_compat_report(run_id, compat_report, step=data_phase)
        if training_metrics is not None:
            self.log_artifact(run_id, training_metrics)
            doc = json.loads(Path(training_metrics).read_text())
            for point in doc.get("curve") or []:
                step = point.get("step")
                if isinstance(step, int):
                    self.log_metrics(
                        run_id, {f"train.{k}": v for k, v in point.items() if k != "step"}, step=step
                    )
            per_domain = {k: doc[k] for k in ("domains", "forgetting_r1") if isinstance(doc.get(k), Mapping)}
            self.log_metrics(run_id, {"phase": per_domain}, step=data_phase)
        for path in reports:
            if Path(path).exists():
                self.log_artifact(run_id, path)
        info = self.register_candidate(
            run_id, checkpoint_dir, data_phase=data_phase, method=method, gate=gate
        )
        return {"mlflow_run_id": run_id, **info}


def verify_checkpoint(directory: str | Path, expected_digest: str | None = None) -> dict[str, str]:
    """Check every file of a downloaded checkpoint against its manifest; returns the manifest."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointIntegrityError(f"{directory} has no {MANIFEST}: cannot verify the checkpoint")
    manifest = json.loads(manifest_path.read_text())
    if expected_digest is not None and _manifest_digest(manifest) != expected_digest:
        raise CheckpointIntegrityError(
            f"{manifest_path} does not match the digest registered with the model version"
        )
    actual = file_manifest(directory)
    if actual != manifest:
        bad = sorted(k for k in set(actual) | set(manifest) if actual.get(k) != manifest.get(k))
        raise CheckpointIntegrityError(
            f"checkpoint {directory} differs from its manifest in: {', '.join(bad)}"
        )
    return manifest


# --- helpers ---------------------------------------------------------------------------------


@contextmanager
def _mlflow_uris(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking and registry URIs at ``uri`` for the block, then restore them.

    MLflow 3.17 resolves ``models:/`` URIs through a client built from the global URIs even when
    ``download_artifacts(tracking_uri=..., registry_uri=...)`` are given (and would otherwise
    create ``./mlflow.db``), so the download needs them set.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved_env = {name: os.environ.get(name) for name in names}
    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])
        registry_utils._registry_uri = saved[1]
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def _load_state(state: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(state, Mapping):
        return dict(state)
    try:
        doc = json.loads(Path(state).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PromotionError(f"cannot read the rollout state {state}: {err}") from err
    if not isinstance(doc, dict):
        raise PromotionError(f"rollout state {state} is not a JSON object")
    return doc


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _manifest_digest(manifest: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(manifest), sort_keys=True).encode()).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
