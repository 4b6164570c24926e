"""Indexing new gallery items shard by shard (real milvus-lite, a real small model): each shard's lineage rows
are handed over before its vectors are written, shards inside the workspace are named relative to it, and
the probe set is a bounded sample of the new pictures, every caption a query."""

from __future__ import annotations

import json
from pathlib import Path

from _shards import jpeg

PICTURES_PER_SHARD, SHARDS, CAPTIONS = 5, 2, 3


def _gallery(folder: Path) -> list[str]:
    """Two shards of five pictures, each with three captions (``txt`` the first, ``json`` all of them)."""
    from compat.data.shards import write_shard

    folder.mkdir(parents=True)
    urls = []
    for s in range(SHARDS):
        samples = []
        for p in range(PICTURES_PER_SHARD):
            key = f"s{s}-p{p}"
            captions = [f"picture {key} told {c} ways" for c in range(CAPTIONS)]
            meta = {"key": key, "phase": 0, "captions": captions}
            colour = (40 * p, 100 * s, 200)
            members = {"jpg": jpeg(colour), "txt": captions[0].encode(), "json": json.dumps(meta).encode()}
            samples.append((key, members))
        url = folder / f"gallery-{s:06d}.tar"
        write_shard(url, samples)
        urls.append(str(url))
    return urls


def test_shards_are_indexed_one_at_a_time_with_lineage_first_and_a_bounded_probe(tmp_path) -> None:
    from compat.models import build_model, save_checkpoint
    from components.adapters.index import GalleryIndex
    from components.rollout.operations import index_new_items
    from components.state.workspace import Workspace

    ws = tmp_path / "ws"
    urls = _gallery(ws / "validated" / "phase-00" / "gallery")
    model = tmp_path / "model"
    save_checkpoint(build_model("cf-tiny", seed=0), model, version="v1")
    workspace = Workspace(ws)
    handed: list[list[dict]] = []

    def on_items(rows: list[dict]) -> None:  # lineage first: nothing of this shard is indexed yet
        with GalleryIndex(str(workspace.index_uri)) as index:
            present = (
                index.existing_ids([r["item_id"] for r in rows]) if index.serving_collection() else set()
            )
        assert not present
        handed.append(rows)

    record = index_new_items(workspace, model, "v1", "v1", urls, probe_size=3, seed=0, on_items=on_items)

    assert record["n_new"] == record["n_items"] == SHARDS * PICTURES_PER_SHARD
    assert [len(rows) for rows in handed] == [PICTURES_PER_SHARD] * SHARDS  # one call per shard
    first = handed[0][0]
    assert first["image_uri"] == "validated/phase-00/gallery/gallery-000000.tar#s0-p0"  # relative
    assert (first["model_version"], first["space_id"], first["caption"]) == (
        "v1",
        "v1",
        "picture s0-p0 told 0 ways",
    )
    probe = json.loads(Path(record["probe"]).read_text())
    pictures = {ids[0] for ids in probe["positives"]}
    assert len(pictures) == 3 and len(probe["texts"]) == 3 * CAPTIONS  # a reservoir of 3 of the 10 pictures
    by_picture: dict[str, list[str]] = {}
    for text, (item,) in zip(probe["texts"], probe["positives"], strict=True):
        by_picture.setdefault(item, []).append(text)
    assert by_picture == {p: [f"picture {p} told {c} ways" for c in range(CAPTIONS)] for p in pictures}

    # Run again: nothing new, nothing handed over, no picture probed twice.
    again = index_new_items(workspace, model, "v1", "v1", urls, probe_size=3, seed=0, on_items=on_items)
    assert again["n_new"] == 0 and len(handed) == SHARDS
    assert json.loads(Path(again["probe"]).read_text()) == probe
