"""Feast lineage of gallery items on a real local repo (file offline store), its online store on sqlite (the
embedded default) and on a Milvus standalone server (the cluster's: manifests/k8s/feast/configmap.yaml)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _milvus import server_uri

from components.feature_repo import REPO_TEMPLATE_DIR
from components.lineage import LineageError, LineageStore, sync_from_index

ONLINE_STORES = ("sqlite", "milvus-standalone")


def repo_on(repo_dir: Path, online: str, request: pytest.FixtureRequest) -> LineageStore:
    """A lineage repo whose online store is ``online``; on the shared Milvus server each repo gets its own
    Feast project (its collections are named after it) and its collections are dropped afterwards."""
    if online == "milvus-standalone":
        uri = server_uri(request, online)
        repo_dir.mkdir(parents=True)
        template = (REPO_TEMPLATE_DIR / "feature_store.yaml").read_text()
        milvus = (
            f"online_store:\n  type: milvus\n  uri: {uri}\n  vector_enabled: false\n"
            "  consistency_level: Strong\n"
        )
        text = template.replace("project: compatflow", f"project: lineage_{uuid.uuid4().hex[:8]}")
        text = text.replace("online_store:\n  type: sqlite\n  path: data/online.db\n", milvus)
        assert "type: milvus" in text
        (repo_dir / "feature_store.yaml").write_text(text)
    store = LineageStore(repo_dir)
    store.apply()
    return store


@pytest.fixture(scope="module", params=ONLINE_STORES)
def lineage(request, tmp_path_factory) -> LineageStore:
    return repo_on(tmp_path_factory.mktemp("ws") / "feast", request.param, request)


def gallery(version: str, ids: list[str]) -> list[dict]:
    return [
        {
            "item_id": i,
            "caption": f"caption of {i}",
            "image_uri": f"shards/phase-0/{i}.jpg",
            "model_version": version,
            "space_id": "space-v1",
            "phase": 0,
            "domain": "street",
        }
        for i in ids
    ]


def test_write_read_and_backfill_update(lineage: LineageStore) -> None:
    assert (lineage.repo_dir / "feature_store.yaml").is_file() and (lineage.repo_dir / "items.py").is_file()
    assert lineage.write_items(gallery("1", ["item-a", "item-b", "item-c"])) == 3

    rows = lineage.get_items(["item-b", "item-a", "unknown"])
    assert [r["item_id"] for r in rows] == ["item-b", "item-a", "unknown"]
    assert rows[0]["model_version"] == "1" and rows[0]["caption"] == "caption of item-b"
    assert rows[0]["space_id"] == "space-v1" and rows[0]["phase"] == 0 and rows[0]["domain"] == "street"
    assert isinstance(rows[0]["embedded_at"], datetime)
    assert rows[2]["model_version"] is None

    # the backfill re-embeds item-a with version 2 in the same space
    embedded = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    frame = pd.DataFrame(gallery("2", ["item-a"])).assign(embedded_at=embedded)
    lineage.write_items(frame)
    updated = lineage.get_items(["item-a"])[0]
    assert updated["model_version"] == "2" and updated["embedded_at"] == embedded
    assert lineage.versions_by_item(["item-a", "item-b"]) == {"item-a": "2", "item-b": "1"}
    assert lineage.versions_by_item() == {"item-a": "2", "item-b": "1", "item-c": "1"}
    assert lineage.version_counts() == {"1": 2, "2": 1}

    # offline history keeps both writes, and Feast's point-in-time join sees the newest
    parts = sorted(lineage.items_dir.glob("*.parquet"))
    assert len(parts) == 2 and not list(lineage.items_dir.glob(".*"))
    from components.feature_repo import items

    entity_df = pd.DataFrame({"item_id": ["item-a", "item-b"], "event_timestamp": [datetime.now(UTC)] * 2})
    history = lineage.store.get_historical_features(entity_df=entity_df, features=items.FEATURES).to_df()
    assert dict(zip(history["item_id"], history["model_version"], strict=True)) == {
        "item-a": "2",
        "item-b": "1",
    }


def test_reopened_store_reads_the_same(lineage: LineageStore) -> None:
    again = LineageStore(lineage.repo_dir)
    again.apply()  # idempotent; keeps the data
    assert again.get_items(["item-c"])[0]["model_version"] == "1"


def test_bad_rows_are_refused(lineage: LineageStore) -> None:
    with pytest.raises(LineageError, match="model_version"):
        lineage.write_items([{"item_id": "x", "space_id": "s"}])
    with pytest.raises(LineageError, match="unknown column"):
        lineage.write_items([{"item_id": "x", "model_version": "1", "space_id": "s", "vector": [0.1]}])
    with pytest.raises(LineageError, match="empty"):
        lineage.write_items([{"item_id": "x", "model_version": "", "space_id": "s"}])
    assert lineage.write_items([]) == 0
    with pytest.raises(LineageError, match="apply"):
        LineageStore(lineage.repo_dir.parent / "elsewhere").get_items(["x"])


@pytest.mark.parametrize("online", ONLINE_STORES)
def test_sync_with_index_records_only_changed_items(tmp_path, online, request) -> None:
    lineage = repo_on(tmp_path / "feast", online, request)
    lineage.write_items(gallery("1", ["item-a", "item-b", "item-c"]))
    served = [
        {
            "item_id": i,
            "model_version": v,
            "space_id": "space-v1",
            "embedded_at": 1_700_000_000_000,
            "phase": 0,
        }
        for i, v in (("item-a", "2"), ("item-b", "2"), ("item-c", "1"))
    ]
    assert lineage.sync_with_index(served) == 2
    rows = {r["item_id"]: r for r in lineage.get_items(["item-a", "item-c"])}
    assert rows["item-a"]["model_version"] == "2" and rows["item-c"]["model_version"] == "1"
    assert rows["item-a"]["caption"] == gallery("1", ["item-a"])[0]["caption"]  # carried over
    assert lineage.version_counts() == {"2": 2, "1": 1}
    assert lineage.sync_with_index(served) == 0


def test_a_rollback_on_a_milvus_server_syncs_lineage_from_the_gallery(tmp_path, request) -> None:
    """The cluster's layout: gallery and Feast's online store on one Milvus server. Indexing v1, then a
    rollback that leaves the alias on a collection written by v0, brings the online lineage back to v0."""
    from components.index import GalleryIndex

    lineage = repo_on(tmp_path / "feast", "milvus-standalone", request)
    uri, alias = server_uri(request, "milvus-standalone"), f"l{uuid.uuid4().hex[:8]}"
    ids = [f"item-{i}" for i in range(6)]
    vectors = np.eye(6, 8, dtype=np.float32) + 0.1
    with GalleryIndex(uri, alias) as index:
        old = index.create_collection("space-v1", 8)
        index.index_items(ids, vectors, "0", "space-v1", collection=old)
        new = index.create_collection("space-v1", 8)
        index.index_items(ids, vectors, "1", "space-v1", collection=new)
        index.switch_alias(new)
    assert sync_from_index(lineage.repo_dir, uri, alias) == 6
    assert set(lineage.versions_by_item(ids).values()) == {"1"}
    with GalleryIndex(uri, alias) as index:  # the rollback moves the alias back
        index.switch_alias(old)
    assert sync_from_index(lineage.repo_dir, uri, alias) == 6
    online = lineage.get_items(ids)
    assert [r["model_version"] for r in online] == ["0"] * 6
    assert all(isinstance(r["embedded_at"], datetime) for r in online)
    assert sync_from_index(lineage.repo_dir, uri, alias) == 0


def test_the_lineage_command_reads_feast_and_checks_it_against_the_index(tmp_path):
    """On-call's read of the lineage: an item's model version from the online store, and --check failing
    when Feast holds versions the (here empty) index does not."""
    import json

    from typer.testing import CliRunner

    from pipelines.cli import app

    ws = tmp_path / "ws"
    store = repo_on(ws / "feast", "sqlite", None)
    store.write_items(gallery("7", ["a", "b"]))
    runner = CliRunner()
    shown = runner.invoke(app, ["lineage", "a", "zz", "--workspace", str(ws), "--json"])
    assert shown.exit_code == 0, shown.output
    items = {row["item_id"]: row for row in json.loads(shown.stdout)["items"]}
    assert items["a"]["model_version"] == "7" and items["a"]["caption"] == "caption of a"
    assert items["zz"]["model_version"] is None
    checked = runner.invoke(app, ["lineage", "--check", "--workspace", str(ws)])
    assert checked.exit_code == 1 and "lineage {'7': 2} / index {}: they DISAGREE" in checked.stdout
    missing = runner.invoke(app, ["lineage", "a", "--workspace", str(tmp_path / "empty")])
    assert missing.exit_code == 1 and "no lineage repo" in missing.output
