"""A production rollback while a candidate's rollout is unfinished (its run died mid-backfill, the state a
kill -9 leaves): the rollback finishes that rollout record too, and the next run neither resumes it nor
undoes it over the restored production. Real milvus-lite, the synthetic upgrade's encoders."""

from __future__ import annotations

import pytest
from _synthetic_rollout import OPTS, PROBE, UPGRADE, Died, N, dying_encoders, rollout_config

from benchmarks.synthetic_upgrade import synthetic_encoders
from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.rollout import read_serving
from components.rollout.production_rollback import on_rollback


def test_rollback_finishes_the_superseded_rollout_and_the_next_run_leaves_it(tmp_path) -> None:
    from components.state.workspace import Workspace
    from components.steps.gallery import _undo_unfinished_rollout

    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    uri = str(ws / "milvus" / "gallery.db")
    with GalleryIndex(uri) as index:
        UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"shard#{i}" for i in UPGRADE.item_ids])
        good = synthetic_encoders({"options": OPTS})
        assert (
            ro.run_rollout(index, paths, rollout_config("v2"), good, PROBE).document()["status"]
            == "completed"
        )  # v2 serves
        with pytest.raises(Died):  # the next candidate's rollout dies in its first backfill stage
            ro.run_rollout(index, paths, rollout_config("v3"), dying_encoders(2), PROBE)
        died = ro.status(paths.state)
        assert died["status"] == "running" and died["stage"] == 1 and died["new_version"] == "v3"

        on_rollback({"workspace": ws, "from_version": "v2", "to_version": "v1"})  # production v2 -> v1
        after = ro.status(paths.state)
        assert after["status"] == "rolled_back" and after["new_version"] == "v3"
        assert "superseded: production rolled back from v2 to v1" in after["halt_reason"]
        assert index.count_by_version() == {"v1": N}
        assert read_serving(paths.serving).query_model.version == "v1"

        # The next run: the killed run of v3 resumed gets its rolled-back rollout back, touching nothing ...
        again = ro.run_rollout(index, paths, rollout_config("v3"), good, PROBE).document()
        assert again["status"] == "rolled_back" and again["rollout_id"] == died["rollout_id"]
        assert index.count_by_version() == {"v1": N}
    # ... and a run of another candidate finds nothing unfinished to undo over the restored production.
    assert _undo_unfinished_rollout(Workspace(ws, index_uri=uri), "v4") is None
    assert read_serving(paths.serving).query_model.version == "v1"
    with GalleryIndex(uri) as index:
        assert index.count_by_version() == {"v1": N}
        assert index.serving_collection() == read_serving(paths.serving).collection


def test_rollback_after_a_first_upgrade_killed_mid_rollout_undoes_it_and_keeps_production(tmp_path) -> None:
    """The first upgrade's run dies mid-backfill (production v1, no previous version): ``compatflow
    rollback`` undoes that rollout alone, so production v1 answers over an all-v1 gallery; the next rollback
    is the registry's, which has nothing to go back to."""
    from _registry import PASS, candidate

    from components.adapters.registry import Registry, RegistryError
    from components.state.workspace import Workspace
    from components.steps import rollback_production

    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    uri = str(ws / "milvus" / "gallery.db")
    registry = Registry(Workspace(ws, index_uri=uri), model_name="clip-first-upgrade")
    v1, _ = candidate(registry, tmp_path, "run-1", 1, PASS, phase=0)
    registry.promote(v1, rollout=None)
    with GalleryIndex(uri) as index:
        UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"shard#{i}" for i in UPGRADE.item_ids])
        with pytest.raises(Died):  # the first upgrade's rollout dies in its first backfill stage
            ro.run_rollout(index, paths, rollout_config("v2"), dying_encoders(2), PROBE)
        record = read_serving(paths.serving)  # a mixed gallery, queried by the candidate
        assert record.layers and list(index.count_by_version(record.collection)) == ["v2"]
    assert record.query_model.version == "v2"

    result = rollback_production(registry)
    undone = result["undone_rollout"]
    assert (undone["candidate"], undone["was"], undone["stage"], result["production"]) == (
        "v2",
        "running",
        1,
        v1,
    )
    assert registry.alias_version("production") == v1 and registry.alias_version("previous") is None
    after = ro.status(paths.state)
    assert after["status"] == "rolled_back" and "rolled back by compatflow rollback" in after["halt_reason"]
    assert read_serving(paths.serving).query_model.version == "v1"
    with GalleryIndex(uri) as index:
        assert index.count_by_version() == {"v1": N}
    with pytest.raises(RegistryError, match="no previous version"):
        rollback_production(registry)
