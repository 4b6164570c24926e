"""``compatflow index move``: a served gallery carried from milvus-lite to a real Milvus standalone server,
vectors, versions and the collections a rollback needs included; the workspace then serves and rolls back
there, a config naming the old index is refused, and a second move has nothing to do."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _milvus import server_uri
from _rollouts import OPTS, PROBE, UPGRADE, N, _index_old, _vectors

from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.deployment import RolloutSection


def test_a_served_gallery_moves_from_milvus_lite_to_milvus_standalone(tmp_path, request) -> None:
    from typer.testing import CliRunner

    from benchmarks.synthetic_upgrade import MODULE, synthetic_encoders
    from components.rollout.operations import open_index
    from components.serving.record import ServingError
    from components.serving.search import search
    from components.state.workspace import Workspace
    from pipelines.cli import app

    target = server_uri(request, "milvus-standalone")  # its collections are dropped after the test
    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    lite = str(ws / "milvus" / "gallery.db")
    query_model = {"factory": f"{MODULE}:synthetic_query_encoder", "options": OPTS, "side": "new"}
    with GalleryIndex(lite) as index:
        _index_old(paths, index)
        config = ro.RolloutConfig.from_section(
            RolloutSection(), new_version="v2", query_model=query_model, batch_size=64, order="random"
        )
        assert ro.run_rollout(index, paths, config, synthetic_encoders({"options": OPTS}), PROBE).document()[
            "status"
        ] == ("completed")
        before = _vectors(index)
        collections = sorted(index.collections())

    moved = CliRunner().invoke(app, ["index", "move", "--to", target, "--workspace", str(ws), "--json"])
    assert moved.exit_code == 0, moved.output
    report = json.loads(moved.stdout)
    assert sorted(report["collections"]) == collections and set(report["collections"].values()) == {N}

    record = ro.read_serving(paths.serving)
    assert record.uri == target and record.query_model.version == "v2"
    with GalleryIndex(target) as index:
        assert index.serving_collection() == record.collection
        assert index.count_by_version() == {"v2": N}
        after = _vectors(index)
        assert after.keys() == before.keys()
        assert all(np.allclose(after[i], before[i], atol=1e-6) for i in before)  # float32 copied as stored
    (hits,) = search([UPGRADE.query_texts[0]], k=3, workspace=ws)
    assert len(hits) == 3 and {h["model_version"] for h in hits} == {"v2"}
    with pytest.raises(ServingError, match="served from"):  # a config still naming the old index
        open_index(Workspace(ws, index_uri=lite))

    # A rollback after the move finds the rollout's collections and saved rows at the new index.
    with GalleryIndex(target) as index:
        assert ro.rollback(paths, index).document()["status"] == "rolled_back"
        assert index.count_by_version() == {"v1": N}
    with GalleryIndex(lite) as index:
        assert index.count_by_version() == {"v2": N}  # the source was left as it was

    again = CliRunner().invoke(app, ["index", "move", "--to", target, "--workspace", str(ws)])
    assert again.exit_code == 0 and "already served from" in again.output
