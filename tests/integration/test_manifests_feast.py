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


@pytest.mark.filterwarnings("ignore:Field name .vector_enabled.:UserWarning")
def test_feast_apply_runs_from_the_configmap_files_and_registers_the_push_source(
    monkeypatch, tmp_path: Path
) -> None:
    """The ConfigMap holds ``items.py`` (the shipped one) beside ``feature_store.yaml``: ``feast apply`` run
    in a folder holding exactly its files (the registry and Milvus pointed here, milvus-lite standing in)
    registers the PushSource and the feature view fed by it, and lineage pushed through it reads back."""
    import os
    import subprocess
    import sys

    from components.adapters.feature_repo import REPO_TEMPLATE_DIR, items
    from components.adapters.lineage import LineageStore

    data = the(load_docs(K8S / "feast" / "configmap.yaml"), "ConfigMap", "compatflow-feast-repo")["data"]
    assert set(data) == {"feature_store.yaml", "items.py"}
    assert data["items.py"] == (REPO_TEMPLATE_DIR / "items.py").read_text()
    repo = tmp_path / "configmap"
    repo.mkdir()
    for name, text in data.items():
        (repo / name).write_text(text)
    monkeypatch.setenv("COMPATFLOW_FEAST_REGISTRY_PATH", str(tmp_path / "registry.db"))
    monkeypatch.setenv("COMPATFLOW_MILVUS_URI", str(tmp_path / "milvus.db"))
    monkeypatch.setenv("COMPATFLOW_MILVUS_TOKEN", "")
    env = dict(os.environ)
    feast = [sys.executable, "-m", "feast.cli.cli", "--chdir", str(repo)]
    done = subprocess.run([*feast, "apply"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = subprocess.run(
        [*feast, "data-sources", "list"], capture_output=True, text=True, env=env, timeout=300
    )
    assert items.ITEMS_PUSH in listed.stdout and "PushSource" in listed.stdout, listed.stdout + listed.stderr

    lineage = LineageStore(tmp_path / "written", definition=repo)  # as a pod: the mount read, a copy written
    lineage.apply()
    row = {"item_id": "a", "model_version": "3", "space_id": "s3", "caption": "a red circle", "phase": 2}
    lineage.write_items([{**row, "image_uri": "shard.tar#a", "domain": "shapes"}])
    (row,) = lineage.get_items(["a"])
    assert (row["model_version"], row["caption"]) == ("3", "a red circle")
