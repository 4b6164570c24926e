"""Planning a rollout: what :meth:`components.rollout.engine.Rollout._plan` reads from the serving collection
(the source behind the alias, the probe set's coverage of it, a bounded sample of it) and decides before any
write (the probe floors, the stage list). Nothing here reads the whole collection."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from components.adapters.index import ORDER_FIELDS, GalleryIndex
from components.rollout.probes import probe_metrics
from components.rollout.types import ProbeSet, RolloutConfig, RolloutError
from components.serving.record import ServingRecord

log = logging.getLogger(__name__)

READ_ROWS = 2000  # rows per read of the sample


def check_vectors(vectors: Any, n: int, dim: int | None, what: str) -> np.ndarray:
    """``vectors`` as float32 ``[n, dim]``; a wrong shape or a non-finite value raises :class:`RolloutError`
    naming the encoder (``what``) that returned them."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[0] != n or (dim is not None and v.shape[1] != dim):
        raise RolloutError(f"{what} returned shape {v.shape}, expected [{n}, {dim or 'D'}]")
    if not np.isfinite(v).all():
        raise RolloutError(f"{what} returned NaN or infinite values")
    return v


@dataclass(frozen=True)
class Source:
    """The serving collection a rollout starts from."""

    record: ServingRecord
    collection: str
    space: str
    dim: int


def serving_source(index: GalleryIndex, serving: ServingRecord | None, serving_path: Path) -> Source:
    """The collection behind the alias, with the serving record; refuses a gallery not indexed yet."""
    if serving is None:
        raise RolloutError(
            f"no serving record at {serving_path}: index the gallery first "
            "(components.rollout.index_gallery / `compatflow rollout index`)"
        )
    collection = index.serving_collection()
    if collection is None:
        raise RolloutError(f"alias {index.alias!r} does not exist at {index.uri}: index the gallery first")
    return Source(serving, collection, index.collection_space(collection), index.collection_dim(collection))


def check_probe_covers(probe: ProbeSet, index: GalleryIndex, collection: str) -> None:
    """At least one probe query must have a relevant item in ``collection`` (a warning for those without);
    reads the probe's positives by id (bounded by the probe set, not the gallery)."""
    present = index.existing_ids(sorted({p for pos in probe.positives for p in pos}), collection)
    answerable = sum(any(p in present for p in pos) for pos in probe.positives)
    if answerable == 0:
        raise RolloutError(
            f"no probe query has a relevant item in collection {collection!r}: the probe set belongs to "
            "another gallery (item ids must match the indexed item_id values)"
        )
    if answerable < len(probe.positives):
        unanswerable = len(probe.positives) - answerable
        log.warning(
            f"{unanswerable} of {len(probe.positives)} probe queries have no relevant item in {collection}"
        )


def read_sample(
    index: GalleryIndex, collection: str, n_items: int, *, vectors: bool = False
) -> list[dict[str, Any]]:
    """About :data:`~components.rollout.keys.SAMPLE_ROWS` rows of ``collection`` with their order keys (and
    ``vectors``): a uniform sample by ``order_key`` (from a collection made before per-row keys: its first
    rows). Bounded whatever the gallery's size."""
    from components.rollout.keys import SAMPLE_ROWS, sample_filter

    fields = ("embedded_at", *ORDER_FIELDS, *(("vector",) if vectors else ()))
    if not index.has_order_keys(collection):
        return index.rows_where('item_id != ""', fields, collection, limit=SAMPLE_ROWS)
    filt = sample_filter(n_items, SAMPLE_ROWS)
    return [row for page in index.iter_rows(fields, collection, filt, batch_size=READ_ROWS) for row in page]


def probe_floors(
    index: GalleryIndex, source: Source, old_queries: np.ndarray, probe: ProbeSet, config: RolloutConfig
) -> tuple[dict[str, float], dict[str, float]]:
    """The probe's metrics on the source collection with the old queries (the baseline) and the floors every
    stage must hold (:func:`stage_floors`)."""
    baseline = probe_metrics(index, source.collection, old_queries, probe, config.ks)
    return baseline, stage_floors(baseline, len(probe.texts), config.probe_tolerance, config.floors)


def stage_floors(
    baseline: Mapping[str, float], n_queries: int, standard_errors: float, configured: Mapping[str, float]
) -> dict[str, float]:
    """Each metric's floor: its old/old ``baseline`` less ``standard_errors`` standard errors
    (:func:`probe_margin`), never below 0 (a recall is not), raised to a ``configured`` floor where higher."""
    return {
        m: max(v - probe_margin(v, n_queries, standard_errors), float(configured.get(m, 0.0)), 0.0)
        for m, v in baseline.items()
    }


def probe_margin(recall: float, n_queries: int, standard_errors: float) -> float:
    """How far (in points) a stage's R@K may fall below the old/old ``recall`` of ``n_queries`` probe
    queries: ``standard_errors`` x the binomial standard error 100 * sqrt(p (1 - p) / n), p = recall / 100.
    A rebuilt index answers near-tied queries differently, a query or two apart from old/old; one standard
    error lets that pass while a broken mixed gallery, tens of points down, halts (0: old/old exactly)."""
    if standard_errors < 0 or n_queries < 1:
        raise ValueError(f"probe margin: {standard_errors} standard errors over {n_queries} queries")
    p = min(max(recall / 100.0, 0.0), 1.0)
    return float(standard_errors * 100.0 * math.sqrt(p * (1.0 - p) / n_queries))


def stage_plan(mode: str, n: int, fractions: Sequence[float]) -> list[dict[str, Any]]:
    """The stages of a rollout of ``n`` items: one fill for blue-green; else the query switch (stage 0) and
    one backfill stage per fraction."""
    from compat.backfill import backfilled_count

    def pending(stage: int, fraction: float, position: int, kind: str) -> dict[str, Any]:
        return dict(stage=stage, fraction=fraction, target_position=position, status="pending", kind=kind)

    if mode == "blue_green":
        return [pending(1, 1.0, n, "fill")]
    backfill = [pending(j + 1, f, backfilled_count(n, f), "backfill") for j, f in enumerate(fractions)]
    return [pending(0, 0.0, 0, "query_switch"), *backfill]
