"""``compatflow adopt``: a team's own collection (its field names, vectors from a checkpoint open_clip wrote)
becomes production version 1 without re-embedding, and vectors another model made are refused with nothing
written. The team's collection is never changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from pipelines.cli import app

N_ITEMS = 48
TEAM = "team_items"
TINY = {  # the shape of cf-tiny, so that config reads the weights
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def _open_clip_weights(path: Path, seed: int) -> Path:
    """A tiny CLIP built and saved by open_clip and torch themselves; returns the model file."""
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.CLIP(**TINY).eval()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    return path


def _images(folder: Path) -> list[Path]:
    folder.mkdir()
    rng = np.random.default_rng(0)
    paths = []
    for i in range(N_ITEMS):
        pixels = rng.integers(0, 255, size=(64, 64, 3), dtype=np.uint8)
        path = folder / f"{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def _team_collection(uri: str, weights: Path, images: list[Path]) -> Any:
    """The team's collection on a Milvus server, made with plain pymilvus and open_clip: its own field names
    and index; returns the team's client."""
    import open_clip
    from pymilvus import DataType, MilvusClient

    from components.adapters.index import LITE_GRPC_OPTIONS

    model = open_clip.CLIP(**TINY).eval()
    model.load_state_dict(torch.load(weights, weights_only=True))
    preprocess = open_clip.image_transform(64, is_train=False)
    with torch.no_grad():
        pixels = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in images])
        vectors = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1).numpy()
    client = MilvusClient(uri, grpc_options=dict(LITE_GRPC_OPTIONS))  # as every client of a loopback server
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("pk", DataType.INT64, is_primary=True)
    schema.add_field("emb", DataType.FLOAT_VECTOR, dim=64)
    schema.add_field("url", DataType.VARCHAR, max_length=512)
    schema.add_field("text", DataType.VARCHAR, max_length=256)
    index = client.prepare_index_params()
    index.add_index(field_name="emb", index_type="FLAT", metric_type="IP")
    client.create_collection(TEAM, schema=schema, index_params=index)
    client.insert(
        TEAM,
        [
            {"pk": 1000 + i, "emb": vectors[i].tolist(), "url": str(p), "text": f"picture number {i}"}
            for i, p in enumerate(images)
        ],
    )
    client.flush(TEAM)
    return client


def _snapshot(client: Any) -> dict:
    """What adoption must leave as it was: the team's collections, schema, aliases and rows."""
    rows = client.query(TEAM, filter="pk >= 0", output_fields=["pk", "emb", "url", "text"], limit=100)
    described = client.describe_collection(TEAM)
    return {
        "collections": sorted(client.list_collections()),
        "aliases": described.get("aliases", []),
        "fields": [(f["name"], int(f["type"])) for f in described["fields"]],
        "rows": sorted((r["pk"], tuple(np.round(r["emb"], 6)), r["url"], r["text"]) for r in rows),
    }


@pytest.fixture(scope="module")
def team(tmp_path_factory, milvus_lite_server):
    root = tmp_path_factory.mktemp("team")
    weights = _open_clip_weights(root / "team_clip.pt", seed=1234)
    other = _open_clip_weights(root / "other_clip.pt", seed=99)
    images = _images(root / "images")
    client = _team_collection(milvus_lite_server, weights, images)
    yield {"uri": milvus_lite_server, "weights": weights, "other": other, "client": client}
    client.drop_collection(TEAM)
    client.close()


def _adopt(ws: Path, team: dict, weights: Path | str, *extra: str):
    args = ["adopt", "--workspace", str(ws), "--uri", str(team["uri"]), "--collection", TEAM]
    args += ["--id-field", "pk", "--vector-field", "emb", "--image-field", "url", "--caption-field", "text"]
    return CliRunner().invoke(app, [*args, "--arch", "cf-tiny", "--weights", str(weights), *extra])


