"""The gallery index in Milvus: physical collections per embedding space behind one serving alias.

Every row (:data:`ROW_FIELDS`) records which model wrote its vector (HNSW, COSINE) and in which space;
``transform`` names how the vector was derived from its model's output ("" = as encoded, "forward:v7" =
an old vector read through v7's forward adapter), ``rollout_id`` the rollout that wrote it ("" for the
initial indexing). Collections are ``<alias>_<space>_<n>``; queries go through the alias (``gallery`` by
default), which :meth:`GalleryIndex.switch_alias` moves atomically (Milvus ``alter_alias``).

Ownership: a :class:`GalleryIndex` opened for a deployment (an :class:`Owner`) marks every collection it
creates (properties :data:`OWNER_PROPERTY`, :data:`OWNER_WORKSPACE_PROPERTY`); an alias belongs to the owner
of its collection. Before its first write into a collection (upsert, alias switch, drop) it checks the mark
(:meth:`GalleryIndex.claim`) and refuses another deployment's collection or alias, naming both owners. A
collection made before marks is this deployment's when its serving record or rollout states name it
(``Owner.legacy``; marked then), no one's otherwise. A milvus-lite directory inside the owner's workspace is
its own whatever the marks say (a copied workspace carries its index along).

``uri`` is a milvus-lite directory (``.../gallery.db``; one process at a time), the URI of a
``milvus-lite server`` on 127.0.0.1 (several processes), or a Milvus server (2.3 or newer).

Every read names its consistency, the index's or a search's own (a server's default, Bounded, may miss the
last seconds' writes; milvus-lite is always current):

- ``SESSION`` (the default): the process reads its own writes. A collection it has not written yet is read
  ``STRONG`` the first time (a resumed process sees what the one before wrote), then as of that first read.
- ``STRONG``: reads of what another process wrote (``status``, :func:`gallery_status`, lineage sync);
  ~one server time tick (~200 ms on Milvus 2.3) per read.
- ``as_of`` a time (searches only): every write before it is seen, with no wait once the server has caught
  up; a service searches as of its serving pair's load (the collection was complete then).
- ``BOUNDED``: only where a read a few seconds stale is harmless (the pace's timed searches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_ALIAS = "gallery"
SESSION, STRONG, BOUNDED = "Session", "Strong", "Bounded"
CONSISTENCY_LEVELS = (SESSION, STRONG, BOUNDED)
MIN_SERVER_VERSION = (2, 3)
TOKEN_ENV = "COMPATFLOW_MILVUS_TOKEN"
SPACE_PROPERTY = "compatflow.space"
OWNER_PROPERTY = "compatflow.owner"  # the deployment id (components.state.workspace.Workspace.deployment_id)
OWNER_WORKSPACE_PROPERTY = "compatflow.owner_workspace"  # its workspace folder, named in a refusal
# What orders a backfill, written with each row (compat.backfill.order_keys); older collections lack them.
ORDER_FIELDS: tuple[str, ...] = ("order_key", "key_lambda_orth", "key_uncertainty", "backfill_stage")
META_FIELDS: tuple[str, ...] = (
    *("model_version", "space_id", "phase", "embedded_at", "source_uri", "transform", "rollout_id"),
    *ORDER_FIELDS,
)
ROW_FIELDS: tuple[str, ...] = ("item_id", "vector", *META_FIELDS)
_FLOAT_FIELDS = ("key_lambda_orth", "key_uncertainty")
_VARCHAR_LEN = dict(
    item_id=512, model_version=128, space_id=128, source_uri=2048, transform=128, rollout_id=64
)


class GalleryIndexError(RuntimeError):
    """The index cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class Owner:
    """The deployment a :class:`GalleryIndex` writes for (see the module doc); ``legacy``: the unmarked
    collections its serving record names."""

    id: str
    workspace: str
    legacy: frozenset[str] = frozenset()
    moved_from: Callable[[str, str], bool] = lambda mark, folder: False  # (mark, folder): moved from there


@dataclass(frozen=True)
class Hit:
    """One search result."""

    item_id: str
    score: float
    model_version: str
    fields: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)  # output_fields asked for

    @classmethod
    def found(cls, row: dict[str, Any], score: float, fields: Sequence[str]) -> Hit:
        """The hit on ``row`` (the entity of a search result), with its ``fields``."""
        return cls(
            str(row["item_id"]), float(score), str(row["model_version"]), {f: row.get(f) for f in fields}
        )

    def to_dict(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "score": self.score, "model_version": self.model_version}


