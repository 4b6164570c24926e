"""The serving pair: one immutable (query model, collection) pair, and the follower that swaps it as the
serving record (:mod:`components.serving.record`) changes.

A query takes one reference (:meth:`PairFollower.current`) and runs entirely on that pair (never through
the alias, which a rollout moves after the record). A record change is seen by a ``stat`` per query and by a
watcher thread; the new pair is loaded while the old one answers, then the reference is replaced. A record
that cannot be loaded leaves the current pair serving (:attr:`PairFollower.error`). A query overtaken by an
in-place query-model switch (an earlier release's rollouts) is run again on the new pair.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from components.serving.record import (
    QueryEncoder,
    ServingError,
    ServingRecord,
    load_query_encoder,
    read_serving,
)

log = logging.getLogger(__name__)

Stamp = tuple[int, int, int]  # (inode, mtime_ns, size) of the record: atomic rewrites change the inode
RETRY_S = 5.0  # a record that failed to load is tried again after this long (an index may come back)
MAX_RERUNS = 3  # a query overtaken by in-place query-model switches is run again at most this often
T = TypeVar("T")


@dataclass(frozen=True)
class ServingPair:
    """A query model and the collection it reads, as one serving record names them; never mutated."""

    encoder: QueryEncoder
    index: Any  # components.adapters.index.GalleryIndex
    collection: str
    record: ServingRecord
    stamp: Stamp
    complete_at: float = field(default_factory=time.time)  # the collection held all it serves by then

    @property
    def version(self) -> str:
        """The query model version."""
        return self.record.query_model.version

    def search(
        self, texts: Sequence[str], k: int, *, filter: str | None = None, output_fields: Sequence[str] = ()
    ) -> list[list[Any]]:
        """Hits per text: texts embedded by this pair's query model, searched in this pair's collection."""
        vectors = np.asarray(self.encoder(list(texts)), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise ServingError(
                f"query model {self.version} returned shape {vectors.shape} for {len(texts)} text(s)"
            )
        # as of the moment the collection was complete: sees all of a collection the record newly names (a
        # blue-green fill, a rollback to its source), and never waits once the server has caught up with it
        return self.index.search(
            vectors,
            k=k,
            filter=filter,
            collection=self.collection,
            output_fields=output_fields,
            as_of=self.complete_at,
            layers=self.record.layers,
        )


def _stamp(path: Path) -> Stamp | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class PairFollower:
    """Holds the current :class:`ServingPair` of the record at ``record_path`` and swaps it atomically
    (thread-safe). ``uri`` overrides the record's index URI; ``index`` and ``encoder`` replace the ones the
    record names; ``verify(query_model)`` raises to refuse a query model before it is loaded; ``on_swap(old,
    new)`` is called after each swap."""

    def __init__(
        self,
        record_path: str | os.PathLike[str],
        *,
        uri: str | None = None,
        index: Any = None,
        encoder: QueryEncoder | None = None,
        on_swap: Callable[[ServingPair | None, ServingPair], None] | None = None,
        verify: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.record_path, self.uri = Path(record_path), uri
        self._given_index, self._fixed_encoder = index, encoder
        self._verify, self._on_swap = verify, on_swap
        self._indexes: dict[str, Any] = {}  # by URI; closed at close(): in-flight queries may still hold one
        self._pair: ServingPair | None = None
        self._failed: tuple[Stamp | None, str, float] | None = None  # stamp that failed, why, when
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def pair(self) -> ServingPair | None:
        """The pair serving now (None before the first load), without looking at the record."""
        return self._pair

    @property
    def error(self) -> str | None:
        """Why the record as it is now could not be followed (None when the current pair is the record's)."""
        failed = self._failed
        return failed[1] if failed is not None and failed[0] == _stamp(self.record_path) else None

    def current(self) -> ServingPair:
        """The pair for a query arriving now: the current one, or the record's new pair once it is loaded."""
        pair = self._pair
        stamp = _stamp(self.record_path)
        if pair is not None and (stamp == pair.stamp or self._is_failed(stamp)):
            return pair
        return self.refresh()

    def answer(self, query: Callable[[ServingPair], T]) -> tuple[T, ServingPair]:
        """``query(pair)`` on the current pair, and the pair that answered (see the module doc: run again on
        the new pair when the record moved the query model on the same collection meanwhile)."""
        pair = self.current()
        result = query(pair)
        for _ in range(MAX_RERUNS):
            now = self.current()
            if (
                now is pair
                or now.collection != pair.collection
                or now.record.query_model == pair.record.query_model
            ):
                break
            pair, result = now, query(now)
        return result, pair

    def _is_failed(self, stamp: Stamp | None) -> bool:
        failed = self._failed
        return failed is not None and failed[0] == stamp and time.monotonic() - failed[2] < RETRY_S

    def refresh(self) -> ServingPair:
        """Load the record's pair if it changed; raises ServingError when there is no pair to serve at all."""
        with self._lock:
            stamp = _stamp(self.record_path)
            pair = self._pair
            if pair is not None and (stamp == pair.stamp or self._is_failed(stamp)):
                return pair
            if pair is None and self._is_failed(stamp):
                raise ServingError(self._failed[1])
            try:
                new = self._load(stamp, pair)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ServingError) else str(exc)
                self._failed = (stamp, reason, time.monotonic())
                if pair is None:
                    raise ServingError(reason) from exc
                log.error("serving record %s changed but cannot be followed: %s", self.record_path, reason)
                return pair
            self._failed = None
            self._pair = new  # the one reference: queries from here on run on the new pair
            if pair is None or (pair.version, pair.collection) != (new.version, new.collection):
                was = f"{pair.version} on {pair.collection}" if pair else "- on -"
                log.info("serving %s on %s (was %s)", new.version, new.collection, was)
            if self._on_swap is not None:
                self._on_swap(pair, new)
            return new

    def _load(self, stamp: Stamp | None, pair: ServingPair | None) -> ServingPair:
        record = read_serving(self.record_path) if stamp is not None else None
        if record is None:
            raise ServingError(f"no serving record at {self.record_path}: index the gallery first")
        index = self._index(self.uri or record.uri, record.alias)
        collection = record.collection
        for name in record.collections():
            index.resolve(name)  # the collections exist and are loaded before any query reaches them
        dim = index.collection_dim(collection)
        if record.dim != dim:
            raise ServingError(
                f"{self.record_path}: field 'dim' is {record.dim}, collection {collection!r} stores {dim}"
            )
        if self._fixed_encoder is not None:
            encoder = self._fixed_encoder
        elif pair is not None and pair.record.query_model == record.query_model:
            encoder = pair.encoder  # same query model: keep it
        else:
            if self._verify is not None:  # the registry's digest, before any weight is read
                self._verify(record.query_model.document())
            encoder = load_query_encoder(record.query_model.document())
        # an in-place switch (same collection: stage 0, its rollback) keeps the moment the collection was
        # complete; the backfill's later writes are compatible vectors either way
        same = pair is not None and pair.index is index and pair.collection == collection
        complete_at = pair.complete_at if same else time.time()
        return ServingPair(encoder, index, collection, record, stamp or (0, 0, 0), complete_at=complete_at)

    def _index(self, uri: str, alias: str) -> Any:
        if self._given_index is not None:
            return self._given_index
        key = f"{uri}\n{alias}"
        if key not in self._indexes:
            from components.adapters.index import GalleryIndex

            self._indexes[key] = GalleryIndex(uri, alias)
        return self._indexes[key]

    def watch(self, interval_s: float = 0.25) -> None:
        """Check the record every ``interval_s`` seconds in a daemon thread (swaps with no query waiting)."""
        if self._watcher is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception as exc:  # noqa: BLE001 - reported by error / readiness; keep watching
                    log.debug("serving record not loadable yet: %s", exc)

        self._watcher = threading.Thread(target=loop, name="serving-record-watcher", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop watching and close the indexes this follower opened."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        with self._lock:
            for index in self._indexes.values():
                index.close()
            self._indexes.clear()
            self._pair = None
