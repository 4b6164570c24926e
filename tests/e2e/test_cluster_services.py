"""Operator commands on the cluster config, against cluster-style services started here.

An MLflow tracking server on 127.0.0.1, a Milvus standalone server (the cluster's kind of index; the
milvus-lite server is exercised by the integration tier) and a Feast repo definition outside the workspace
(read, never written, as the cluster's ConfigMap volume) stand in for the cluster's. A model is
served and an upgrade shipped through the pipeline's steps; then ``status``, ``search``, ``report`` and
``rollback`` run with ``--config`` and reach those services, never a local fallback, and a rollback that
cannot update the lineage changes nothing.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from _lineage import version_counts
from _pipelines import PERMISSIVE_POLICY, Cycle

from components.adapters.feature_repo import REPO_TEMPLATE_DIR


@pytest.mark.parametrize("milvus_server", ["milvus-standalone"], indirect=True)
def test_operator_commands_on_the_cluster_config_reach_its_services(
    tmp_path, mlflow_server, milvus_server, stream_dir
):
    from typer.testing import CliRunner

    from components.adapters.index import gallery_status
    from components.adapters.lineage import LineageStore
    from components.adapters.registry import Registry
    from pipelines.cli import app
    from pipelines.config import load_config, resolve

    config = load_config("cluster", local_paths=False).to_dict()  # every setting: the file's and the defaults
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(stream_dir), generate_if_missing=False)
    config["drift"]["sample_size"] = 24
    config["training"].update(
        model_config="cf-tiny",
        pretrained=None,
        steps=3,
        batch_size=16,
        replay_buffer_size=16,
        replay_rows=4,
        device="cpu",
    )
    config["compat"].update(method="bct", scenario="continual", steps=3, batch_size=16, options={})
    config["gate"]["policy"] = str(policy)
    config["registry"]["tracking_uri"] = mlflow_server
    definition = tmp_path / "feature-repo"  # outside the workspace, as the mounted ConfigMap
    definition.mkdir()
    shutil.copyfile(REPO_TEMPLATE_DIR / "feature_store.yaml", definition / "feature_store.yaml")
    config["lineage"]["repo"] = str(definition)
    config["index"].update(uri=milvus_server, alias="cluster_services_gallery")
    config["rollout"]["batch_size"] = 16
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump(config))
    resolved = resolve(config).to_dict()

    cycle = Cycle(resolved)
    cycle.bootstrap()
    assert cycle.ship(1)["promoted"]
    registry = Registry(resolved["workspace"], tracking_uri=mlflow_server)
    assert registry.alias_version("production") == "2"

    def cli(*args: str):
        return CliRunner().invoke(app, [*args, "--config", str(config_file)])

    status = cli("status")
    assert status.exit_code == 0 and mlflow_server in status.output and "production  v2" in status.output
    hits = cli("search", "a red circle", "-k", "3", "--json")
    assert hits.exit_code == 0 and len(json.loads(hits.output)) == 3
    assert cli("report").exit_code == 0
    assert not (tmp_path / "ws" / "mlflow.db").exists()
    assert sorted(p.name for p in definition.iterdir()) == ["feature_store.yaml"]  # only read

    # The lineage repo cannot be updated: the rollback is refused and nothing changes.
    repo = tmp_path / "ws" / "feast"  # where lineage is written: the workspace's copy of the definition
    (repo / "feature_store.yaml").rename(repo / "feature_store.yaml.away")
    refused = cli("rollback")
    assert refused.exit_code == 1 and "refused, nothing changed" in refused.output
    assert registry.alias_version("production") == "2"
    gallery = gallery_status(milvus_server, "cluster_services_gallery")
    assert gallery["by_version"] == {"2": 32}

    (repo / "feature_store.yaml.away").rename(repo / "feature_store.yaml")
    done = cli("rollback")
    assert done.exit_code == 0, done.output
    assert registry.alias_version("production") == "1"
    assert gallery_status(milvus_server, "cluster_services_gallery")["by_version"] == {"1": 32}
    assert version_counts(LineageStore(repo)) == {"1": 32}
    shutil.rmtree(tmp_path / "ws" / "runs")
