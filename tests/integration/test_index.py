"""The Milvus gallery index, on real milvus-lite: in-process (embedded) and as a loopback server."""

from __future__ import annotations

import subprocess
import sys
import uuid

import numpy as np
import pytest
from _milvus import SERVER_BACKENDS, server_uri

from components.adapters.index import GalleryIndex, GalleryIndexError, gallery_status, make_rows


@pytest.fixture(params=["embedded", *SERVER_BACKENDS])
def index(request, tmp_path):
    """A GalleryIndex per backend; on a shared server each test gets its own alias (and collections)."""
    if request.param == "embedded":
        idx = GalleryIndex(str(tmp_path / "milvus" / "gallery.db"))
    else:
        idx = GalleryIndex(server_uri(request, request.param), alias=f"g{uuid.uuid4().hex[:10]}")
    yield idx
    idx.close()


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    v = rng.normal(size=(n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_index_search_count_and_versions(index: GalleryIndex) -> None:
    rng = np.random.default_rng(0)
    vectors = _unit(rng, 300, 16)
    ids = [f"it-{i:04d}" for i in range(300)]
    coll = index.create_collection("space-a", 16)
    assert coll == f"{index.alias}_space_a_1"
    assert index.collection_space(coll) == "space-a" and index.collection_dim(coll) == 16
    index.switch_alias(coll)
    written = index.index_items(
        ids, vectors, "v1", "space-a", phase=0, source_uris=[f"s#{i}" for i in ids], batch_size=64
    )
    assert written == 300 and index.count() == 300
    # re-embedding upserts by item_id: the count stays, the versions move
    index.index_items(ids[:120], vectors[:120], "v2", "space-a")
    assert index.count() == 300
    assert index.count_by_version() == {"v1": 180, "v2": 120}
    hits = index.search(vectors[[5, 250]], k=3)
    assert [row[0].item_id for row in hits] == ["it-0005", "it-0250"]
    assert hits[0][0].model_version == "v2" and hits[1][0].model_version == "v1"
    assert hits[0][0].score == pytest.approx(1.0, abs=1e-4)
    assert hits[0][0].score >= hits[0][1].score >= hits[0][2].score
    only_v1 = index.search(vectors[5:6], k=5, filter='model_version == "v1"')[0]
    assert all(h.model_version == "v1" for h in only_v1) and "it-0005" not in [h.item_id for h in only_v1]
    rows = index.fetch(["it-0200", "missing", "it-0007"])
    assert [r["item_id"] for r in rows] == ["it-0200", "it-0007"]
    assert rows[0]["source_uri"] == "s#it-0200" and rows[0]["model_version"] == "v1"
    assert rows[1]["model_version"] == "v2" and rows[1]["space_id"] == "space-a"
    assert np.allclose(rows[0]["vector"], vectors[200], atol=1e-6)
    if index.uri.startswith("http"):  # a second client of the same server sees the same gallery
        assert gallery_status(index.uri, index.alias) == {
            "count": 300,
            "by_version": {"v1": 180, "v2": 120},
            "collection": coll,
        }


def test_alias_switch_is_atomic_and_guards_drop(index: GalleryIndex) -> None:
    rng = np.random.default_rng(1)
    a = index.create_collection("s", 8)
    b = index.create_collection("s", 8)
    assert b.endswith("_s_2")
    va, vb = _unit(rng, 20, 8), _unit(rng, 20, 8)
    ids = [str(i) for i in range(20)]
    index.index_items(ids, va, "old", "s", collection=a)
    index.index_items(ids, vb, "new", "s", collection=b)
    assert index.serving_collection() is None
    with pytest.raises(GalleryIndexError, match="does not exist"):
        index.search(va[:1])
    assert index.switch_alias(a) is None
    assert index.search(va[:1], k=1)[0][0].model_version == "old"
    assert index.switch_alias(b) == a
    assert index.serving_collection() == b
    assert index.search(vb[3:4], k=1)[0][0].model_version == "new"
    with pytest.raises(GalleryIndexError, match="served by alias"):
        index.drop(b)
    index.drop(a)
    assert a not in index.collections() and b in index.collections()


def test_rejects_bad_writes(index: GalleryIndex) -> None:
    coll = index.create_collection("s", 4)
    index.switch_alias(coll)
    good = np.eye(4, dtype=np.float32)
    with pytest.raises(GalleryIndexError, match="holds space 's', not 'other'"):
        index.index_items(["a", "b", "c", "d"], good, "v1", "other")
    with pytest.raises(ValueError, match="dimension 3"):
        index.index_items(["a", "b", "c", "d"], good[:, :3], "v1", "s")
    with pytest.raises(ValueError, match="NaN"):
        index.index_items(["a"], np.full((1, 4), np.nan), "v1", "s")
    with pytest.raises(ValueError, match="all-zero"):
        index.index_items(["a"], np.zeros((1, 4)), "v1", "s")
    with pytest.raises(ValueError, match="unique"):
        make_rows(["a", "a"], good[:2], "v1", "s")
    with pytest.raises(ValueError, match="one row per id"):
        make_rows(["a"], good[:2], "v1", "s")
    with pytest.raises(GalleryIndexError, match="already exists"):
        index.create_collection("s", 4, name=coll)
    assert index.count() == 0


def test_embedded_index_persists_and_is_single_process(tmp_path) -> None:
    path = str(tmp_path / "gallery.db")
    rng = np.random.default_rng(2)
    with GalleryIndex(path) as idx:
        coll = idx.create_collection("s", 8)
        idx.switch_alias(coll)
        idx.index_items([f"x{i}" for i in range(50)], _unit(rng, 50, 8), "v1", "s")
        # a second process cannot open the same directory while this one holds it
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\nfrom components.adapters.index import GalleryIndex\nGalleryIndex(sys.argv[1])",
                path,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode != 0
        assert "Only one process may open a milvus-lite directory" in probe.stderr
    with GalleryIndex(path) as idx:  # alias, rows and versions survive a reopen (collection loads on use)
        assert idx.serving_collection() == coll
        assert idx.count() == 50 and idx.count_by_version() == {"v1": 50}
    assert gallery_status(path) == {"count": 50, "by_version": {"v1": 50}, "collection": coll}
    assert gallery_status(str(tmp_path / "empty.db")) == {"count": 0, "by_version": {}, "collection": None}


def test_reads_after_writes_are_current_in_this_and_a_fresh_process(index: GalleryIndex) -> None:
    """On a Milvus server the default consistency (Bounded) misses writes of the last seconds: a process
    reads its own writes (Session), and a process that wrote nothing reads Strong."""
    rng = np.random.default_rng(3)
    coll = index.create_collection("s", 8)
    assert index._read_args(coll, None) == {"consistency_level": "Strong"}  # nothing written here yet
    index.switch_alias(coll)
    ids = [f"r{i:03d}" for i in range(240)]
    vectors = _unit(rng, 240, 8)
    index.index_items(ids, vectors, "v1", "s", batch_size=80)
    assert index._read_args(coll, None) == {"consistency_level": "Session"}
    assert index._read_args(coll, "Bounded") == {"consistency_level": "Bounded"}
    assert index.count() == 240 and index.count_by_version() == {"v1": 240}
    assert index.search(vectors[7:8], k=1)[0][0].item_id == "r007"
    index.index_items(ids[:100], vectors[:100], "v2", "s")
    assert index.count_by_version() == {"v1": 140, "v2": 100}
    reader = (
        "import json, sys\nfrom components.adapters.index import GalleryIndex\n"
        "with GalleryIndex(sys.argv[1], sys.argv[2]) as idx:\n"
        "    print(json.dumps([idx.count(), idx.count_by_version()]))"
    )
    uri = index.uri if index.uri.startswith("http") else None
    if uri is not None:  # milvus-lite's directory is held by this process
        out = subprocess.run(
            [sys.executable, "-c", reader, uri, index.alias], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == '[240, {"v1": 140, "v2": 100}]'


def test_server_version_check() -> None:
    from components.adapters.index import check_server_version

    check_server_version("v2.3.5-lite", "http://h:1")
    check_server_version("v2.5.10", "http://h:1")
    check_server_version("milvus_lite-3.2.2", "./g.db")
    for old in ("v2.2.16", "2.1.0", "unknown"):
        with pytest.raises(GalleryIndexError, match="needs Milvus 2.3 or newer"):
            check_server_version(old, "http://h:1")


def test_search_as_of_a_time_sees_every_write_before_it(index: GalleryIndex) -> None:
    """A service reads with ``as_of`` = when its pair was loaded: every earlier write is visible at once."""
    import time

    rng = np.random.default_rng(4)
    coll = index.create_collection("s", 8)
    index.switch_alias(coll)
    vectors = _unit(rng, 64, 8)
    index.index_items([f"a{i:02d}" for i in range(64)], vectors, "v1", "s")
    written = time.time()
    fresh = GalleryIndex(index.uri, index.alias) if index.uri.startswith("http") else index
    try:
        hits = fresh.search(vectors[[3, 40]], k=1, as_of=written)
        assert [row[0].item_id for row in hits] == ["a03", "a40"]
    finally:
        if fresh is not index:
            fresh.close()


def test_a_collection_about_to_be_served_is_indexed_whole(index: GalleryIndex) -> None:
    """flush(wait_indexed=True) returns once the vector index covers every row (a server builds it after
    the flush, asynchronously); periodic flushes are milvus-lite's alone."""
    rng = np.random.default_rng(5)
    coll = index.create_collection("s", 8)
    index.index_items([f"w{i:03d}" for i in range(400)], _unit(rng, 400, 8), "v1", "s", collection=coll)
    assert index.needs_periodic_flush == index.lite
    index.flush(coll, wait_indexed=True)
    info = index.client.describe_index(coll, "vector")
    assert info["pending_index_rows"] == 0 and info["indexed_rows"] == info["total_rows"] == 400
