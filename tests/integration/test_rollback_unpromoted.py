"""`compatflow rollback` of a change that was never promoted, and of a returning model whose workspace copy
is damaged. A run killed after its rollout completed but before the promotion leaves the candidate answering
every query from the rollout's own collection: the rollback undoes exactly that rollout (production and its
aliases stay), on a first upgrade as on a later one. The model queries go back to is checked against the
registry's digest before anything switches: a damaged copy is downloaded again, and when the registry's own
files fail too, nothing switches. Real milvus-lite, the synthetic upgrade's encoders, a sqlite registry."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _registry import PASS, candidate
from _synthetic_rollout import OPTS, PROBE, SYNTH_MODULE, UPGRADE, Died, N, dying_encoders, rollout_config

from benchmarks.synthetic_upgrade import synthetic_encoders
from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.adapters.registry import CheckpointIntegrityError, Registry, RegistryError
from components.rollout import read_serving
from components.state.workspace import Workspace
from components.steps import rollback_production


def _served(tmp_path: Path, name: str) -> tuple[Registry, ro.RolloutPaths, str, str]:
    """A workspace whose production is version 1 (its workspace copy named by the serving record) over a
    gallery it embedded; returns the registry, the rollout paths, the index URI and version 1."""
    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    uri = str(ws / "milvus" / "gallery.db")
    registry = Registry(Workspace(ws, index_uri=uri), model_name=name)
    v1, _ = candidate(registry, tmp_path, "run-1", 1, PASS, phase=0)
    registry.promote(v1, rollout=None)
    copy = registry.local_copy(v1)
    query_model = {
        "factory": f"{SYNTH_MODULE}:synthetic_query_encoder",
        "options": OPTS,
        "side": "old",
        "uri": str(copy),
    }
    with GalleryIndex(uri) as index:
        ro.index_gallery(
            index,
            paths,
            UPGRADE.item_ids,
            UPGRADE.old_gallery,
            version=v1,
            space="s1",
            query_model=query_model,
            embedded_at=UPGRADE.embedded_at,
            source_uris=[f"shard#{i}" for i in UPGRADE.item_ids],
        )
    return registry, paths, uri, v1


def _complete(registry: Registry, tmp_path: Path, paths: ro.RolloutPaths, uri: str, seed: int) -> str:
    """Register a candidate and run its rollout to ``completed``, as a run does before it promotes."""
    version, _ = candidate(registry, tmp_path, f"run-{seed}", seed, PASS, phase=seed - 1)
    with GalleryIndex(uri) as index:
        state = ro.run_rollout(
            index, paths, rollout_config(version), synthetic_encoders({"options": OPTS}), PROBE
        ).document()
    assert state["status"] == "completed"
    return version


def _damage(folder: Path) -> None:
    weights = next(folder.rglob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


@pytest.mark.parametrize("promoted_before", [0, 1], ids=["first-upgrade", "later-upgrade"])
def test_a_completed_rollout_never_promoted_is_the_change_rollback_undoes(
    tmp_path: Path, promoted_before: int
) -> None:
    """Killed between the backfill and the promotion (first upgrade: no previous version; a later one:
    production 2 over 1): the rollback serves production's model over its own collection again, marks the
    rollout rolled back and moves no alias; the next rollback is production's own."""
    registry, paths, uri, production = _served(tmp_path, f"clip-unpromoted-{promoted_before}")
    for seed in range(2, 2 + promoted_before):  # upgrades that shipped before the killed one
        version = _complete(registry, tmp_path, paths, uri, seed)
        registry.promote(version, rollout=ro.load_state(paths.state))
        production = version
    aliases = {a: registry.alias_version(a) for a in ("production", "previous")}
    source = read_serving(paths.serving).collection
    killed = _complete(registry, tmp_path, paths, uri, 2 + promoted_before)  # ... and the run dies here
    record = read_serving(paths.serving)
    assert record.query_model.version == killed and record.collection != source

    result = rollback_production(registry)
    undone = result["undone_rollout"]
    assert (undone["candidate"], undone["was"], result["production"]) == (killed, "completed", production)
    assert {a: registry.alias_version(a) for a in ("production", "previous")} == aliases
    after = ro.status(paths.state)
    assert after["status"] == "rolled_back" and "completed, never promoted" in after["halt_reason"]
    record = read_serving(paths.serving)
    assert record.query_model.version == production and record.collection == source
    with GalleryIndex(uri) as index:
        assert index.serving_collection() == source
        assert index.count_by_version() == {production: N}
    if not promoted_before:
        with pytest.raises(RegistryError, match="no previous version"):
            rollback_production(registry)


