"""The rehearsal's config is the cluster's, with only its sizes and service locations changed, and its tasks
run as the images' user."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipelines.rehearsal import (
    SCALED,
    TASK_GID,
    TASK_UID,
    Layout,
    feature_store_yaml,
    image_environment,
    rehearsal_config,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_rehearsal_runs_the_cluster_config_with_only_sizes_and_locations_changed(tmp_path):
    from components.deployment import Deployment
    from pipelines.config import CONFIG_DIR, check

    layout = Layout(tmp_path)
    config = rehearsal_config(
        layout, index_uri="http://127.0.0.1:19530", tracking_uri="http://127.0.0.1:5000"
    )
    deployment = check(config, source="rehearsal", local_paths=False)
    cluster = Deployment.parse(yaml.safe_load((CONFIG_DIR / "cluster.yaml").read_text()), source="cluster")
    assert deployment.index.uri == "http://127.0.0.1:19530"
    assert deployment.registry.tracking_uri == "http://127.0.0.1:5000"
    assert deployment.lineage.repo == str(layout.feature_repo) and deployment.workspace == str(
        layout.workspace
    )
    assert deployment.stream.uri == str(layout.stream) and not deployment.stream.generate_if_missing
    changed = {
        "name",
        "workspace",
        "gate",
        "resolved_for",
    }  # the gate: the rehearsal's permissive policy file
    moved = {("stream", "uri"), ("registry", "tracking_uri"), ("lineage", "repo"), ("index", "uri")}
    for section in type(cluster).model_fields:
        if section in changed:
            continue
        for key, field in type(getattr(cluster, section)).model_fields.items():
            if (field.alias or key) in SCALED.get(section, {}) or (section, key) in moved:
                continue
            given, shipped = getattr(getattr(config, section), key), getattr(getattr(cluster, section), key)
            assert given == shipped, f"{section}.{key} differs from cluster.yaml"
    assert config.compat.method == cluster.compat.method  # the cluster's method, small
    assert deployment.rollout.workers == 2  # the backfill's ParallelFor fans out


def test_the_tasks_run_as_the_images_user_and_feast_reads_the_clusters_file():
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (ROOT / "manifests" / "docker" / dockerfile).read_text()
        assert f"USER {TASK_UID}:{TASK_GID}" in text, dockerfile
    store = yaml.safe_load(feature_store_yaml())
    assert store["online_store"]["type"] == "milvus"
    assert store["online_store"]["uri"] == "${COMPATFLOW_MILVUS_URI}"


def test_the_tasks_get_the_images_environment_and_nothing_else_of_this_process(tmp_path):
    """The keys of the CPU image's final ENV (the tasks run on CPU here) and the task user's name: nothing of
    the process that starts the rehearsal (a test session's TMPDIR, a library's multiprocess folder)."""
    import re

    text = (ROOT / "manifests" / "docker" / "Dockerfile.cpu").read_text()
    block = text[text.rindex("\nENV ") :].split("\n\n")[0]  # the last ENV instruction and its continued lines
    keys = set(re.findall(r"(?:ENV |\\\n\s*)([A-Z_]+)=", block))
    env = image_environment(Layout(tmp_path))
    assert "HF_HUB_OFFLINE" in keys and set(env) - keys == {"LANG", "USER", "LOGNAME"}
    assert keys <= set(env)
    assert all(env[k].startswith(str(tmp_path)) for k in ("HOME", "TMPDIR", "HF_HOME", "TORCH_HOME"))
