"""Operator commands on the cluster config, against cluster-style services started here.

An MLflow tracking server on 127.0.0.1, a milvus-lite server and a Feast repo outside the workspace stand
in for the cluster's. A model is served and an upgrade shipped through the pipeline's steps; then
``status``, ``search``, ``report`` and ``rollback`` run with ``--config`` and reach those services, never a
local fallback, and a rollback that cannot update the lineage changes nothing.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_upgrade_chain import PERMISSIVE_POLICY, Cycle

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server`` on a free loopback port with its own sqlite store and artifact root."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = tmp_path / "mlflow-server"
    data.mkdir()
    log = open(data / "server.log", "wb")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{data}/mlflow.db",
            "--artifacts-destination",
            str(data / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"mlflow server did not start: {(data / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_operator_commands_on_the_cluster_config_reach_its_services(
    tmp_path, mlflow_server, milvus_server, stream_dir
):
    from typer.testing import CliRunner

    from components.index import gallery_status
    from components.lineage import LineageStore
    from components.registry import Registry
    from pipelines.cli import app
    from pipelines.config import CONFIG_DIR, resolve

    config = yaml.safe_load((CONFIG_DIR / "cluster.yaml").read_text())
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(stream_dir), generate_if_missing=False)
    config["drift"]["sample_size"] = 24
    config["training"].update(
        model_config="cf-tiny", steps=3, batch_size=16, replay_buffer_size=16, replay_rows=4, device="cpu"
    )
    config["compat"].update(method="bct", scenario="continual", steps=3, batch_size=16, options={})
    config["gate"]["policy"] = str(policy)
    config["registry"]["tracking_uri"] = mlflow_server
    config["lineage"]["repo"] = str(tmp_path / "feature-repo")  # outside the workspace
    config["index"].update(uri=milvus_server, alias="cluster_services_gallery")
    config["rollout"]["batch_size"] = 16
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump(config))
    resolved = resolve(config)

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
    assert not (tmp_path / "ws" / "mlflow.db").exists() and not (tmp_path / "ws" / "feast").exists()

    # The lineage repo cannot be updated: the rollback is refused and nothing changes.
    repo = Path(resolved["lineage"]["repo"])
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
    assert LineageStore(repo).version_counts() == {"1": 32}
    shutil.rmtree(tmp_path / "ws" / "runs")
