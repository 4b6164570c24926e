"""Ownership in a shared index: every collection a deployment makes carries its identity, and a move, an
ingest or an alias switch into another deployment's collection or alias is refused before a row is written,
naming both owners. A copy of a workspace is another deployment; the default alias is per deployment; a move
copies the served gallery's collections only. The shared index is a milvus-lite directory outside every
workspace."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from _rollouts import N, _index_old
from typer.testing import CliRunner

from components import rollout as ro
from components.adapters.index import OWNER_PROPERTY, GalleryIndex, GalleryIndexError
from components.rollout.operations import deployment_owner, open_index
from components.state.workspace import Workspace


def _served(root, alias=None) -> Workspace:
    """A workspace at ``root`` serving the synthetic gallery (v1, N items) from its own milvus-lite index."""
    ws = Workspace(root, index_alias=alias)
    with open_index(ws) as index:
        _index_old(ro.RolloutPaths.for_workspace(ws), index)
    return ws


def _move(ws: Workspace, to: str):
    from pipelines.cli import app

    return CliRunner().invoke(app, ["index", "move", "--to", to, "--workspace", str(ws.root)])


def _counts(uri: str, alias: str) -> dict:
    with GalleryIndex(uri, alias) as index:
        served = index.serving_collection()
        return {name: index.count(name) for name in index.collections()} | {"served": served}


def test_a_copy_moved_onto_the_index_serving_the_original_is_refused_before_a_row_is_written(
    tmp_path,
) -> None:
    original = _served(tmp_path / "a" / "ws")
    shutil.copytree(original.root, tmp_path / "b" / "ws", symlinks=True)  # copied while both served locally
    copy = Workspace(tmp_path / "b" / "ws")
    assert copy.deployment_id() != original.deployment_id()  # another folder: another deployment
    assert copy.index_alias == original.index_alias  # the seed travels with the copy

    shared = str(tmp_path / "shared" / "gallery.db")
    assert _move(original, shared).exit_code == 0
    record = ro.read_serving(original.serving_path)
    before = _counts(shared, record.alias)
    with GalleryIndex(shared) as index:
        assert index.owner_of(record.collection)[0] == original.deployment_id()

    refused = _move(copy, shared)
    assert refused.exit_code != 0
    said = " ".join(refused.output.split())
    assert original.deployment_id() in said and copy.deployment_id() in said, said
    assert str(original.root) in said and "nothing was written" in said
    assert _counts(shared, record.alias) == before == {record.collection: N, "served": record.collection}
    assert ro.read_serving(copy.serving_path).uri != shared  # the copy still serves from its own index

    # A copy made after the move serves from the shared index on paper; its first write there is refused.
    shutil.copytree(original.root, tmp_path / "c" / "ws", symlinks=True)
    later = Workspace(tmp_path / "c" / "ws")
    with open_index(later) as index, pytest.raises(GalleryIndexError, match=original.deployment_id()):
        vector = np.ones((1, record.dim), np.float32)
        index.index_items(["x"], vector, "v1", record.space, collection=record.collection)
    assert _counts(shared, record.alias) == before


def test_an_unrelated_workspace_cannot_take_another_deployments_alias(tmp_path) -> None:
    first, second = Workspace(tmp_path / "one"), Workspace(tmp_path / "two")
    assert first.index_alias != second.index_alias  # the default alias is the deployment's own
    assert first.index_alias.startswith("gallery_")

    # Two workspaces both configured with alias "gallery" (the default before it was per deployment).
    one = _served(tmp_path / "one", alias="gallery")
    two = _served(tmp_path / "two", alias="gallery")
    shared = str(tmp_path / "shared" / "gallery.db")
    assert _move(one, shared).exit_code == 0
    before = _counts(shared, "gallery")

    refused = _move(two, shared)
    assert refused.exit_code != 0
    said = " ".join(refused.output.split())
    assert "alias 'gallery'" in said and one.deployment_id() in said and two.deployment_id() in said, said
    assert _counts(shared, "gallery") == before

    # Nor can it index into the alias there as its first gallery (a new workspace configured onto it).
    third = Workspace(tmp_path / "three", index_uri=shared, index_alias="gallery")
    with open_index(third) as index, pytest.raises(GalleryIndexError, match="nothing was written"):
        _index_old(ro.RolloutPaths.for_workspace(third), index)
    assert _counts(shared, "gallery") == before and ro.read_serving(third.serving_path) is None


def test_a_move_copies_only_the_served_gallerys_collections(tmp_path) -> None:
    ws = _served(tmp_path / "ws", alias="gallery")
    record = ro.read_serving(ws.serving_path)
    with GalleryIndex(record.uri, "gallery_team") as other:  # another gallery in the same index
        other.switch_alias(other.create_collection("s", 8))
        other.index_items(["t1"], np.ones((1, 8), np.float32), "t", "s")
    target = str(tmp_path / "target" / "gallery.db")
    assert _move(ws, target).exit_code == 0
    with GalleryIndex(target) as index:
        assert index.client.list_collections() == [record.collection]
        assert index.serving_collection() == record.collection and index.count() == N
        marks = index.client.describe_collection(record.collection)["properties"]
        assert marks[OWNER_PROPERTY] == ws.deployment_id()


def test_collections_made_before_owner_marks_stay_their_workspaces(tmp_path) -> None:
    """An unmarked collection the serving record names is the workspace's (marked on its first write); an
    unmarked one it does not name is refused."""
    shared = str(tmp_path / "shared" / "gallery.db")
    ws = Workspace(tmp_path / "ws", index_uri=shared, index_alias="gallery")
    with GalleryIndex(shared, "gallery") as index:  # written before marks: no owner
        _index_old(ro.RolloutPaths.for_workspace(ws), index)
        stranger = index.create_collection("x", 8)
    record = ro.read_serving(ws.serving_path)
    with open_index(ws) as index:
        assert index.owner_of(record.collection) == ("", "")
        index.switch_alias(record.collection)  # its own: allowed, and marked
        assert index.owner_of(record.collection) == (ws.deployment_id(), str(ws.root))
        with pytest.raises(GalleryIndexError, match="carries no owner mark"):
            index.index_items(["x"], np.ones((1, 8), np.float32), "v", "x", collection=stranger)
    assert deployment_owner(ws).legacy == {record.collection}


def test_a_workspace_moved_to_another_folder_keeps_its_collections_in_a_shared_index(tmp_path) -> None:
    """Moved (the old folder gone), the workspace writes on into what it marked there, re-marked as its own
    in the new folder; a copy whose original still stands stays refused."""
    original = _served(tmp_path / "a" / "ws")
    shared = str(tmp_path / "shared" / "gallery.db")
    assert _move(original, shared).exit_code == 0
    record = ro.read_serving(original.serving_path)
    shutil.copytree(original.root, tmp_path / "copy" / "ws", symlinks=True)
    shutil.move(original.root, tmp_path / "b" / "ws")
    moved = Workspace(tmp_path / "b" / "ws")
    vector = np.ones((1, record.dim), np.float32)
    with open_index(moved) as index:
        index.index_items(["x"], vector, "v1", record.space, collection=record.collection)
        assert index.owner_of(record.collection) == (moved.deployment_id(), str(moved.root))
    copy = Workspace(tmp_path / "copy" / "ws")  # its original (now at b/ws) still holds the seed
    with open_index(copy) as index, pytest.raises(GalleryIndexError, match=moved.deployment_id()):
        index.index_items(["y"], vector, "v1", record.space, collection=record.collection)
    assert _counts(shared, record.alias)[record.collection] == N + 1
