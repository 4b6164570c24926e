"""Feast lineage of gallery items on a real local repo (file offline store), its online store on sqlite (the
embedded default) and on a Milvus standalone server (the cluster's: manifests/k8s/feast/configmap.yaml)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _lineage import version_counts, versions_by_item
from _milvus import server_uri

from components.adapters.feature_repo import REPO_TEMPLATE_DIR
from components.adapters.lineage import LineageError, LineageStore, sync_from_index

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
    assert versions_by_item(lineage, ["item-a", "item-b"]) == {"item-a": "2", "item-b": "1"}
    assert versions_by_item(lineage, ["item-a", "item-b", "item-c"]) == {
        "item-a": "2",
        "item-b": "1",
        "item-c": "1",
    }
    assert version_counts(lineage) == {"1": 2, "2": 1}

    # offline history keeps both writes, and Feast's point-in-time join sees the newest
    parts = sorted(lineage.items_dir.glob("*.parquet"))
    assert len(parts) == 2 and not list(lineage.items_dir.glob(".*"))
    from components.adapters.feature_repo import items

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
    before = lineage.check_against_index(served, batch_size=2)
    assert before["index"] == {"1": 1, "2": 2} and before["lineage"] == {"1": 3}
    assert before["disagreeing"] == 2 and before["examples"] == ["item-a", "item-b"] and not before["agree"]
    assert lineage.sync_with_index(served, batch_size=2) == 2  # two batches, each compared and written
    rows = {r["item_id"]: r for r in lineage.get_items(["item-a", "item-c"])}
    assert rows["item-a"]["model_version"] == "2" and rows["item-c"]["model_version"] == "1"
    assert rows["item-a"]["caption"] == gallery("1", ["item-a"])[0]["caption"]  # carried over
    assert version_counts(lineage) == {"2": 2, "1": 1}
    assert lineage.sync_with_index(served) == 0
    assert lineage.check_against_index(served)["agree"]


def test_a_sync_killed_before_its_online_write_is_completed_by_the_next(tmp_path, monkeypatch) -> None:
    """The offline part lands before the online rows: a sync that dies between them leaves the online
    store behind, and the next sync writes those items again (the offline store keeps the newest row)."""
    lineage = repo_on(tmp_path / "feast", "sqlite", None)
    lineage.write_items(gallery("1", ["a", "b", "c"]))
    served = [
        {"item_id": i, "model_version": "2", "space_id": "space-v1", "embedded_at": 1_700_000_000_000}
        for i in ("a", "b", "c")
    ]
    real = lineage.store.write_to_online_store

    def killed(*args: object, **kwargs: object) -> None:
        raise OSError("killed")

    monkeypatch.setattr(lineage.store, "write_to_online_store", killed)
    with pytest.raises(OSError, match="killed"):
        lineage.sync_with_index(served)
    assert version_counts(lineage) == {"2": 3}  # offline: written
    assert set(versions_by_item(lineage, ["a", "b", "c"]).values()) == {"1"}  # online: not yet
    monkeypatch.setattr(lineage.store, "write_to_online_store", real)
    assert lineage.sync_with_index(served) == 3
    assert set(versions_by_item(lineage, ["a", "b", "c"]).values()) == {"2"}
    assert version_counts(lineage) == {"2": 3} and lineage.check_against_index(served)["agree"]


def test_a_rollback_on_a_milvus_server_syncs_lineage_from_the_gallery(tmp_path, request) -> None:
    """The cluster's layout: gallery and Feast's online store on one Milvus server. Indexing v1, then a
    rollback that leaves the alias on a collection written by v0, brings the online lineage back to v0."""
    from components.adapters.index import GalleryIndex

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
    assert set(versions_by_item(lineage, ids).values()) == {"1"}
    with GalleryIndex(uri, alias) as index:  # the rollback moves the alias back
        index.switch_alias(old)
    assert sync_from_index(lineage.repo_dir, uri, alias) == 6
    online = lineage.get_items(ids)
    assert [r["model_version"] for r in online] == ["0"] * 6
    assert all(isinstance(r["embedded_at"], datetime) for r in online)
    assert sync_from_index(lineage.repo_dir, uri, alias) == 0


def test_the_sync_and_the_check_fan_out_over_order_key_slices(tmp_path, request, monkeypatch) -> None:
    """Two processes each read half of a gallery's ``order_key`` slices: the sync records every item once,
    the check adds up their answers and finds the one item written since."""
    from components.adapters import lineage as lineage_mod
    from components.adapters.index import GalleryIndex
    from components.adapters.lineage import check_from_index

    monkeypatch.setattr(lineage_mod, "SLICE_ROWS", 40)  # 300 items: 7 slices
    store = repo_on(tmp_path / "feast", "sqlite", request)
    uri, alias = server_uri(request, "milvus-lite"), f"l{uuid.uuid4().hex[:8]}"
    ids = [f"item-{i}" for i in range(300)]
    vectors = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32)
    with GalleryIndex(uri, alias) as index:
        name = index.create_collection("s", 8)
        index.index_items(ids, vectors, "1", "s", collection=name)
        index.switch_alias(name)
    assert sync_from_index(store.repo_dir, uri, alias, workers=2) == 300
    check = check_from_index(store.repo_dir, uri, alias, workers=2)
    assert check["agree"] and check["index"] == {"1": 300} == check["lineage"]
    with GalleryIndex(uri, alias) as index:
        index.index_items(ids[:1], vectors[:1], "2", "s", collection=name)
    check = check_from_index(store.repo_dir, uri, alias, workers=2)
    assert not check["agree"] and check["disagreeing"] == 1 and check["examples"] == ["item-0"]


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
    assert checked.exit_code == 1 and "they DISAGREE" in checked.stdout
    assert "no gallery is served, but the lineage records items" in checked.stdout
    missing = runner.invoke(app, ["lineage", "a", "--workspace", str(tmp_path / "empty")])
    assert missing.exit_code == 1 and "no lineage repo" in missing.output


def _tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under ``folder`` with its mtime and content: what a write would change."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted([folder, *folder.rglob("*")])
    }


def test_a_read_only_repo_definition_is_read_never_written(tmp_path):
    """The cluster's layout: ``lineage.repo`` is a ConfigMap volume (read-only). Indexing's lineage write, a
    sync from the index (rollout, rollback) and on-call's reads work from the workspace's copy of the repo;
    nothing under the definition is created, changed or touched, and a changed definition reaches the copy."""
    import os
    import shutil

    from typer.testing import CliRunner

    from components.adapters.index import GalleryIndex
    from components.state.workspace import Workspace
    from pipelines.cli import app

    definition = tmp_path / "etc" / "feast"
    definition.mkdir(parents=True)
    shutil.copyfile(REPO_TEMPLATE_DIR / "feature_store.yaml", definition / "feature_store.yaml")
    for path in (definition / "feature_store.yaml", definition):
        path.chmod(0o555)  # as a mounted ConfigMap (a root test process could still write: compared below)
    before = _tree(definition)
    ws = Workspace(tmp_path / "ws", lineage_repo=definition, index_uri=str(tmp_path / "milvus" / "g.db"))
    assert ws.feast_dir == definition and ws.lineage_definition == definition
    assert ws.lineage_dir == ws.root / "feast"

    store = LineageStore.of(ws)  # what indexing records its items through
    store.apply()
    assert store.write_items(gallery("1", ["item-a", "item-b"])) == 2
    ids = ["item-a", "item-b"]
    with GalleryIndex(ws.index_uri, "gallery") as index:
        collection = index.create_collection("space-v1", 8)
        index.index_items(ids, np.eye(2, 8, dtype=np.float32) + 0.1, "2", "space-v1", collection=collection)
        index.switch_alias(collection)
    assert sync_from_index(ws.lineage_dir, ws.index_uri, "gallery", definition=ws.lineage_definition) == 2
    assert versions_by_item(LineageStore(ws.lineage_dir), ids) == {"item-a": "2", "item-b": "2"}
    assert list((ws.lineage_dir / "data" / "items").glob("*.parquet"))
    shown = CliRunner().invoke(app, ["lineage", "item-a", "--workspace", str(ws.root), "--json"])
    assert shown.exit_code == 0, shown.output
    assert _tree(definition) == before

    # A new ConfigMap version reaches the copy at the next write; a definition without the file is refused.
    os.chmod(definition, 0o755)
    os.chmod(definition / "feature_store.yaml", 0o644)
    changed = (
        (definition / "feature_store.yaml")
        .read_text()
        .replace("cache_ttl_seconds: 0", "cache_ttl_seconds: 5")
    )
    (definition / "feature_store.yaml").write_text(changed)
    LineageStore.of(ws).apply()
    assert (ws.lineage_dir / "feature_store.yaml").read_text() == changed
    (definition / "feature_store.yaml").unlink()
    with pytest.raises(LineageError, match=r"has no feature_store\.yaml .*lineage\.repo"):
        LineageStore.of(ws).apply()


READ_ONLY_SCRIPT = """
import sys
from pathlib import Path
import numpy as np
from components.adapters.index import GalleryIndex
from components.adapters.lineage import LineageStore, sync_from_index
from components.state.workspace import Workspace