def test_adopts_the_collection_and_its_model_as_production_version_1(team, tmp_path):
    from components.adapters.index import GalleryIndex
    from components.adapters.registry import Registry
    from components.runs import read_state
    from components.serving.record import read_serving

    before = _snapshot(team["client"])
    ws = tmp_path / "ws"
    done = _adopt(ws, team, team["weights"])
    assert done.exit_code == 0, done.output
    assert f"proof: {N_ITEMS} sampled items, 0 unreadable" in done.output and "threshold 0.99" in done.output

    record = read_serving(ws / "serving.json")
    assert record.query_model.version == "1" and record.dim == 64
    with GalleryIndex(record.uri, alias=record.alias) as index:
        assert index.serving_collection() == record.collection
        assert index.count() == N_ITEMS and index.count_by_version() == {"1": N_ITEMS}
        row = index.fetch(["1007"])[0]
    stored = next(r for r in before["rows"] if r[0] == 1007)
    assert np.allclose(row["vector"], stored[1], atol=1e-5) and row["source_uri"] == stored[2]

    registry = Registry(ws)
    assert registry.alias_version("production") == "1"
    assert registry.version_info("1")["tags"]["adopted_from"].endswith(f"#{TEAM}")
    assert Path(record.query_model.uri) == ws / "models" / "v1"
    assert read_state(ws).phases["0"].status == "succeeded"
    summary = json.loads(next(ws.glob("runs/adopt-*/adopt/adoption.json")).read_text())
    assert summary["n_items"] == N_ITEMS and summary["proof"]["cosine_median"] >= 0.99
    note = next(ws.glob("runs/adopt-*/adopt/adoption.md")).read_text()
    assert f"{N_ITEMS} items, all of model version 1 (production)" in note and "Untouched: `" in note

    checked = CliRunner().invoke(app, ["lineage", "--check", "--workspace", str(ws), "--json"])
    assert checked.exit_code == 0, checked.output
    shown = CliRunner().invoke(app, ["lineage", "1007", "--workspace", str(ws), "--json"])
    item = json.loads(shown.stdout)["items"][0]
    assert item["model_version"] == "1" and item["caption"] == "picture number 7"

    assert _snapshot(team["client"]) == before  # the team's collection, schema and vectors as they were
    again = _adopt(ws, team, team["weights"])
    assert again.exit_code == 3 and "already serves" in again.output


def test_vectors_of_another_model_are_refused_with_nothing_written(team, tmp_path):
    before = _snapshot(team["client"])
    ws = tmp_path / "ws"
    refused = _adopt(ws, team, team["other"])
    assert refused.exit_code == 3, refused.output
    assert "does not reproduce the stored vectors" in refused.output and "median cosine" in refused.output
    assert not (ws / "serving.json").exists() and not (ws / "mlflow.db").exists()
    assert not (ws / "milvus").exists() and not (ws / "feast").exists() and not (ws / "models").exists()
    assert _snapshot(team["client"]) == before

    missing = _adopt(ws, team, team["weights"], "--collection", "nobody")
    assert missing.exit_code == 3 and "'nobody' does not exist" in missing.output
    team["client"].release_collection(TEAM)
    try:
        released = _adopt(ws, team, team["weights"])
    finally:
        team["client"].load_collection(TEAM)
    assert released.exit_code == 3 and "is not loaded" in released.output, released.output
    assert not (ws / "serving.json").exists()


def test_a_copy_that_fails_is_dropped_and_the_adoption_runs_again(team, tmp_path, monkeypatch):
    import components.adapters.index as index_module
    from components.adapters.index import GalleryIndex
    from components.adoption import Source, adopt
    from components.state.workspace import Workspace

    real, calls = index_module.make_rows, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (planted)")
        return real(*args, **kwargs)

    ws = Workspace(tmp_path / "ws")
    source = Source(str(team["uri"]), TEAM, "pk", "emb", image_field="url", caption_field="text")
    monkeypatch.setattr(index_module, "make_rows", failing)
    with pytest.raises(OSError, match="planted"):
        adopt(ws, source, arch="cf-tiny", weights=str(team["weights"]), model_name="m", page_size=10)
    with GalleryIndex(ws.index_uri, ws.index_alias) as index:
        assert index.collections() == [] and index.serving_collection() is None
    assert not ws.serving_path.exists() and not (tmp_path / "ws" / "mlflow.db").exists()
    monkeypatch.setattr(index_module, "make_rows", real)
    done = adopt(ws, source, arch="cf-tiny", weights=str(team["weights"]), model_name="m", page_size=10)
    assert done["n_items"] == N_ITEMS and done["collection"] == f"{ws.index_alias}_1_1"


def test_weights_registered_in_mlflow_are_read_from_their_model_uri(team, tmp_path):
    """The team's model as its MLflow registry holds it: ``--weights models:/NAME/VERSION``."""
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'team-mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    experiment = client.create_experiment("team", artifact_location=str(tmp_path / "team-artifacts"))
    run = client.create_run(experiment)
    client.log_artifact(run.info.run_id, str(team["weights"]), "weights")
    client.create_registered_model("team-clip")
    client.create_model_version("team-clip", f"{run.info.artifact_uri}/weights", run_id=run.info.run_id)

    ws = tmp_path / "ws"
    done = _adopt(ws, team, "models:/team-clip/1", "--weights-tracking-uri", store)
    assert done.exit_code == 0, done.output
    assert "median 1.0000" in done.output and (ws / "models" / "v1" / "model.safetensors").is_file()
    missing = _adopt(tmp_path / "ws2", team, "models:/team-clip/7", "--weights-tracking-uri", store)
    assert missing.exit_code == 3 and "cannot download it from MLflow" in missing.output
