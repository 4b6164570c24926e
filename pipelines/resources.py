"""Task-level Kubernetes settings of the compiled pipeline: resources, GPUs, retries, caching, wiring.

:func:`configure` applies the compile config's ``resources`` section and the cluster objects of
``manifests/k8s/`` to every task; a local build carries the caching options alone (kfp.local ignores the
rest, and kfp's setters cost ~2.5 s a build). KFP's cache key includes the run directory, so a cache hit
only happens when a run is submitted again with the same ``run_id``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path, PurePosixPath
from typing import Any

from kfp import kubernetes
from kfp.dsl import PipelineTask
from kfp.dsl.pipeline_task import TaskState

from components.deployment import Deployment
from pipelines.config import load_config

COMPILE_CONFIG_ENV = "COMPATFLOW_COMPILE_CONFIG"
DEFAULT_COMPILE_CONFIG = "cluster"
RUNNERS = ("kubernetes", "local")

# op: (kind, retried, cached), and why.
STEPS: dict[str, tuple[str, bool, bool]] = {
    # reads the workspace state (next pending phase); its one write, run.json, is atomic and identical on a
    # retry (same run id, same state within a run)
    "plan_op": ("cpu", True, False),
    # reads the registry's mutable production alias; the download into models/v<N> is verified
    "resolve_production_op": ("cpu", True, False),
    # a function of the (immutable) phase shards; writes only its outputs and its summary in the run dir
    "validate_op": ("cpu", True, True),
    "drift_op": ("cpu", True, True),  # same; production is a versioned path
    # deterministic (seeded) training into its own output artifact; a retry after a preemption starts over
    "continual_op": ("gpu", True, True),
    "compat_op": ("gpu", True, True),  # same
    "evaluate_op": ("gpu", True, True),  # same
    # deterministic, but it reads the policy file by path: a cache key of inputs would miss a policy edit
    "gate_op": ("cpu", True, False),
    "register_op": ("cpu", False, False),  # creates an MLflow model version per call
    # embeds the gallery; indexing skips items already indexed, lineage and promotion are idempotent
    "serve_first_model_op": ("gpu", True, False),
    # embeds the phase's new gallery items; indexing skips items already indexed (lineage: only new ones)
    "ingest_op": ("gpu", True, False),
    # re-embeds the gallery; the rollout resumes from its durable state after any crash; writes live services
    "rollout_op": ("gpu", True, False),
    # (rollout.workers > 1) the rollout up to a stage's rank ranges, then its probe gate; resumable too
    "rollout_ranges_op": ("cpu", True, False),
    # one rank range of a stage (ParallelFor, parallelism: rollout.workers); resumes from its cursor
    "rollout_range_op": ("gpu", True, False),
    "note_blocked_op": ("cpu", True, False),  # an atomic write; caching would skip the write itself
    # exit handler: reads and writes the workspace state; rewrites the same outcome and report on a retry
    "finish_op": ("cpu", True, False),
}
STEP_KINDS: dict[str, str] = {op: kind for op, (kind, _, _) in STEPS.items()}
RETRYABLE: set[str] = {op for op, (_, retried, _) in STEPS.items() if retried}
CACHEABLE: set[str] = {op for op, (_, _, cached) in STEPS.items() if cached}

# Pod evictions, spot-node preemptions and brief service outages: two retries, 1 min then 2 min.
RETRY_POLICY: dict[str, Any] = {
    "num_retries": 2,
    "backoff_duration": "60s",
    "backoff_factor": 2.0,
    "backoff_max_duration": "3600s",
}

# Cluster objects (manifests/k8s/): names, keys and where they appear in the task's pod.
PIPELINE_CONFIG_MAP = "compatflow-pipeline-config"
CONFIG_MAP_ENV: tuple[str, ...] = (
    "COMPATFLOW_CONFIG",
    "COMPATFLOW_WORKSPACE",
    "COMPATFLOW_STREAM_URI",
    "COMPATFLOW_MILVUS_URI",
    "COMPATFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_URI",
    "COMPATFLOW_FEAST_REPO",
    "COMPATFLOW_FEAST_SERVER_URL",
    "COMPATFLOW_FEAST_REGISTRY_PATH",
    "AWS_DEFAULT_REGION",
)
# AWS_ENDPOINT_URL_S3: where the store is not AWS S3; COMPATFLOW_KFP_UI_URL: the report links the run page
OPTIONAL_CONFIG_MAP_ENV: tuple[str, ...] = ("AWS_ENDPOINT_URL_S3", "COMPATFLOW_KFP_UI_URL")
MILVUS_SECRET = "compatflow-milvus"
MILVUS_SECRET_ENV = {"token": "COMPATFLOW_MILVUS_TOKEN"}
OBJECT_STORE_SECRET = "compatflow-object-store"  # optional: absent where pods have workload identity
OBJECT_STORE_SECRET_ENV = {key: key for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
WORKSPACE_PVC = "compatflow-workspace"
FEAST_CONFIG_MAP = "compatflow-feast-repo"
SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
IMAGE_PULL_POLICY = "IfNotPresent"  # tags are immutable release tags; kind loads images without a registry

_ACTIVE: ContextVar[dict[str, Any] | None] = ContextVar("compatflow_compile_settings", default=None)


def compile_settings(
    config: Deployment | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    runner: str = "kubernetes",
) -> dict[str, Any]:
    """The task settings of the config the pipeline is compiled with. ``config`` None: the settings made
    active by :func:`using`, else ``$COMPATFLOW_COMPILE_CONFIG``, else the shipped ``cluster`` config."""
    if config is None:
        active = _ACTIVE.get()
        if active is not None:
            return active
        config = os.environ.get(COMPILE_CONFIG_ENV) or DEFAULT_COMPILE_CONFIG
    if isinstance(config, Mapping):
        config = Deployment.parse(config, source="<config>")
    elif not isinstance(config, Deployment):
        config = load_config(config, local_paths=False)  # the tasks read the config's paths, not this machine
    return task_settings(config, runner=runner)


def task_settings(deployment: Deployment, *, runner: str = "kubernetes") -> dict[str, Any]:
    """What :func:`configure` applies to every task. ``runner`` ``"local"`` drops the retry policy: a local
    failure is a bug or bad data that a retry only repeats."""
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r} is not one of {RUNNERS}")
    resources = deployment.resources
    return {
        "name": deployment.name,
        "config": deployment,
        "runner": runner,
        "cpu": resources.cpu.model_dump(),
        "gpu": {**resources.gpu.model_dump(), "accelerator": resources.gpu.accelerator or ""},
        "retry": dict(RETRY_POLICY) if runner == "kubernetes" else None,
        "workspace_mount": _absolute_path(deployment.workspace),
        "feast_mount": _absolute_path(deployment.lineage.repo),
    }


@contextmanager
def using(settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Make ``settings`` what ``compile_settings()`` returns while a pipeline is built."""
    token = _ACTIVE.set(settings)
    try:
        yield settings
    finally:
        _ACTIVE.reset(token)


