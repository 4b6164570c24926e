"""The serving pair's read point: as of when its collection was complete, kept across in-place switches."""

from __future__ import annotations

import time

import numpy as np

from components.adapters.index import GalleryIndex
from components.serving.pair import PairFollower
from components.serving.record import write_serving


def test_in_place_switch_keeps_the_read_point_and_a_new_collection_moves_it(tmp_path) -> None:
    with GalleryIndex(str(tmp_path / "milvus" / "gallery.db")) as index:
        first, second = index.create_collection("s", 4), index.create_collection("s", 4)
        rows = np.eye(4, dtype=np.float32)
        for collection in (first, second):
            index.index_items(list("abcd"), rows, "1", "s", collection=collection)
        record = tmp_path / "serving.json"

        def serve(collection: str, version: str) -> None:
            time.sleep(0.02)  # a new mtime for the record's stamp
            write_serving(
                record,
                uri=index.uri,
                alias=index.alias,
                collection=collection,
                space="s",
                dim=4,
                query_model={"version": version},
            )

        serve(first, "1")
        follower = PairFollower(record, index=index, encoder=lambda texts: rows[: len(texts)])
        v1 = follower.current()
        serve(first, "2")  # stage 0 of an in-place rollout: same collection, new query model
        v2 = follower.current()
        assert v2.version == "2" and v2.complete_at == v1.complete_at
        serve(second, "3")  # blue-green: a collection newly served
        v3 = follower.current()
        assert v3.collection == second and v3.complete_at > v2.complete_at
        assert [h.item_id for h in v3.search(["q"], k=1)[0]] == ["a"]
        follower.close()


def test_records_written_before_the_serving_record_moved_still_name_a_loadable_factory():
    from components.serving.record import DEFAULT_FACTORY, import_factory, model_query_encoder

    for older in ("components.rollout.serving:model_query_encoder", "components.search:model_query_encoder"):
        assert import_factory(older) is model_query_encoder
    assert import_factory(DEFAULT_FACTORY) is model_query_encoder
