"""How a rollout writes to Milvus: a stage's rows, in calls of a bounded size, flushed every so many rows.

Milvus answers one call at a time, so a user's query waits for a write: an upsert of 256 rows holds it ~24 ms,
one of 32 rows ~5 ms, a flush of 256 rows ~20 ms (milvus-lite, benchmarks/results/backfill.md); left
unflushed, thousands of rows make every search a brute-force scan. Unpaced, a rollout writes whole batches and
flushes every ``flush_rows`` rows; with the SLO throttle, ``PACED_UPSERT_ROWS`` per call and a flush every
``PACED_FLUSH_ROWS`` rows. A Milvus server indexes growing segments itself: periodic flushes are for
milvus-lite only (:attr:`components.adapters.index.GalleryIndex.needs_periodic_flush`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from components.rollout.pacing import Pace
    from components.rollout.types import RolloutEncoders

PACED_UPSERT_ROWS = 32
PACED_FLUSH_ROWS = 256


class GalleryWriter:
    """Upserts into ``collection`` in calls of at most ``upsert_rows`` rows (0: one call per write), each
    followed by ``pace`` (which may sleep, and samples query latency), and flushes after every
    ``flush_rows`` rows written (0: only when :meth:`flush` is called)."""

    def __init__(
        self, index: Any, collection: str, upsert_rows: int = 0, flush_rows: int = 0, pace: Pace | None = None
    ) -> None:
        self.index, self.collection = index, collection
        self.upsert_rows, self.flush_rows, self.pace = upsert_rows, flush_rows, pace
        self.written = 0
        self._unflushed = 0

    @classmethod
    def for_pace(cls, index: Any, collection: str, pace: Pace | None, flush_rows: int) -> GalleryWriter:
        """Whole batches and ``flush_rows`` without an SLO throttle; small calls and frequent flushes with
        one (a rate cap alone paces whole batches)."""
        if pace is None or not pace.throttled:
            return cls(index, collection, 0, flush_rows, pace)
        flush = min(flush_rows or PACED_FLUSH_ROWS, PACED_FLUSH_ROWS)
        return cls(index, collection, PACED_UPSERT_ROWS, flush, pace)

    def write(self, rows: Sequence[Mapping[str, Any]], *, insert: bool = False) -> int:
        """Upsert (or ``insert``: ids the collection does not hold) ``rows``, complete gallery rows; returns
        how many."""
        step = self.upsert_rows or len(rows) or 1
        for start in range(0, len(rows), step):
            chunk = list(rows[start : start + step])
            self.index.upsert(chunk, self.collection, insert=insert)
            if self.pace is not None:
                self.pace.after_batch(len(chunk))
        self.written += len(rows)
        self._unflushed += len(rows)
        if self.flush_rows and self._unflushed >= self.flush_rows and self.index.needs_periodic_flush:
            self.flush()
        return len(rows)

    def flush(self) -> None:
        """Seal what was written since the last flush."""
        self.index.flush(self.collection)
        self._unflushed = 0


def rows_of_other_versions(
    index: Any, collection: str, version: str, size: int
) -> Iterator[list[dict[str, Any]]]:
    """Batches of at most ``size`` rows of ``collection`` written by another version than ``version``, read
    again after each batch until none is left: the caller rewrites each batch, which takes it out of the
    filter (a batch read twice means the write is not visible: refused)."""
    from components.adapters.index import ROW_FIELDS, quote
    from components.rollout.types import RolloutError

    flt, previous = f"model_version != {quote(version)}", None
    while rows := index.rows_where(flt, ROW_FIELDS, collection, limit=size):
        keys = [r["item_id"] for r in rows]
        if keys == previous:
            raise RolloutError(
                f"the write of {len(keys)} items to {collection} is not visible to its next read; check the "
                "index's consistency and run again (it resumes)"
            )
        previous = keys
        yield rows


def new_rows(
    encoders: RolloutEncoders,
    previous: Sequence[Mapping[str, Any]],
    spec: Mapping[str, Any],
    centres: np.ndarray | None,
) -> list[dict[str, Any]]:
    """The rows a stage writes for ``previous`` rows: re-embedded (action ``reembed``: the new version,
    embedded now) or mapped by the gallery transform (``transform``: version and time kept), stamped with the
    rollout and ``spec["row_stage"]`` (``backfill_stage``: 1 + the stage that took a row from the source, 0:
    not taken from it), their order keys computed against ``centres``."""
    from compat.backfill import order_scores
    from components.adapters.index import now_ms
    from components.rollout.plan import check_vectors
    from components.rollout.types import item_ref

    n, dim = len(previous), int(spec["dim"])
    if spec["action"] == "transform":
        old = np.asarray([r["vector"] for r in previous], dtype=np.float32)
        vectors = check_vectors(encoders.gallery_transform(old), n, dim, "gallery_transform")
        stamp: dict[str, Any] = {"transform": spec["transform"]}
    else:
        vectors = check_vectors(
            encoders.new_gallery([item_ref(r) for r in previous]), n, dim, "gallery encoder"
        )
        stamp = {"model_version": spec["new_version"], "embedded_at": now_ms(), "transform": ""}
    scores = order_scores(vectors, centres)
    return [
        {
            **r,
            **stamp,
            "vector": vectors[j].tolist(),
            "space_id": spec["space"],
            "rollout_id": spec["rollout_id"],
            "key_lambda_orth": float(scores["key_lambda_orth"][j]),
            "key_uncertainty": float(scores["key_uncertainty"][j]),
            "backfill_stage": int(spec["row_stage"]),
        }
        for j, r in enumerate(previous)
    ]