def is_remote(uri: str) -> bool:
    """True for a server URI (``http://host:port`` ...), False for a milvus-lite directory."""
    return bool(re.match(r"(https?|tcp|grpc|unix)://", str(uri), re.IGNORECASE))


# milvus-lite serves gRPC from Python, whose server answers pings on idle connections more often than every
# 5 minutes with GOAWAY "too_many_pings" (pymilvus pings every 10 s by default), after which a shared
# connection cannot recover. On loopback no keepalive is needed while idle.
LITE_GRPC_OPTIONS = {"grpc.keepalive_time_ms": 300_000, "grpc.keepalive_permit_without_calls": 0}


def quote(value: str) -> str:
    """A string literal for a Milvus filter expression."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _not_iterator_noise(record: logging.LogRecord) -> bool:
    """False for the noise of query iterators on milvus-lite, which has no timestamp allocator (harmless)."""
    last = traceback.extract_tb(record.exc_info[2], limit=-1) if record.exc_info else []
    return "mvccTs" not in record.getMessage() and not (last and last[0].name == "AllocTimestamp")


for _name in ("pymilvus.client.iterator.query_iterator", "grpc._server"):
    logging.getLogger(_name).addFilter(_not_iterator_noise)


# Collections written by this process, per server: a SESSION read of one of them sees this process's writes.
_WRITTEN: set[tuple[str, str]] = set()


def check_server_version(version: str, uri: str) -> None:
    """Refuse a Milvus server older than :data:`MIN_SERVER_VERSION` (milvus-lite is always accepted)."""
    if version.startswith("milvus_lite"):
        return
    found = re.match(r"v?(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) < MIN_SERVER_VERSION:
        want = ".".join(map(str, MIN_SERVER_VERSION))
        raise GalleryIndexError(
            f"the Milvus server at {uri} reports version {version!r}; compatflow needs Milvus {want} or "
            "newer (aliases, upsert, query iterators): upgrade the server or point index.uri at another"
        )


# milvus-lite runs one in-process engine per directory, shared by every client of this process; it holds
# the directory's lock until released, so the last GalleryIndex using it releases it.
_EMBEDDED_USERS: Counter[str] = Counter()
_EMBEDDED_LOCK = threading.Lock()


def now_ms() -> int:
    return int(time.time() * 1000)


class GalleryIndex(contextlib.AbstractContextManager["GalleryIndex"]):
    """Gallery collections behind a serving alias (see the module doc); a ``with`` block closes it."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        alias: str = DEFAULT_ALIAS,
        *,
        timeout: float | None = 60.0,
        consistency: str = SESSION,
        owner: Owner | None = None,
    ) -> None:
        from pymilvus import MilvusClient

        if consistency not in CONSISTENCY_LEVELS:
            raise ValueError(f"consistency must be one of {CONSISTENCY_LEVELS}, got {consistency!r}")
        self.uri = str(uri)
        self.alias = alias
        self.timeout = timeout
        self.consistency = consistency
        self._loaded: set[str] = set()
        self._fields: dict[str, tuple[str, ...]] = {}
        self._caught_up: dict[str, float] = {}  # collection -> the time its first STRONG read was made
        self._local = None if is_remote(self.uri) else os.path.abspath(Path(self.uri).expanduser())
        if self._local:
            Path(self._local).parent.mkdir(parents=True, exist_ok=True)
        self.owner = owner
        self._claimed: set[str] = set()  # collections this deployment's own, checked once
        # milvus-lite inside the owner's workspace: nobody else writes there (see the module doc)
        home = Path(owner.workspace).resolve() if owner else None
        self._private = bool(home and self._local and Path(self._local).resolve().is_relative_to(home))
        loopback = self._local or urlparse(self.uri).hostname in ("127.0.0.1", "localhost", "::1")
        extra = {"grpc_options": dict(LITE_GRPC_OPTIONS)} if loopback else {}
        token = os.environ.get(TOKEN_ENV, "")
        try:
            self.client = MilvusClient(uri=self.uri, token=token, timeout=timeout, **extra)
        except Exception as exc:  # pymilvus wraps milvus-lite's lock error in a generic one
            hint = (
                " Only one process may open a milvus-lite directory: start `milvus-lite server --data-dir "
                "DIR --host 127.0.0.1 --port P` and use uri http://127.0.0.1:P in every process."
                if self._local
                else " Check that the Milvus server is running and reachable."
            )
            cause = exc.__cause__ or exc
            raise GalleryIndexError(f"cannot open the Milvus gallery at {self.uri}: {cause}.{hint}") from exc
        if self._local:
            with _EMBEDDED_LOCK:
                _EMBEDDED_USERS[self._local] += 1
        try:
            self.server_version = str(self.client.get_server_version(timeout=timeout))
            check_server_version(self.server_version, self.uri)
        except Exception:
            self.close()
            raise
        self.lite = self.server_version.startswith("milvus_lite")

    def _read_args(self, name: str, consistency: str | None, as_of: float | None = None) -> dict[str, Any]:
        """The read's consistency arguments (see the module doc for SESSION's)."""
        if as_of is None:
            level = consistency or self.consistency
            if level not in CONSISTENCY_LEVELS:
                raise ValueError(f"consistency must be one of {CONSISTENCY_LEVELS}, got {level!r}")
            if level != SESSION or (self.uri, name) in _WRITTEN:
                return {"consistency_level": level}
            if self.lite or name not in self._caught_up:
                self._caught_up[name] = time.time()
                return {"consistency_level": STRONG}
            as_of = self._caught_up[name]
        from pymilvus.client.utils import mkts_from_unixtime

        return {"consistency_level": "Customized", "guarantee_timestamp": mkts_from_unixtime(float(as_of))}

    # -- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the client; the last user of an embedded directory also stops its engine (and lock)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.client.close()
        if self._local:
            with _EMBEDDED_LOCK:
                _EMBEDDED_USERS[self._local] -= 1
                last = _EMBEDDED_USERS[self._local] <= 0
                if last:
                    del _EMBEDDED_USERS[self._local]
            if last:
                from milvus_lite.server_manager import server_manager_instance

                server_manager_instance.release_server(self._local)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- collections and alias -----------------------------------------------------------------------------
    def collections(self) -> list[str]:
        """Physical gallery collections of this alias (``<alias>_*``), sorted."""
        prefix = f"{self.alias}_"
        return sorted(c for c in self.client.list_collections() if c.startswith(prefix))

    def next_collection_name(self, space: str) -> str:
        """``<alias>_<space>_<n>`` with n one above any existing collection of that space."""
        slug = re.sub(r"[^0-9A-Za-z_]+", "_", str(space)).strip("_")
        if not slug:
            raise ValueError(f"space id {space!r} has no letter or digit to name a collection with")
        base = f"{self.alias}_{slug}_"
        suffixes = [c.removeprefix(base) for c in self.client.list_collections() if c.startswith(base)]
        return f"{base}{max((int(n) for n in suffixes if n.isdigit()), default=0) + 1}"

    def create_collection(
        self, space: str, dim: int, *, name: str | None = None, hnsw_m: int = 16, ef_construction: int = 64
    ) -> str:
        """Create a collection for ``space`` (dimension ``dim``) with an HNSW index on its vectors and a
        scalar index on ``order_key``; returns its name. ``ef_construction`` 64 builds at about half
        the Milvus CPU of 200, at the recall a search ``ef`` of 128 restores
        (``benchmarks/results/index_build.md``)."""
        from pymilvus import DataType, MilvusClient

        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        name = name or self.next_collection_name(space)
        if self.client.has_collection(name):
            raise GalleryIndexError(f"collection {name!r} already exists at {self.uri}")
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("item_id", DataType.VARCHAR, is_primary=True, max_length=_VARCHAR_LEN["item_id"])
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=int(dim))
        for field in META_FIELDS:
            if field in _VARCHAR_LEN:
                schema.add_field(field, DataType.VARCHAR, max_length=_VARCHAR_LEN[field])
            else:
                schema.add_field(field, DataType.FLOAT if field in _FLOAT_FIELDS else DataType.INT64)
        index_params = self.client.prepare_index_params()
        index_params.add_index(
            field_name="vector",
            index_type="HNSW",
            metric_type="COSINE",
            params={"M": hnsw_m, "efConstruction": ef_construction},
        )
        # a stage's slices are order_key ranges: a scalar index makes each a lookup, not a scan of the column
        # (milvus-lite 3.2 offers INVERTED only, a 2.3 server STL_SORT, which later servers keep for numbers)
        index_params.add_index(field_name="order_key", index_type="INVERTED" if self.lite else "STL_SORT")
        self.client.create_collection(
            name,
            schema=schema,
            index_params=index_params,
            properties={SPACE_PROPERTY: str(space), **self._marks()},
            timeout=self.timeout,
        )
        self._loaded.add(name)
        if self.owner is not None:
            self._claimed.add(name)
        log.info("created gallery collection %s (space %s, dim %d, HNSW COSINE)", name, space, dim)
        return name

    def has_collection(self, name: str) -> bool:
        return bool(self.client.has_collection(name))

    def _require(self, name: str) -> str:
        if not self.client.has_collection(name):
            raise GalleryIndexError(
                f"no gallery collection {name!r} at {self.uri}; known: {', '.join(self.collections())}"
            )
        return name

    def fields(self, name: str) -> tuple[str, ...]:
        """The fields the rows of collection ``name`` store (an older one lacks :data:`ORDER_FIELDS`)."""
        if name not in self._fields:
            described = self.client.describe_collection(self._require(name))["fields"]
            self._fields[name] = tuple(str(f["name"]) for f in described)
        return self._fields[name]

    def has_order_keys(self, name: str) -> bool:
        """Whether the rows of ``name`` carry what orders a backfill (a stage can be a filter on them)."""
        return set(ORDER_FIELDS) <= set(self.fields(name))

    def _readable(self, name: str, fields: Sequence[str]) -> list[str]:
        stored = self.fields(name)
        return [f for f in dict.fromkeys(["item_id", *fields]) if f in stored]

    def _completed(self, rows: Sequence[dict[str, Any]], fields: Sequence[str]) -> list[dict[str, Any]]:
        """``rows`` with the order fields a collection made before them lacks: the id's ``order_key``, no
        score, stage 0 (what its rows would carry had they been written now without centres)."""
        missing = [f for f in ORDER_FIELDS if f in fields and rows and f not in rows[0]]
        if not missing:
            return [dict(r) for r in rows]
        from compat.backfill import order_keys

        keys = order_keys([str(r["item_id"]) for r in rows])
        defaults = {"key_lambda_orth": 0.0, "key_uncertainty": 0.0, "backfill_stage": 0}
        return [
            {**r, **{f: int(keys[j]) if f == "order_key" else defaults[f] for f in missing}}
            for j, r in enumerate(rows)
        ]

    def written_elsewhere(self, name: str) -> None:
        """Another process wrote ``name`` since this one read it: its next read waits for the server again."""
        self._caught_up.pop(name, None)

    def collection_space(self, name: str) -> str:
        """The space id a collection was created for."""
        return str(self.client.describe_collection(self._require(name))["properties"].get(SPACE_PROPERTY, ""))

    def collection_dim(self, name: str) -> int:
        for field in self.client.describe_collection(self._require(name))["fields"]:
            if field["name"] == "vector":
                return int(field["params"]["dim"])
        raise GalleryIndexError(f"collection {name!r} has no vector field: not a gallery collection")

    def serving_collection(self) -> str | None:
        """The physical collection the alias points to (None when the alias does not exist yet)."""
        if self.alias not in self.client.list_aliases(timeout=self.timeout).get("aliases", []):
            return None
        return str(self.client.describe_alias(self.alias, timeout=self.timeout)["collection_name"])

    def resolve(self, collection: str | None = None) -> str:
        """``collection`` itself, or the alias's collection; loads it for search and query."""
        name = collection or self.serving_collection()
        if name is None:
            raise GalleryIndexError(
                f"alias {self.alias!r} does not exist at {self.uri}: index the gallery first "
                "(a collection, then switch_alias)"
            )
        if name not in self._loaded:
            self.client.load_collection(self._require(name), timeout=self.timeout)
            self._loaded.add(name)
        return name

    def switch_alias(self, collection: str) -> str | None:
        """Point the alias at ``collection`` atomically; returns the collection it pointed to before. Refuses
        (before anything moves) a collection or an alias of another deployment (:meth:`claim`)."""
        self._require(collection)
        self.claim(collection, alias=True)
        previous = self.serving_collection()
        if previous == collection:
            return previous
        move = self.client.create_alias if previous is None else self.client.alter_alias
        move(collection, self.alias, timeout=self.timeout)
        log.info("alias %s: %s -> %s", self.alias, previous, collection)
        return previous

    # -- ownership -----------------------------------------------------------------------------------------
    def _marks(self) -> dict[str, str]:
        """The properties that mark a collection as the owner's (none without an owner)."""
        if self.owner is None:
            return {}
        return {OWNER_PROPERTY: self.owner.id, OWNER_WORKSPACE_PROPERTY: self.owner.workspace}

    def owner_of(self, name: str) -> tuple[str, str]:
        """``(id, workspace)`` of the deployment that marked collection ``name`` (``("", "")``: unmarked)."""
        properties = self.client.describe_collection(name, timeout=self.timeout).get("properties") or {}
        return str(properties.get(OWNER_PROPERTY, "")), str(properties.get(OWNER_WORKSPACE_PROPERTY, ""))

    def claim(self, *names: str, alias: bool = False) -> None:
        """Refuse (:class:`GalleryIndexError` naming both owners, before anything is written) a collection
        of ``names`` that exists and is not this deployment's, or (``alias``) moving an alias that points to
        one; see the module doc. Nothing is checked without an owner or in its own milvus-lite directory."""
        if self.owner is None or self._private:
            return
        if alias:
            held = self.serving_collection()
            if held is not None:
                self._claim(held, f"alias {self.alias!r} (it serves collection {held!r})")
        for name in names:
            if name not in self._claimed and self.client.has_collection(name):
                self._claim(name, f"collection {name!r}")

    def _claim(self, name: str, what: str) -> None:
        assert self.owner is not None
        if name in self._claimed:
            return
        mark, workspace = self.owner_of(name)
        if not mark and name in self.owner.legacy:  # made before marks, named by this deployment's record
            self.client.alter_collection_properties(name, properties=self._marks(), timeout=self.timeout)
            log.info("collection %s at %s marked as deployment %s's", name, self.uri, self.owner.id)
        elif mark != self.owner.id and self.owner.moved_from(mark, workspace):
            self.client.alter_collection_properties(name, properties=self._marks(), timeout=self.timeout)
            log.warning(
                f"collection {name} at {self.uri} was marked by this deployment in {workspace}, which no "
                f"longer holds it: the workspace moved to {self.owner.workspace}, and the collection is "
                "marked as its own there"
            )
        elif mark != self.owner.id:
            theirs = (
                f"deployment {mark} (workspace {workspace or 'not named'})"
                if mark
                else "no deployment (it carries no owner mark and this workspace's serving record does not "
                "name it: made by another deployment before marks, or by hand)"
            )
            raise GalleryIndexError(
                f"{what} at {self.uri} belongs to {theirs}, not to this deployment {self.owner.id} "
                f"(workspace {self.owner.workspace}): nothing was written. Give this workspace another alias "
                "(config index.alias, before its first indexing) or serve it from another index; a copy of a "
                "workspace is another deployment and never writes into the original's gallery"
            )
        self._claimed.add(name)

    def drop(self, collection: str) -> None:
        """Drop a collection; refuses the one the alias serves (move the alias first)."""
        if collection == self.serving_collection():
            raise GalleryIndexError(
                f"collection {collection!r} is served by alias {self.alias!r}; switch the alias "
                "to another collection before dropping it"
            )
        self.claim(self._require(collection))
        self.client.drop_collection(collection, timeout=self.timeout)
        self._loaded.discard(collection)

    @property
    def needs_periodic_flush(self) -> bool:
        """True on milvus-lite, which scans unflushed rows by brute force. A server indexes growing segments
        and seals them by size itself; a flush there costs seconds (~3 s on 2.3) and leaves small segments."""
        return self.lite

    def flush(self, collection: str | None = None, *, wait_indexed: bool = False) -> None:
        """Make what was written searchable on indexed segments (data is durable without it): milvus-lite
        seals growing segments; a server does nothing, unless ``wait_indexed`` (a collection about to be
        served whole): then it seals and waits until the vector index covers every row."""
        name = self.resolve(collection)
        if self.lite or wait_indexed:
            self.client.flush(name, timeout=self.timeout)
        if wait_indexed:
            self.wait_indexed(name)

    def wait_indexed(self, collection: str | None = None, timeout_s: float = 600.0) -> None:
        """Wait until no sealed row of ``collection`` waits for its vector index (a server builds it a segment
        at a time after a flush; hours for a large collection). :class:`GalleryIndexError` only when the rows
        waiting have not fallen for ``timeout_s`` or 4 ms a row, the longer (an index node stopped)."""
        name = self.resolve(collection)
        waiting, since = None, time.monotonic()
        while True:
            info = self.client.describe_index(name, "vector", timeout=self.timeout)
            pending = int(info.get("pending_index_rows") or 0)
            if pending == 0:
                return
            if waiting is None or pending < waiting:
                if waiting is not None:
                    log.info("index of %s: %d rows still to build", name, pending)
                waiting, since = pending, time.monotonic()
            elif time.monotonic() - since > max(timeout_s, 0.004 * pending):
                raise GalleryIndexError(
                    f"the vector index of {name!r} at {self.uri} still has {pending} rows to build and none "
                    f"was built in {time.monotonic() - since:.0f} s: check the server's index nodes, then "
                    "run the command again (what was written stays)"
                )
            time.sleep(0.2 if pending < 100_000 else 2.0)

    # -- writes --------------------------------------------------------------------------------------------
    def upsert(
        self, rows: Sequence[dict[str, Any]], collection: str | None = None, *, insert: bool = False
    ) -> int:
        """Upsert complete rows (idempotent: the primary key is item_id); returns the number written.
        ``insert``: cheaper, only for ids the collection does not hold (an insert of one there leaves two
        rows). Fields the collection does not store are left out (one made before :data:`ORDER_FIELDS`)."""
        if not rows:
            return 0
        name = self.resolve(collection)
        self.claim(name)
        stored = self.fields(name)
        missing = [f for f in stored if f not in rows[0]]
        if missing:
            raise ValueError(f"gallery rows need the fields {list(stored)}; missing {missing}")
        rows = [{f: r[f] for f in stored} for r in rows]
        write = self.client.insert if insert else self.client.upsert
        result = write(name, rows, timeout=self.timeout)
        _WRITTEN.add((self.uri, name))
        key = "insert_count" if insert else "upsert_count"
        written = result.get(key, len(rows)) if isinstance(result, dict) else len(rows)
        if int(written) != len(rows):
            raise GalleryIndexError(
                f"write into {name!r} wrote {written} of {len(rows)} rows; retry the batch"
            )
        return len(rows)

    def index_items(
        self,
        ids: Sequence[str],
        vectors: np.ndarray,
        version: str,
        space: str,
        *,
        collection: str | None = None,
        batch_size: int = 1000,
        **fields: Any,
    ) -> int:
        """Upsert ``vectors`` of ``version`` in ``space`` for ``ids``, in batches; returns the count written.
        ``fields``: the other keywords of :func:`make_rows`. The collection must have been created for
        ``space`` (a query never meets a vector of a space it was not trained against)."""
        name = self.resolve(collection)
        have = self.collection_space(name)
        if have != str(space):
            raise GalleryIndexError(
                f"collection {name!r} holds space {have!r}, not {space!r}: vectors of another "
                "space go into a new collection (blue-green)"
            )
        rows = make_rows(ids, vectors, version, space, dim=self.collection_dim(name), **fields)
        return sum(
            self.upsert(rows[start : start + batch_size], name) for start in range(0, len(rows), batch_size)
        )

    # -- reads ---------------------------------------------------------------------------------------------
    def search(
        self,
        query_vectors: np.ndarray,
        k: int = 10,
        filter: str | None = None,
        collection: str | None = None,
        output_fields: Sequence[str] = (),
        consistency: str | None = None,
        as_of: float | None = None,
        layers: Sequence[Sequence[str]] | None = None,
    ) -> list[list[Hit]]:
        """Top-``k`` hits per query row (cosine score), with the model version that wrote each vector and
        the ``output_fields`` of its row (in :attr:`Hit.fields`, e.g. ``source_uri``). ``as_of`` (a Unix
        time) replaces ``consistency`` (see the module doc).

        ``layers`` (``[(collection, filter), ...]``, newest first) searches a gallery that a rollout is
        moving from one collection to another (:mod:`components.rollout.engine`): each layer with its own
        filter (and ``filter``), the hits merged by score, an item met in two layers kept from the newest.
        """
        if layers:
            found, same = [], (output_fields, consistency, as_of)
            for i, (name, where) in enumerate(layers):
                both = " and ".join(f"({x})" for x in (where, filter) if x) or None
                found.append(self.search(query_vectors, 2 * k if i else k, both, name, *same))
            return [_merged([hits[row] for hits in found], k) for row in range(len(found[0]))]
        q = np.atleast_2d(np.asarray(query_vectors, dtype=np.float32))
        if not np.isfinite(q).all():
            raise ValueError("query vectors contain NaN or infinite values")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        name = self.resolve(collection)
        params = {"params": {"ef": max(k, 128)}}  # HNSW's search breadth: the recall of efConstruction 64
        result = self.client.search(
            name,
            data=q.tolist(),
            filter=filter or "",
            limit=int(k),
            # the primary key is asked for by name: a Milvus 2.3 server keys it "id" in the hit itself
            output_fields=list(dict.fromkeys(["item_id", "model_version", *output_fields])),
            search_params=params,
            **self._read_args(name, consistency, as_of),
            timeout=self.timeout,
        )
        return [[Hit.found(h["entity"], h["distance"], output_fields) for h in row] for row in result]

    def _query(self, name: str, **query: Any) -> list[dict[str, Any]]:
        return self.client.query(name, **query, **self._read_args(name, None), timeout=self.timeout)

    def _get(self, name: str, ids: Sequence[str], fields: list[str], chunk: int = 1000) -> Iterator[dict]:
        """The rows of ``ids`` that exist, a get by primary key per ``chunk`` of them."""
        ids = [str(i) for i in ids]
        for start in range(0, len(ids), chunk):
            yield from self.client.get(
                name,
                ids=ids[start : start + chunk],
                output_fields=fields,
                **self._read_args(name, None),
                timeout=self.timeout,
            )

    def count(self, collection: str | None = None, filter: str = "") -> int:
        """Number of gallery rows (optionally matching ``filter``)."""
        name = self.resolve(collection)
        return int(self._query(name, filter=filter, output_fields=["count(*)"])[0]["count(*)"])

    def iter_rows(
        self,
        fields: Sequence[str] = ("item_id",),
        collection: str | None = None,
        filter: str = "",
        batch_size: int = 2000,
    ) -> Iterator[list[dict[str, Any]]]:
        """All rows (the given fields), in batches: milvus-lite (always current, unordered under a limit)
        through the query iterator, a server in pages in primary-key order (``item_id > last``) at the index's
        consistency (the iterator takes its snapshot time from the server, which Milvus 2.3 does not send:
        right after a write its client-side fallback returned nothing)."""
        name = self.resolve(collection)
        wanted, fields = list(fields), self._readable(name, fields)
        if self.lite:
            batches = query_batches(
                self.client, name, fields, batch_size, filter=filter, timeout=self.timeout
            )
            yield from (self._completed(batch, wanted) for batch in batches)
            return
        last: str | None = None
        while True:
            after = f"item_id > {quote(last)}" if last is not None else ""
            where = " and ".join(f"({c})" for c in (filter, after) if c) or 'item_id != ""'
            page = self._query(name, filter=where, output_fields=fields, limit=int(batch_size))
            if not page:
                return
            keys = [str(r["item_id"]) for r in page]
            if keys != sorted(keys) or (last is not None and keys[0] <= last):
                raise GalleryIndexError(
                    f"the Milvus server at {self.uri} returned a page of {name!r} out of primary-key order; "
                    "paging would skip rows (needs Milvus 2.3 or newer)"
                )
            yield self._completed(page, wanted)
            if len(page) < batch_size:
                return
            last = keys[-1]

    def count_by_version(self, collection: str | None = None) -> dict[str, int]:
        """Rows per model version (sums to :meth:`count`) by count queries, one more query finding each
        version not counted yet: the cost grows with the number of versions, not of rows."""
        name = self.resolve(collection)
        counts: dict[str, int] = {}
        while True:
            counted = ", ".join(quote(v) for v in counts)
            where = f"model_version not in [{counted}]" if counts else 'item_id != ""'
            found = self._query(name, filter=where, output_fields=["model_version"], limit=1)
            if not found:
                return dict(sorted(counts.items()))
            version = str(found[0]["model_version"])
            counts[version] = self.count(name, f"model_version == {quote(version)}")

    def rows_where(
        self,
        filter: str,
        fields: Sequence[str] = ROW_FIELDS,
        collection: str | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` rows matching ``filter`` (the caller rewrites them so that they stop matching, and
        asks again until none is left: a bounded read of a set that shrinks)."""
        name = self.resolve(collection)
        rows = self._query(name, filter=filter, output_fields=self._readable(name, fields), limit=int(limit))
        return self._completed(rows, fields)

    def existing_ids(self, ids: Sequence[str], collection: str | None = None) -> set[str]:
        """Those of ``ids`` the collection holds (gets by primary key: bounded by ``ids``)."""
        name = self.resolve(collection)
        return {str(r["item_id"]) for r in self._get(name, ids, ["item_id"])}

    def fetch(self, ids: Sequence[str], collection: str | None = None) -> list[dict[str, Any]]:
        """Complete rows (vector included) of ``ids`` that exist, in the order of ``ids``."""
        name = self.resolve(collection)
        fields = self._readable(name, ROW_FIELDS)
        rows = [{f: r[f] for f in fields} for r in self._get(name, ids, fields)]
        found = {str(row["item_id"]): row for row in self._completed(rows, ROW_FIELDS)}
        return [found[i] for i in map(str, ids) if i in found]


def query_batches(client: Any, name: str, fields: Sequence[str], size: int, **query: Any) -> Iterator[list]:
    """Every row of collection ``name`` (its ``fields``), ``size`` at a time (pymilvus's query iterator)."""
    iterator = client.query_iterator(name, batch_size=size, output_fields=list(fields), **query)
    try:
        while batch := iterator.next():
            yield [dict(row) for row in batch]
    finally:
        iterator.close()


KEY_SPACE = 1 << 63  # order_key lies in [0, 2^63)


def key_window(start: int, width: int) -> str:
    """A filter for ``order_key`` in ``[start, start + width)`` modulo 2^63."""
    start %= KEY_SPACE
    if width >= KEY_SPACE:
        return "order_key >= 0"
    end = start + width
    if end == KEY_SPACE:  # 2^63 itself is no INT64 literal
        return f"order_key >= {start}"
    if end < KEY_SPACE:
        return f"(order_key >= {start} and order_key < {end})"
    return f"(order_key >= {start} or order_key < {end - KEY_SPACE})"


def key_slices(n: int) -> list[str]:
    """Every row, as ``n`` disjoint filters by ``order_key`` range (what K processes each read part of)."""
    edges = [KEY_SPACE * i // n for i in range(n + 1)]
    return [key_window(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


def _merged(layers: Sequence[Sequence[Hit]], k: int) -> list[Hit]:
    """The top ``k`` of the layers' hits by score, each item once (from the first layer that has it)."""
    seen: set[str] = set()
    hits: list[Hit] = []
    for layer in layers:
        hits.extend(h for h in layer if h.item_id not in seen)
        seen.update(h.item_id for h in layer)
    return sorted(hits, key=lambda h: -h.score)[:k]


def make_rows(
    ids: Sequence[str],
    vectors: np.ndarray,
    version: str,
    space: str,
    *,
    phase: int | Sequence[int] = 0,
    source_uris: Sequence[str] | None = None,
    embedded_at: int | Sequence[int] | None = None,
    transform: str = "",
    rollout_id: str = "",
    dim: int | None = None,
    centres: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """Gallery rows for :meth:`GalleryIndex.upsert`, validating shapes and values, with their order keys
    (against the space's ``centres``: :mod:`components.rollout.keys`)."""
    from compat.backfill import order_keys, order_scores

    v = np.asarray(vectors, dtype=np.float32)
    n = len(ids)
    if v.ndim != 2 or v.shape[0] != n:
        raise ValueError(f"vectors: expected shape [{n}, D] (one row per id), got {v.shape}")
    if dim is not None and v.shape[1] != dim:
        raise ValueError(f"vectors have dimension {v.shape[1]} but the collection stores {dim}")
    if not np.isfinite(v).all():
        raise ValueError("vectors contain NaN or infinite values")
    if n and (np.linalg.norm(v, axis=1) == 0).any():
        raise ValueError("vectors contain all-zero rows, which have no cosine similarity")
    if len(set(map(str, ids))) != n:
        raise ValueError("ids must be unique within one write")

    def per_item(value: Any, name: str, default: Any) -> list[Any]:
        value = default if value is None else value
        if isinstance(value, (int, np.integer, str)):
            return [value] * n
        out = list(value)
        if len(out) != n:
            raise ValueError(f"{name}: expected {n} values (one per id), got {len(out)}")
        return out

    phases = per_item(phase, "phase", 0)
    uris = per_item(source_uris, "source_uris", "")
    times = per_item(embedded_at, "embedded_at", now_ms())
    keys = order_keys([str(i) for i in ids])
    scores = order_scores(v, centres)
    return [
        {
            "item_id": str(i),
            "vector": v[j].tolist(),
            "model_version": str(version),
            "space_id": str(space),
            "phase": int(phases[j]),
            "embedded_at": int(times[j]),
            "source_uri": str(uris[j]),
            "transform": str(transform),
            "rollout_id": str(rollout_id),
            "order_key": int(keys[j]),
            "key_lambda_orth": float(scores["key_lambda_orth"][j]),
            "key_uncertainty": float(scores["key_uncertainty"][j]),
            "backfill_stage": 0,
        }
        for j, i in enumerate(ids)
    ]


def gallery_status(uri: str | os.PathLike[str], alias: str = DEFAULT_ALIAS) -> dict[str, Any]:
    """``{"count", "by_version", "collection"}`` of the serving collection (0 when nothing is indexed)."""
    with GalleryIndex(uri, alias, consistency=STRONG) as index:  # another process wrote the gallery
        collection = index.serving_collection()
        count = index.count(collection) if collection else 0
        by_version = index.count_by_version(collection) if collection else {}
        return {"count": count, "by_version": by_version, "collection": collection}
