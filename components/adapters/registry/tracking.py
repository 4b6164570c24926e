"""MLflow tracking of pipeline runs: one MLflow run per pipeline run with its parameters, metrics,
reports and its model (an MLflow pyfunc model around the safetensors weights and their sha256 manifest)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from compat.models.integrity import MANIFEST, file_manifest, manifest_digest, pickled_files
from components.adapters.registry import pyfunc
from components.adapters.registry.relocate import rebase_artifacts
from components.state.workspace import DEFAULT_MODEL_NAME, Workspace

log = logging.getLogger(__name__)

EXPERIMENT = "compatflow"
RUN_TAG = "compatflow.run_id"
CHECKPOINT_PATH = "checkpoint"  # the weights as plain files (versions that are not a compatflow model)
MODEL_PATH = "model"  # the MLflow model (components.adapters.registry.pyfunc)
RUN_END_STATUSES = ("FINISHED", "FAILED", "KILLED")


class RegistryError(RuntimeError):
    """A registry operation cannot be done; the message says why and what to do."""


def metric_key(name: str) -> str:
    """An MLflow-legal metric/param name: ``R@1`` -> ``R_at_1``, other illegal characters -> ``_``."""
    return re.sub(r"[^\w./\- :]", "_", name.replace("@", "_at_"))


class Tracking:
    """The MLflow runs of one workspace's pipeline runs (the run half of :class:`Registry`)."""

    def __init__(
        self,
        workspace: Workspace | str | Path | None = None,
        *,
        tracking_uri: str | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.workspace = Workspace.coerce(workspace)
        self.tracking_uri = tracking_uri or self.workspace.mlflow_uri
        self.model_name = model_name
        self.experiment = EXPERIMENT
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The MLflow client of the store; a copied workspace's own store is first pointed at its artifacts
        (:func:`~components.adapters.registry.relocate.rebase_artifacts`)."""
        if self._client is None:
            from mlflow import MlflowClient

            if self.tracking_uri.startswith("sqlite:///"):
                Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            db = self.sqlite_file()
            if db is not None and db.resolve() == self.workspace.mlflow_store.resolve():
                rebase_artifacts(db, self.workspace.artifacts_dir, self.experiment)
            with warnings.catch_warnings():  # MLflow's store warns of its own loader, every start
                warnings.filterwarnings("ignore", message="The ``noload`` loader strategy is deprecated")
                self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        return self._client

    def exists(self) -> bool:
        """Whether the store is there (a local sqlite file is not created by asking)."""
        return not self.tracking_uri.startswith("sqlite:///") or self.sqlite_file() is not None

    def sqlite_file(self) -> Path | None:
        """The embedded store's file when there is one (read directly: :mod:`.sqlite_read`), else None."""
        path = Path(self.tracking_uri.removeprefix("sqlite:///"))
        return path if self.tracking_uri.startswith("sqlite:///") and path.is_file() else None

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
        found = self._runs_of(experiment_id, pipeline_run_id)
        if found:
            run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            log.info("resuming MLflow run %s of pipeline run %s", run_id, pipeline_run_id)
        else:
            tags = {RUN_TAG: pipeline_run_id, **(tags or {})}
            run_id = self.client.create_run(experiment_id, run_name=pipeline_run_id, tags=tags).info.run_id
            log.info("started MLflow run %s for pipeline run %s", run_id, pipeline_run_id)
        if params:
            self.log_params(run_id, params)
        return run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def find_run(self, pipeline_run_id: str) -> str | None:
        """The MLflow run id of pipeline run ``pipeline_run_id``, or None when it never logged anything."""
        if not self.exists() or self.client.get_experiment_by_name(self.experiment) is None:
            return None
        found = self._runs_of(self.experiment_id(), pipeline_run_id)
        return found[0].info.run_id if found else None

    def _runs_of(self, experiment_id: str, pipeline_run_id: str) -> list[Any]:
        """The MLflow run tagged with ``pipeline_run_id`` (a list of at most one)."""
        quoted = pipeline_run_id.replace("'", "\\'")
        return self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{quoted}'", max_results=1
        )

    def end_pipeline_run(self, pipeline_run_id: str, status: str) -> str | None:
        """End ``pipeline_run_id``'s MLflow run with ``status``; returns its id, None if it logged nothing."""
        if status not in RUN_END_STATUSES:
            raise ValueError(f"an MLflow run ends {' / '.join(RUN_END_STATUSES)}, not {status!r}")
        run_id = self.find_run(pipeline_run_id)
        if run_id is not None:
            self.end_run(run_id, status)
        return run_id

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
        _log_numbers(self.client, run_id, [(k, v, step or 0) for k, v in _flatten(metrics).items()])

    def step_logger(self, run_id: str, prefix: str, *, every: int = 20) -> StepMetrics:
        """A callable that logs step records (``{"step": n, name: value, ...}``) as ``<prefix><name>`` at step
        ``n`` of ``run_id``, ``every`` records in one batch (call ``flush()`` at the end)."""
        return StepMetrics(self, run_id, prefix, every)

    def local_artifacts(self, artifact_uri: str) -> Path | None:
        """Where a ``file:`` artifact URI of a workspace-local store lives in *this* workspace: the part after
        ``mlartifacts/`` under this workspace's artifacts folder, so a copied workspace reads and writes its
        own artifacts (MLflow records absolute ones: :mod:`~.relocate`). None for a tracking server."""
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

    def log_model(self, run_id: str, checkpoint_dir: str | Path) -> tuple[str, dict[str, str]]:
        """Log a safetensors model folder and its sha256 manifest as the run's MLflow model (:mod:`.pyfunc`,
        or plain files under ``checkpoint`` if not a compatflow model); the artifact path and the manifest."""
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.is_dir():
            raise RegistryError(f"checkpoint {checkpoint_dir} is not a directory")
        manifest = file_manifest(checkpoint_dir)
        pickled = pickled_files(manifest)
        if pickled:
            raise RegistryError(
                f"checkpoint {checkpoint_dir} holds pickle-format files {pickled}: "
                "registered weights must be safetensors (save with safetensors.torch.save_file)"
            )
        if not any(p.endswith(".safetensors") for p in manifest):
            raise RegistryError(f"checkpoint {checkpoint_dir} has no .safetensors file to register")
        with tempfile.TemporaryDirectory() as tmp:
            files = Path(tmp) / pyfunc.CHECKPOINT_DIR
            shutil.copytree(checkpoint_dir, files, copy_function=_link_or_copy)
            (files / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            facts = pyfunc.describe(files)
            if facts is None:
                self._log(run_id, files, CHECKPOINT_PATH)
                return CHECKPOINT_PATH, manifest
            model = pyfunc.save(Path(tmp) / MODEL_PATH, files, facts, manifest_digest(manifest))
            self._log(run_id, model, MODEL_PATH)
        return MODEL_PATH, manifest


class StepMetrics:
    """Training records logged to an MLflow run while training runs (:meth:`Tracking.step_logger`)."""

    def __init__(self, tracking: Tracking, run_id: str, prefix: str, every: int) -> None:
        self.tracking, self.run_id, self.prefix, self.every = tracking, run_id, prefix, max(1, every)
        self._pending: list[dict[str, Any]] = []

    def __call__(self, record: Mapping[str, Any]) -> None:
        self._pending.append(dict(record))
        if len(self._pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Log the records not logged yet, one batch."""
        points = [
            (f"{self.prefix}{name}", value, int(record["step"]))
            for record in self._pending
            for name, value in record.items()
            if name != "step"
        ]
        self._pending.clear()
        _log_numbers(self.tracking.client, self.run_id, points)


def _log_numbers(client: Any, run_id: str, points: list[tuple[str, Any, int]]) -> None:
    """Log the numeric ``(name, value, step)`` points (booleans and other values left out), 500 a call."""
    from mlflow.entities import Metric

    now = int(datetime.now(UTC).timestamp() * 1000)
    batch = [
        Metric(metric_key(name), float(value), now, step)
        for name, value, step in points
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]
    for start in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[start : start + 500])


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link a weights file into a staging folder (copied across file systems)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        flat.update(_flatten(value, f"{name}.") if isinstance(value, Mapping) else {name: value})
    return flat
