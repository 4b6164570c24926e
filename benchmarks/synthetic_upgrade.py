"""A known-geometry upgrade for smoke runs, tests and benchmarks of the backfill and the rollout engine.

:func:`synthetic_upgrade` builds clustered old/new galleries and queries whose answers are known;
:func:`synthetic_encoders` and :func:`synthetic_query_encoder` serve it as rollout encoder factories
(``--encoders benchmarks.synthetic_upgrade:synthetic_encoders``; the module must be listed in
``$COMPATFLOW_TRUSTED_MODULES``, see :mod:`components.serving.record`).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compat.backfill import unit_rows
from components.rollout.types import ItemRef, QueryEncoder, RolloutEncoders

MODULE = "benchmarks.synthetic_upgrade"  # what $COMPATFLOW_TRUSTED_MODULES must list to use the factories
QUERY_FACTORY = f"{MODULE}:synthetic_query_encoder"


@dataclass
class SyntheticUpgrade:
    """A known-geometry upgrade: a clustered gallery where the new model's vectors are less noisy.

    Item i has a latent z_i = c_{y_i} + spread * e_i. The old model sees z_i + sigma_i * noise with
    sigma_i growing with the item's age (older items were written by older, noisier models, so
    ``embedded_at`` and the distance to the cluster mean both carry information about which items
    gain most); the new model sees z_i + new_noise * noise. Query i is a noisy view of z_i (text to
    image: one relevant item per query). All vectors are L2-normalised and live in one space.
    """

    old_gallery: np.ndarray
    new_gallery: np.ndarray
    old_queries: np.ndarray
    new_queries: np.ndarray
    positives: list[list[int]]
    labels: np.ndarray
    embedded_at: np.ndarray
    old_noise: np.ndarray

    @property
    def item_ids(self) -> list[str]:
        """Stable ids of the gallery items (``item-00000`` ...)."""
        return [f"item-{i:05d}" for i in range(len(self.labels))]

    @property
    def query_texts(self) -> list[str]:
        """One text per query, naming its relevant item (``find item-00042``)."""
        return [f"find item-{p[0]:05d}" for p in self.positives]

    def query_vectors(self, texts: Sequence[str], side: str) -> np.ndarray:
        """Vectors of :attr:`query_texts` entries under the ``"old"`` or ``"new"`` query model."""
        table = {"old": self.old_queries, "new": self.new_queries}.get(side)
        if table is None:
            raise ValueError(f"side must be 'old' or 'new', got {side!r}")
        row = {t: j for j, t in enumerate(self.query_texts)}
        missing = [t for t in texts if t not in row]
        if missing:
            raise ValueError(
                f"unknown synthetic query text(s) {missing[:3]}; texts look like 'find item-00042'"
            )
        return table[[row[t] for t in texts]]

    def index_old_gallery(
        self,
        index: Any,
        paths: Any,
        options: Mapping[str, Any],
        *,
        space: str = "s1",
        source_uris: Sequence[str] | None = None,
    ) -> Any:
        """Index the old gallery as version v1 in ``space``, served by the old synthetic query model built
        from ``options`` (:func:`synthetic_query_encoder`); returns the serving record (ServingRecord)."""
        from components.rollout import index_gallery

        return index_gallery(
            index,
            paths,
            self.item_ids,
            self.old_gallery,
            version="v1",
            space=space,
            query_model={
                "factory": f"{MODULE}:synthetic_query_encoder",
                "options": dict(options),
                "side": "old",
            },
            embedded_at=self.embedded_at,
            source_uris=source_uris,
        )

    def gallery_vectors(self, item_ids: Sequence[str], side: str) -> np.ndarray:
        """Gallery vectors of ``item_ids`` under the ``"old"`` or ``"new"`` model."""
        table = {"old": self.old_gallery, "new": self.new_gallery}.get(side)
        if table is None:
            raise ValueError(f"side must be 'old' or 'new', got {side!r}")
        idx = []
        for item_id in item_ids:
            num = str(item_id).removeprefix("item-")
            if not num.isdigit() or not 0 <= int(num) < len(table):
                raise ValueError(f"unknown synthetic item id {item_id!r}")
            idx.append(int(num))
        return table[idx]


def synthetic_upgrade(
    n_items: int = 2000,
    n_queries: int | None = None,
    dim: int = 32,
    n_clusters: int = 20,
    *,
    spread: float = 0.35,
    old_noise: tuple[float, float] = (0.2, 0.9),
    new_noise: float = 0.3,
    old_query_noise: float = 0.35,
    new_query_noise: float = 0.15,
    age_jitter: float = 0.15,
    seed: int = 0,
) -> SyntheticUpgrade:
    """Build a :class:`SyntheticUpgrade` (deterministic in ``seed``)."""
    if n_items < 2 or dim < 2 or n_clusters < 1:
        raise ValueError("synthetic_upgrade needs n_items >= 2, dim >= 2 and n_clusters >= 1")
    n_queries = n_items if n_queries is None else n_queries
    if not 1 <= n_queries <= n_items:
        raise ValueError(f"n_queries must lie in [1, {n_items}], got {n_queries}")
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(dim)
    centres = unit_rows(rng.normal(size=(n_clusters, dim)))
    labels = rng.integers(n_clusters, size=n_items)
    latent = centres[labels] + spread * scale * rng.normal(size=(n_items, dim))
    latent = unit_rows(latent)
    u = rng.uniform(size=n_items)
    sigma = old_noise[0] + (old_noise[1] - old_noise[0]) * u
    age = np.clip(u + age_jitter * rng.normal(size=n_items), 0.0, None)  # 0 = newest
    embedded_at = (1_700_000_000_000 - age * 86_400_000 * 365).astype(np.int64)

    def view(noise: np.ndarray | float, rows: np.ndarray) -> np.ndarray:
        sig = np.asarray(noise, dtype=np.float64).reshape(-1, 1) if np.ndim(noise) else noise
        return unit_rows(rows + sig * scale * rng.normal(size=rows.shape)).astype(np.float32)

    qidx = np.sort(rng.choice(n_items, size=n_queries, replace=False))
    return SyntheticUpgrade(
        old_gallery=view(sigma, latent),
        new_gallery=view(new_noise, latent),
        old_queries=view(old_query_noise, latent[qidx]),
        new_queries=view(new_query_noise, latent[qidx]),
        positives=[[int(i)] for i in qidx],
        labels=labels,
        embedded_at=embedded_at,
        old_noise=sigma,
    )


def _synthetic(options: Mapping[str, Any]) -> Any:
    keys = {"n_items": int, "n_queries": int, "dim": int, "n_clusters": int, "seed": int}
    return synthetic_upgrade(**{k: cast(options[k]) for k, cast in keys.items() if k in options})


def space_change(options: Mapping[str, Any], dim: int) -> tuple[np.ndarray | None, str | None]:
    """A fixed isometry ``[dim, new_dim]`` and the space id ``new<new_dim>`` when ``new_dim`` is set: the new
    model writes into a space the old one cannot read (a blue-green rollout), else ``(None, None)``."""
    if not options.get("new_dim"):
        return None, None
    new_dim = int(options["new_dim"])
    if new_dim < dim:
        raise ValueError(f"option new_dim must be >= dim ({dim}), got {new_dim}")
    rng = np.random.default_rng(int(options.get("seed", 0)) + 7919)
    rot = np.linalg.qr(rng.normal(size=(new_dim, new_dim)))[0][:dim].astype(np.float32)
    return rot, f"new{new_dim}"


def synthetic_encoders(config: Mapping[str, Any]) -> RolloutEncoders:
    """Encoders of :func:`synthetic_upgrade` (for smoke runs and benchmarks).

    Options: ``n_items``, ``n_queries``, ``dim``, ``n_clusters``, ``seed`` (the geometry), ``delay_s``
    (a pause per gallery batch, standing in for a slow encoder), ``new_dim`` (the new model writes into a
    space of that many dimensions, ``new<new_dim>``, which the old model cannot read: blue-green),
    ``broken`` (new gallery vectors collapse onto the mean query direction -- hubs that outrank the relevant
    items of most queries -- a regression every stage probe must catch).
    """
    opts = dict(config.get("options") or {})
    upgrade = _synthetic(opts)
    delay = float(opts.get("delay_s", 0.0))
    broken = str(opts.get("broken", "")).lower() in ("1", "true", "yes")
    hub = upgrade.new_queries.mean(0)

    def gallery(refs: Sequence[ItemRef]) -> np.ndarray:
        if delay:
            time.sleep(delay)
        vectors = upgrade.gallery_vectors([r.item_id for r in refs], "new")
        if broken:
            rng = np.random.default_rng(zlib.crc32(refs[0].item_id.encode()))
            vectors = hub + 0.05 * np.linalg.norm(hub) * rng.normal(size=vectors.shape)
            vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
        return vectors

    rot, space = space_change(opts, upgrade.old_gallery.shape[1])
    if rot is None:
        return RolloutEncoders(
            old_query=lambda t: upgrade.query_vectors(t, "old"),
            new_query=lambda t: upgrade.query_vectors(t, "new"),
            new_gallery=gallery,
        )
    return RolloutEncoders(
        old_query=lambda t: upgrade.query_vectors(t, "old"),
        new_query=lambda t: upgrade.query_vectors(t, "new") @ rot,
        new_gallery=lambda refs: gallery(refs) @ rot,
        space=space,
    )


def synthetic_query_encoder(query_model: Mapping[str, Any]) -> QueryEncoder:
    """Query encoder of a synthetic model (``options`` as in :func:`synthetic_encoders`, ``side`` old|new)."""
    options = query_model.get("options") or {}
    upgrade = _synthetic(options)
    side = str(query_model.get("side", "new"))
    rot, _ = space_change(options, upgrade.old_gallery.shape[1]) if side == "new" else (None, None)
    if rot is not None:
        return lambda texts: upgrade.query_vectors(texts, side) @ rot
    return lambda texts: upgrade.query_vectors(texts, side)
