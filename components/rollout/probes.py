"""Probe scoring: R@K of held-out queries against a collection, and the floors a backfill stage must hold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from components.adapters.index import GalleryIndex
from components.rollout.types import DEFAULT_KS, ProbeSet


def recall_from_hits(
    ranked: Sequence[Sequence[str]], positives: Sequence[Sequence[str]], ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """R@K in percent from ranked item ids: a query is a hit at K when a relevant id is in its top K."""
    if len(ranked) != len(positives) or not ranked:
        raise ValueError(f"recall_from_hits: {len(ranked)} rankings for {len(positives)} queries")
    out = {}
    for k in ks:
        hits = sum(bool(set(r[:k]) & set(p)) for r, p in zip(ranked, positives, strict=True))
        out[f"R@{k}"] = 100.0 * hits / len(ranked)
    return out


def probe_metrics(
    index: GalleryIndex,
    collection: str,
    query_vectors: np.ndarray,
    probe: ProbeSet,
    ks: Sequence[int] = DEFAULT_KS,
    chunk: int = 32,
    layers: Sequence[Sequence[str]] | None = None,
) -> dict[str, float]:
    """R@K of the probe queries against ``collection`` (or the gallery ``layers`` make), ``chunk`` queries a
    call: one of 256 holds users' queries ~90 ms, one of 32 ~18 ms (benchmarks/results/backfill.md, E)."""
    ranked: list[list[str]] = []
    for start in range(0, len(query_vectors), chunk):
        rows = index.search(
            query_vectors[start : start + chunk], k=max(ks), collection=collection, layers=layers
        )
        ranked.extend([h.item_id for h in row] for row in rows)
    return recall_from_hits(ranked, probe.positives, ks)


def broken_floors(metrics: Mapping[str, float], floors: Mapping[str, float]) -> list[str]:
    """The floors ``metrics`` breaks, as readable reasons (empty when it passes)."""
    return [
        f"{m} {metrics[m]:.2f} < floor {floor:.2f}"
        for m, floor in floors.items()
        if not metrics[m] >= floor - 1e-9
    ]
