"""A workspace's configured index must be the one its gallery is served from: a config naming another index
is refused before any step runs, with both URIs and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.runs import PlanError, _refuse_another_index
from components.serving.record import (
    ServingError,
    check_index_agrees,
    read_serving,
    same_index,
    write_serving,
)
from components.state.workspace import Workspace


def _served(ws: Workspace, uri: str) -> None:
    ws.root.mkdir(parents=True, exist_ok=True)
    write_serving(
        ws.serving_path,
        uri=uri,
        alias="gallery",
        collection="gallery_s_1",
        space="s",
        dim=8,
        query_model={"version": "1", "uri": str(ws.root / "models" / "v1")},
    )


def test_one_index_named_two_ways_agrees(tmp_path: Path) -> None:
    (tmp_path / "milvus").mkdir()
    assert same_index(
        str(tmp_path / "milvus" / "gallery.db"), str(tmp_path / "milvus" / ".." / "milvus/gallery.db")
    )
    assert same_index("http://127.0.0.1:19530/", "http://127.0.0.1:19530")
    assert not same_index("http://127.0.0.1:19530", "http://127.0.0.1:19531")
    assert not same_index(str(tmp_path / "gallery.db"), "http://127.0.0.1:19530")


def test_a_config_naming_another_index_is_refused_with_both_uris(tmp_path: Path) -> None:
    lite = Workspace(tmp_path / "ws")
    _served(lite, lite.index_uri)  # served from the embedded default
    _refuse_another_index(lite)  # nothing configured: the record decides
    _refuse_another_index(lite.with_index_uri(lite.index_uri))  # the same index, configured
    moved = lite.with_index_uri("http://127.0.0.1:9")
    with pytest.raises(PlanError, match=r"index.uri is http://127.0.0.1:9 but .* served from .*gallery.db"):
        _refuse_another_index(moved)
    with pytest.raises(ServingError, match="does not move a gallery"):
        check_index_agrees("http://127.0.0.1:9", read_serving(lite.serving_path), lite.serving_path)


def test_a_fresh_workspace_takes_the_configured_index(tmp_path: Path) -> None:
    _refuse_another_index(Workspace(tmp_path / "new").with_index_uri("http://127.0.0.1:9"))


def test_an_unreachable_configured_server_is_refused_in_seconds_naming_it(tmp_path: Path) -> None:
    import time

    from components.deployment import Deployment
    from components.runs import _refuse_unreachable_services

    base = Deployment.parse({"workspace": str(tmp_path / "ws")}, source="test")
    _refuse_unreachable_services(base)  # embedded stores: nothing to reach
    closed = base.model_copy(update={"index": base.index.model_copy(update={"uri": "http://127.0.0.1:9"})})
    started = time.monotonic()
    with pytest.raises(PlanError, match=r"index.uri http://127.0.0.1:9 is unreachable .* no step has run"):
        _refuse_unreachable_services(closed)
    assert time.monotonic() - started < 10
