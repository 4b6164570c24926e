"""How a rollout writes to Milvus: the rows of a stage, written in calls of a bounded size, flushed every so
many rows.

Milvus answers one call at a time, so a user's query that arrives during a write waits for it: an upsert of
256 rows holds queries ~24 ms, one of 32 rows ~5 ms, and a flush ~20 ms for 256 unflushed rows, ~55 ms for
1,024 (milvus-lite, measured for benchmarks/results/backfill.md). Left unflushed, thousands of rows make
every search a slow brute-force scan. Unpaced, a rollout writes whole batches and flushes every
``flush_rows`` rows (throughput); with the SLO throttle on, it writes ``PACED_UPSERT_ROWS`` per call and
flushes every ``PACED_FLUSH_ROWS`` rows, so that no single write holds a query for long (tail latency).
A Milvus server indexes growing segments itself and a flush there costs seconds: the periodic flushes are
for milvus-lite only (:attr:`components.adapters.index.GalleryIndex.needs_periodic_flush`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def new_rows(
    encoders: RolloutEncoders,
    previous: Sequence[Mapping[str, Any]],
    spec: Mapping[str, Any],
    centres: np.ndarray | None,
) -> list[dict[str, Any]]:
    """The rows a stage writes for ``previous`` rows: re-embedded by the new gallery encoder (action
    ``reembed``: the new version, embedded now) or their vectors mapped by the gallery transform (action
    ``transform``: a transformed copy, version and time kept), in ``spec["space"]``, stamped with the rollout
    and ``spec["row_stage"]`` (``backfill_stage``: 1 + the stage that wrote a row from the source, 0 for one
    the rollout did not take from it), their order keys computed against ``centres``."""
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
