"""The MLflow server's manifest options and environment are MLflow's own (its CLI, in a process)."""

from __future__ import annotations

from _manifests import (
    K8S,
    load_docs,
    the_container,
)


def test_mlflow_server_options_and_environment_are_mlflow_s_own() -> None:
    from mlflow.cli import server

    deployment = load_docs(K8S / "mlflow" / "deployment.yaml")[0]
    container = the_container(deployment)
    assert container["command"] == ["mlflow"] and container["args"][0] == "server"
    options = {o: p for p in server.params for o in p.opts}
    for arg in container["args"][1:]:
        assert arg.split("=", 1)[0] in options, f"mlflow server has no option {arg}"
    env = {e["name"]: e for e in container["env"]}
    assert options["--backend-store-uri"].envvar == "MLFLOW_BACKEND_STORE_URI"
    assert "secretKeyRef" in env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]
    assert options["--artifacts-destination"].envvar == "MLFLOW_ARTIFACTS_DESTINATION"
    assert "MLFLOW_ARTIFACTS_DESTINATION" in env