def test_the_returning_model_is_downloaded_again_when_its_copy_is_damaged(tmp_path: Path) -> None:
    """A candidate's rollout killed mid-backfill over a production whose workspace copy was damaged since:
    the rollback replaces the copy with the registry's verified files before queries switch back, so the
    served model passes the query path's digest check."""
    from components.serving.verify import RegistryDigestCheck

    registry, paths, uri, v1 = _served(tmp_path, "clip-damaged-copy")
    v2, _ = candidate(registry, tmp_path, "run-2", 2, PASS, phase=1)
    with GalleryIndex(uri) as index, pytest.raises(Died):
        ro.run_rollout(index, paths, rollout_config(v2), dying_encoders(2), PROBE)
    copy = registry.workspace.model_dir(v1)
    _damage(copy)

    result = rollback_production(registry)
    assert result["undone_rollout"]["was"] == "running"
    record = read_serving(paths.serving)
    assert record.query_model.version == v1
    RegistryDigestCheck(registry.workspace, registry.model_name)(record.query_model.document())  # passes now
    assert registry.verify_copy(v1, copy)


def test_a_returning_model_the_registry_cannot_restore_switches_nothing(tmp_path: Path) -> None:
    """The copy and the registry's own files of production both damaged: the rollback refuses, naming the
    folder and the digest, with the serving record, the rollout and the aliases as they were."""
    registry, paths, uri, v1 = _served(tmp_path, "clip-damaged-registry")
    v2 = _complete(registry, tmp_path, paths, uri, 2)
    _damage(registry.workspace.model_dir(v1))
    _damage(registry.local_artifacts(registry.version_info(v1)["source"]))
    before = read_serving(paths.serving)

    refused = rf"refused, nothing changed: query model {v1} at .* refused: .*registered digest"
    with pytest.raises(RegistryError, match=refused):
        rollback_production(registry)
    assert read_serving(paths.serving) == before and before.query_model.version == v2
    assert ro.status(paths.state)["status"] == "completed"
    assert registry.alias_version("production") == v1


def test_a_production_rollback_checks_and_restores_the_returning_model_first(tmp_path: Path) -> None:
    """Production 2 back to 1 with version 1's copy damaged: the preparation downloads it again; with the
    registry's files damaged too it refuses before anything changes."""
    from components.rollout.production_rollback import prepare_rollback

    registry, paths, uri, v1 = _served(tmp_path, "clip-production-rollback")
    v2 = _complete(registry, tmp_path, paths, uri, 2)
    registry.promote(v2, rollout=ro.load_state(paths.state))
    lineage = registry.workspace.lineage_dir
    lineage.mkdir(parents=True, exist_ok=True)
    (lineage / "feature_store.yaml").write_text("project: items\n")  # the preparation only looks for it
    event = {
        "workspace": str(registry.workspace.root),
        "lineage_repo": str(lineage),
        "model_name": registry.model_name,
        "tracking_uri": registry.tracking_uri,
        "from_version": v2,
        "to_version": v1,
    }
    copy = registry.workspace.model_dir(v1)
    _damage(copy)
    prepare_rollback(event)
    assert registry.verify_copy(v1, copy)

    _damage(copy)
    artifacts = registry.local_artifacts(registry.version_info(v1)["source"])
    saved = shutil.copytree(artifacts, tmp_path / "saved")
    _damage(artifacts)
    with pytest.raises(ro.ServingError, match="registered digest"):
        prepare_rollback(event)
    with pytest.raises(CheckpointIntegrityError):  # the damaged copy left as it was
        registry.verify_copy(v1, copy)
    shutil.rmtree(artifacts)
    shutil.copytree(saved, artifacts)
    prepare_rollback(event)  # the registry's files back: the copy is replaced
    assert registry.verify_copy(v1, copy)
