"""The Milvus servers of a test session, by backend: ``milvus-lite server`` and Milvus standalone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SERVER_BACKENDS = ("milvus-lite", "milvus-standalone")


def milvus_binaries_cache() -> Path:
    """Where the Milvus server's binaries are unpacked once for every test session (~250 MB)."""
    from components.adapters.milvus_server import server_version

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "compatflow" / f"milvus-{server_version()}"


def server_uri(request: pytest.FixtureRequest, backend: str) -> str:
    """The URI of the session's ``backend`` server; the collections (and their aliases) the test creates
    are dropped after it, since a server outlives a test."""
    if backend == "milvus-lite":
        uri = request.getfixturevalue("milvus_lite_server")
    elif backend == "milvus-standalone":
        uri = request.getfixturevalue("milvus_standalone").uri
    else:
        raise ValueError(f"unknown Milvus backend {backend!r}; known: {SERVER_BACKENDS}")
    before = set(_collections(uri))
    request.addfinalizer(lambda: _drop(uri, set(_collections(uri)) - before))
    return uri


def _client(uri: str):
    """A client with the keepalive settings every client of a loopback server uses (pymilvus shares one
    connection per URI, and milvus-lite drops a connection that pings too often)."""
    from pymilvus import MilvusClient

    from components.adapters.index import LITE_GRPC_OPTIONS

    return MilvusClient(uri=uri, grpc_options=dict(LITE_GRPC_OPTIONS))


def _collections(uri: str) -> list[str]:
    client = _client(uri)
    try:
        return list(client.list_collections())
    finally:
        client.close()


def _drop(uri: str, names: set[str]) -> None:
    client = _client(uri)
    try:
        for name in sorted(names):
            for alias in client.describe_collection(name).get("aliases", []):
                client.drop_alias(alias)
            client.drop_collection(name)
    finally:
        client.close()
