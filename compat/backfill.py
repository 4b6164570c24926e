"""Backfill helpers the rollout stores with each row, and the clustering the lambda-orth order needs.

``class_mean_distances`` is lambda-orth's Sec. 3.6 score (distance of F(h^k) to its class mean); the rollout
writes ``order_keys`` (a hash of the id) and ``order_scores`` (the lambda-orth and uncertainty keys against
k-means centres) with each row, so that a backfill stage is a filter on them (:mod:`components.rollout.keys`).
The offline backfill orders and curves that benchmarks compare live in ``benchmarks/backfill_curves.py``.

Everything here is numpy (k-means is scikit-learn's MiniBatchKMeans); nothing touches an index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty [N, D] matrix, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or infinite values")
    return x


def unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def default_n_clusters(n: int) -> int:
    """Clusters used when an order needs classes and none are given: round(sqrt(N / 2)), at least 2."""
    return max(2, min(n, int(round(math.sqrt(n / 2.0)))))


KMEANS_N_INIT = 3  # k-means++ seedings tried (each on a sample of at most init_size points); the best is kept
KMEANS_BATCH_SIZE = 4096  # points per mini-batch: memory is O(batch_size * k), not O(N * k)


def kmeans(
    x: np.ndarray,
    k: int,
    *,
    seed: int = 0,
    iters: int = 100,
    n_init: int = KMEANS_N_INIT,
    batch_size: int = KMEANS_BATCH_SIZE,
    threads: int | None = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """k-means (scikit-learn's ``MiniBatchKMeans``, k-means++ seeding); returns (centres [k, D], labels [N]).

    Deterministic for a given seed. ``n_init`` seedings are tried and the one of least inertia kept; ``iters``
    bounds the passes over the data. Memory grows with ``batch_size * k``, never with ``N * k``: labels are
    assigned in chunks. A gallery no larger than ``batch_size`` is clustered in full batches. ``threads``
    caps the BLAS/OpenMP threads of the fit (``None``: the libraries' default); one thread is the default
    because on a shared CPU their threads cost more than they save (benchmarks/results/backfill_order.md).
    """
    from sklearn.cluster import MiniBatchKMeans
    from threadpoolctl import threadpool_limits

    x = as_matrix(x, "kmeans input")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: k={k} must lie in [1, {n}] (the number of points)")
    if n_init < 1 or batch_size < 1 or iters < 1:
        raise ValueError(f"kmeans: n_init={n_init}, batch_size={batch_size}, iters={iters}: each must be >=1")
    model = MiniBatchKMeans(
        n_clusters=k,
        init="k-means++",
        n_init=n_init,
        max_iter=iters,
        batch_size=min(batch_size, n),
        random_state=seed,
        compute_labels=True,
    )
    with threadpool_limits(limits=threads):
        model.fit(x)
    return np.asarray(model.cluster_centers_, dtype=np.float64), np.asarray(model.labels_, dtype=np.int64)


def class_mean_distances(
    vectors: np.ndarray, labels: Sequence[int] | np.ndarray, metric: str = "l2"
) -> np.ndarray:
    """d_i = distance of ``vectors[i]`` to the mean of its class (lambda-orth Sec. 3.6; App. G for cosine)."""
    x = as_matrix(vectors, "vectors")
    y = np.asarray(labels)
    if y.shape != (x.shape[0],):
        raise ValueError(f"labels: expected {x.shape[0]} labels (one per vector), got shape {y.shape}")
    classes, inverse = np.unique(y, return_inverse=True)
    means = np.zeros((len(classes), x.shape[1]))
    np.add.at(means, inverse, x)
    means /= np.bincount(inverse, minlength=len(classes))[:, None]
    if metric == "l2":
        return np.linalg.norm(x - means[inverse], axis=1)
    if metric == "cosine":
        return 1.0 - (unit_rows(x) * unit_rows(means)[inverse]).sum(1)
    raise ValueError(f"metric must be 'l2' or 'cosine', got {metric!r}")


def backfilled_count(n: int, fraction: float) -> int:
    """floor(fraction * n), robust to float rounding (0.29 * 100 -> 29)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    return min(n, int(math.floor(fraction * n + 1e-9)))


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def order_keys(ids: Sequence[str]) -> np.ndarray:
    """Each item id's ``order_key``: FNV-1a over its UTF-8 bytes, then splitmix64, kept to 63 bits (an INT64
    that is never negative). Vectorised over the ids: one numpy pass per byte of the widest id."""
    b = np.char.encode(np.asarray(ids, dtype=str), "utf-8") if len(ids) else np.zeros(0, dtype="S1")
    data = np.frombuffer(b.tobytes(), dtype=np.uint8).reshape(len(b), b.dtype.itemsize)
    h = np.full(len(b), np.uint64(0xCBF29CE484222325), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(data.shape[1]):
            col = data[:, j].astype(np.uint64)
            live = col != 0  # numpy pads shorter ids with NUL bytes, which are not part of the id
            h = np.where(live, ((h ^ col) * np.uint64(0x100000001B3)) & _MASK64, h)
    return (_splitmix64(h) >> np.uint64(1)).astype(np.int64)


def fit_centres(vectors: np.ndarray, n_clusters: int | None = None, seed: int = 0) -> np.ndarray:
    """k-means centres of unit ``vectors`` (a bounded sample), float32 ``[k, D]``; k defaults to
    :func:`compat.backfill.default_n_clusters` of the sample."""
    x = unit_rows(np.asarray(vectors, dtype=np.float64))
    k = min(len(x), n_clusters or default_n_clusters(len(x)))
    if k < 2:
        return np.asarray(x[:1], dtype=np.float32)
    centres, _ = kmeans(x, k, seed=seed)
    return np.asarray(centres, dtype=np.float32)


def order_scores(vectors: np.ndarray, centres: np.ndarray | None) -> dict[str, np.ndarray]:
    """The ``key_lambda_orth`` and ``key_uncertainty`` of each row of ``vectors`` against ``centres`` (zeros
    without centres: those orders then fall back to ``order_key``, i.e. random)."""
    n = len(vectors)
    if centres is None or len(centres) == 0 or n == 0:
        return {"key_lambda_orth": np.zeros(n, np.float32), "key_uncertainty": np.zeros(n, np.float32)}
    x = unit_rows(np.asarray(vectors, dtype=np.float64))
    c = np.asarray(centres, dtype=np.float64)
    sims = x @ unit_rows(c).T
    nearest = sims.argmax(1)
    distance = np.linalg.norm(x - c[nearest], axis=1)
    top2 = np.sort(sims, axis=1)[:, -2:] if sims.shape[1] > 1 else np.hstack([sims, sims])
    return {
        "key_lambda_orth": (-distance).astype(np.float32),
        "key_uncertainty": (top2[:, 1] - top2[:, 0]).astype(np.float32),
    }
