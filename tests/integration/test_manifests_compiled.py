"""The compiled pipeline's task settings (kfp's compiler) name the objects the manifests create, and the
check finds a broken copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _manifests import (
    OVERLAYS,
    _cluster_config,
    compiled_executors,
    mutated,
    task_setting_violations,
)


def compile_cluster_tasks(path: Path) -> Path:
    """A CPU and a GPU stage of the real components, configured with the cluster config."""
    from kfp import compiler, dsl

    from components import kfp_ops
    from pipelines import resources

    settings = resources.compile_settings("cluster")

    @dsl.pipeline(name="cluster-task-settings")
    def pipeline():  # no annotations: this module postpones them and KFP reads them at runtime
        validation = resources.configure(
            kfp_ops.validate_op(config="{}", phase=1, shards=[], run_dir="/mnt/compatflow/runs/r"),
            "validate_op",
            settings,
        )
        resources.configure(
            kfp_ops.continual_op(
                config="{}",
                run_dir="/mnt/compatflow/runs/r",
                phase=1,
                stream_dir="s3://stream",
                accepted=validation.outputs["accepted"],
                production="/mnt/compatflow/models/v1",
            ),
            "continual_op",
            settings,
        )

    compiler.Compiler().compile(pipeline, str(path))
    return path


@pytest.fixture(scope="module")
def cluster_task_executors(tmp_path_factory) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return compiled_executors(compile_cluster_tasks(tmp_path_factory.mktemp("compiled") / "tasks.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compiled_task_settings_reference_the_manifests(
    rendered, cluster_task_executors, overlay: str
) -> None:
    config = _cluster_config()
    gpu = [
        name
        for name, container, _ in cluster_task_executors
        if container.get("resources", {}).get("accelerator")
    ]
    assert gpu == ["exec-continual-op"], "the GPU stage must request the GPU pool"
    assert all(k8s.get("pvcMount") and k8s.get("secretAsEnv") for _, _, k8s in cluster_task_executors)
    violations = task_setting_violations(cluster_task_executors, rendered[overlay], config)
    if overlay != "cluster":  # only the cluster overlay retags images to the registry cluster.yaml names
        violations = [v for v in violations if "image" not in v.split(" is not ")[-1]]
    assert not violations, f"overlays/{overlay}:\n" + "\n".join(violations)


def test_task_setting_check_catches_a_broken_copy(rendered, cluster_task_executors) -> None:
    config = _cluster_config()
    docs = mutated(
        rendered["cluster"],
        "ConfigMap",
        "compatflow-pipeline-config",
        lambda d: d["data"].pop("COMPATFLOW_TRACKING_URI"),
    )
    assert any(
        "COMPATFLOW_TRACKING_URI" in v for v in task_setting_violations(cluster_task_executors, docs, config)
    )
    docs = mutated(
        rendered["cluster"],
        "PyTorchJob",
        "compatflow-train",
        lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].update(
            nodeSelector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        ),
    )
    assert any("GPU pool" in v for v in task_setting_violations(cluster_task_executors, docs, config))
