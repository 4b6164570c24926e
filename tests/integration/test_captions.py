"""Captions of search hits: from their gallery shard, cached; a shard not cached yet answered from Feast's
online lineage (a real local repo) while it loads in the background."""

from __future__ import annotations

from pathlib import Path

from compat.data.shards import write_shard
from components.adapters.lineage import LineageStore
from components.serving.captions import ShardCaptions, lineage_captions


def _gallery(tmp_path: Path) -> list[str]:
    shard = tmp_path / "gallery-00000.tar"
    write_shard(shard, [(f"item{i}", {"txt": f"a shard caption {i}".encode()}) for i in range(5)])
    return [f"{shard}#item{i}" for i in range(5)]


def test_an_uncached_shard_is_answered_from_feast_then_from_the_shard(tmp_path):
    uris = _gallery(tmp_path)
    store = LineageStore(tmp_path / "feast")
    store.apply()
    rows = [
        {"item_id": f"item{i}", "caption": f"a lineage caption {i}", "model_version": "1", "space_id": "s1"}
        for i in range(4)  # item4 has no lineage row
    ]
    store.write_items(rows)
    captions = ShardCaptions(fallback=lineage_captions(str(tmp_path / "feast")))

    first = captions.lookup([uris[0], uris[4], None])
    assert first == ["a lineage caption 0", None, None]  # not cached: Feast answered, item4 unknown there
    assert captions.from_fallback == 2
    captions.wait_for_loads(timeout=30)
    assert captions.lookup([uris[0], uris[4]]) == ["a shard caption 0", "a shard caption 4"]  # now cached
    assert captions.from_fallback == 2


def test_without_a_fallback_or_when_it_fails_the_shard_is_read_in_the_request(tmp_path):
    uris = _gallery(tmp_path)
    assert ShardCaptions().lookup(uris[:2]) == ["a shard caption 0", "a shard caption 1"]

    def broken(keys):
        raise ConnectionError("online store unreachable")

    captions = ShardCaptions(fallback=broken)
    assert captions.lookup([uris[3]]) == ["a shard caption 3"] and captions.from_fallback == 0