definition, root = Path(sys.argv[1]), Path(sys.argv[2])
try:
    (definition / "probe").write_text("x")
    sys.exit("the definition is writable: not a read-only mount")
except OSError:
    pass
ws = Workspace(root, lineage_repo=definition, index_uri=str(root.parent / "milvus" / "g.db"))
store = LineageStore.of(ws)
store.apply()
store.write_items([{"item_id": i, "model_version": "1", "space_id": "s1"} for i in ("a", "b")])
with GalleryIndex(ws.index_uri, "gallery") as index:
    collection = index.create_collection("s2", 8)
    index.index_items(["a", "b"], np.eye(2, 8, dtype=np.float32) + 0.1, "2", "s2", collection=collection)
    index.switch_alias(collection)
assert sync_from_index(ws.lineage_dir, ws.index_uri, "gallery", definition=ws.lineage_definition) == 2
rows = LineageStore(ws.lineage_dir).get_items(["a", "b"])
assert {r["item_id"]: r["model_version"] for r in rows} == {"a": "2", "b": "2"}
print("lineage ok")
"""


def test_lineage_works_with_the_definition_on_a_read_only_mount(tmp_path):
    """The same on a real read-only bind mount (a private mount namespace: root and util-linux's unshare)."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a read-only bind mount needs root and unshare")
    definition = tmp_path / "feast-definition"
    definition.mkdir()
    shutil.copyfile(REPO_TEMPLATE_DIR / "feature_store.yaml", definition / "feature_store.yaml")
    (tmp_path / "check.py").write_text(READ_ONLY_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    mount = f"mount --bind {definition} {definition} && mount -o remount,bind,ro {definition}"
    command = f'{mount} && exec "$0" "$@"'
    args = [sys.executable, str(tmp_path / "check.py"), str(definition), str(tmp_path / "ws")]
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "mount" in done.stderr and "lineage ok" not in done.stdout:
        if "permission denied" in done.stderr.lower() or "operation not permitted" in done.stderr.lower():
            pytest.skip(f"no bind mount here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0 and "lineage ok" in done.stdout, done.stderr[-3000:]
    assert sorted(p.name for p in definition.iterdir()) == ["feature_store.yaml"]