def configure(task: PipelineTask, op_name: str, settings: dict[str, Any]) -> PipelineTask:
    """Apply the op's resources, retry, caching and cluster wiring to ``task`` (one already run: as is)."""
    if op_name not in STEP_KINDS:
        raise ValueError(
            f"pipeline op {op_name!r} has no entry in pipelines.resources.STEP_KINDS: "
            "classify it (cpu/gpu) and decide whether it is RETRYABLE and CACHEABLE"
        )
    if task.state == TaskState.FINAL:
        return task
    task.set_caching_options(enable_caching=op_name in CACHEABLE)
    if settings["runner"] == "local":
        return task  # kfp.local acts on caching alone (and retries, which a local build has none of)
    kind = STEP_KINDS[op_name]
    res = settings[kind]
    task.set_cpu_request(res["cpu"]).set_cpu_limit(res["cpu"])
    task.set_memory_request(res["memory"]).set_memory_limit(res["memory"])
    task.set_container_image(res["image"])  # every task: its kind's image (resources.cpu/gpu.image)
    if op_name in RETRYABLE and settings["retry"]:
        task.set_retry(**settings["retry"])
    if kind == "gpu":
        if res["accelerator"]:
            task.set_accelerator_type(res["accelerator"]).set_accelerator_limit(res["accelerator_count"])
        for key, value in sorted(res["node_selector"].items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for toleration in settings["config"].resources.gpu.tolerations:
            kubernetes.add_toleration(task, **toleration.model_dump())
        # DataLoader workers and NCCL exchange tensors through /dev/shm (64 MiB by default in a pod);
        # a memory-backed emptyDir counts against, and is bounded by, the task's memory limit.
        kubernetes.empty_dir_mount(task, volume_name=SHM_VOLUME, mount_path=SHM_PATH, medium="Memory")
    # Service URIs, credentials and volumes (the service account is the run's, not a task setting).
    kubernetes.use_config_map_as_env(task, PIPELINE_CONFIG_MAP, {key: key for key in CONFIG_MAP_ENV})
    kubernetes.use_config_map_as_env(
        task, PIPELINE_CONFIG_MAP, {key: key for key in OPTIONAL_CONFIG_MAP_ENV}, optional=True
    )
    kubernetes.use_secret_as_env(task, MILVUS_SECRET, dict(MILVUS_SECRET_ENV))
    kubernetes.use_secret_as_env(task, OBJECT_STORE_SECRET, dict(OBJECT_STORE_SECRET_ENV), optional=True)
    if settings["workspace_mount"]:
        kubernetes.mount_pvc(task, pvc_name=WORKSPACE_PVC, mount_path=settings["workspace_mount"])
    if settings["feast_mount"]:
        kubernetes.use_config_map_as_volume(task, FEAST_CONFIG_MAP, mount_path=settings["feast_mount"])
    kubernetes.set_image_pull_policy(task, IMAGE_PULL_POLICY)
    return task


def _absolute_path(value: str | None) -> str | None:
    """A mount path for ``value`` if it is an absolute filesystem path (not a URI), else None."""
    return str(PurePosixPath(value)) if value and "://" not in value and Path(value).is_absolute() else None
