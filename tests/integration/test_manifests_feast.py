"""The Feast server's manifest options and feature_store.yaml load with Feast itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _manifests import (
    K8S,
    load_docs,
    the,
    the_container,
)


@pytest.mark.filterwarnings("ignore:Field name .vector_enabled.:UserWarning")
def test_feast_server_options_and_feature_store_yaml_load_with_feast(monkeypatch, tmp_path: Path) -> None:
    from feast.cli.cli import cli
    from feast.repo_config import load_repo_config

    container = the_container(load_docs(K8S / "feast" / "deployment.yaml")[0])
    args = container["args"]
    root_options = {o for p in cli.params for o in p.opts}
    assert args[0].split("=", 1)[0] in root_options and args[1] == "serve"
    serve_options = {o for p in cli.commands["serve"].params for o in p.opts}
    for arg in args[2:]:
        assert arg.split("=", 1)[0] in serve_options, f"feast serve has no option {arg}"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "feature-repo")
    assert args[0] == f"--chdir={mount['mountPath']}"

    repo = the(load_docs(K8S / "feast" / "configmap.yaml"), "ConfigMap", "compatflow-feast-repo")
    text = repo["data"]["feature_store.yaml"]
    provided = {e["name"] for e in container["env"]}
    values = {
        "COMPATFLOW_FEAST_REGISTRY_PATH": "s3://bucket/registry.pb",
        "COMPATFLOW_MILVUS_URI": "http://milvus.milvus.svc.cluster.local:19530",
        "COMPATFLOW_MILVUS_TOKEN": "compatflow:password",
    }
    for variable in re.findall(r"\$\{(\w+)\}", text):
        assert variable in provided, (
            f"feature_store.yaml reads ${{{variable}}}; the container does not set it"
        )
        monkeypatch.setenv(variable, values[variable])
    (tmp_path / "feature_store.yaml").write_text(text)
    config = load_repo_config(tmp_path, tmp_path / "feature_store.yaml")
    assert config.registry.path == values["COMPATFLOW_FEAST_REGISTRY_PATH"]
    assert (config.online_store.type, config.online_store.uri) == ("milvus", values["COMPATFLOW_MILVUS_URI"])
    assert config.online_store.token == values["COMPATFLOW_MILVUS_TOKEN"]
    # The loader rejects what it does not know, so the check above can fail.
    (tmp_path / "feature_store.yaml").write_text(text.replace("vector_enabled", "vector_enable"))
    with pytest.raises(Exception, match="vector_enable"):
        load_repo_config(tmp_path, tmp_path / "feature_store.yaml").online_store  # noqa: B018
