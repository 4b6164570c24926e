"""Partial backfill: backfill orders, mixed galleries and the backfill curve.

A partial backfill replaces the gallery vectors of the old model by new-model vectors item by item,
in an order pi. After a fraction beta of the gallery is done, the first floor(beta * N) items of pi
hold new vectors and the rest keep old (possibly forward-adapted) vectors (lambda-orth, Sec. 3.6,
and FastFill). The figure of merit is the backfilling metric

    M~(pi) = E_{beta ~ U[0, 1]} M(gallery_{pi, beta})

i.e. the area under the backfill curve beta -> M, computed here by the trapezoid rule over [0, 1].

Backfill orders (all return item indices, the first to backfill first):

* ``random``: a seeded permutation (the FCT baseline).
* ``oldest_first``: ascending ``embedded_at`` (ties broken by index), the items written longest ago first.
* ``lambda_orth``: Sec. 3.6 of the lambda-orthogonality paper. mu_c = mean of F(h^k) over class c,
  d_i = ||F(h^k_i) - mu_{c_i}||_2, backfill in *descending* d (farthest from its class mean first);
  App. G's cosine distance is available as ``metric="cosine"``. Without gallery labels the classes
  are k-means clusters of the forward-adapted old vectors (a choice of this project: the paper
  always has labels).
* ``uncertainty``: a training-free stand-in for FastFill's Bayesian uncertainty: cosine similarities
  of each old vector to the cluster centres; ``kind="margin"`` backfills the smallest gap between the
  two most similar centres first, ``kind="entropy"`` the highest entropy of softmax(sim / T) first.

Everything here is numpy (k-means is scikit-learn's MiniBatchKMeans; the metric callbacks may use torch);
nothing touches an index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

ORDERS: tuple[str, ...] = ("random", "oldest_first", "lambda_orth", "uncertainty")
DEFAULT_CURVE_FRACTIONS: tuple[float, ...] = tuple(float(x) for x in np.linspace(0.0, 1.0, 21))


def _matrix(x: np.ndarray, name: str) -> np.ndarray:
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

    x = _matrix(x, "kmeans input")
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


def order_random(n: int, seed: int = 0) -> np.ndarray:
    """A seeded random permutation of ``range(n)``."""
    if n < 0:
        raise ValueError(f"order_random: n must be >= 0, got {n}")
    return np.random.default_rng(seed).permutation(n)


def order_oldest_first(embedded_at: Sequence[int] | np.ndarray) -> np.ndarray:
    """Indices by ascending ``embedded_at`` (epoch ms); equal times keep index order."""
    t = np.asarray(embedded_at)
    if t.ndim != 1:
        raise ValueError(f"embedded_at: expected one timestamp per item, got shape {t.shape}")
    return np.argsort(t, kind="stable")


def class_mean_distances(
    vectors: np.ndarray, labels: Sequence[int] | np.ndarray, metric: str = "l2"
) -> np.ndarray:
    """d_i = distance of ``vectors[i]`` to the mean of its class (lambda-orth Sec. 3.6; App. G for cosine)."""
    x = _matrix(vectors, "vectors")
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


def order_lambda_orth(
    forward_old: np.ndarray,
    labels: Sequence[int] | np.ndarray | None = None,
    *,
    n_clusters: int | None = None,
    seed: int = 0,
    metric: str = "l2",
) -> np.ndarray:
    """lambda-orth ordering: descending distance of F(h^k) to its class (or k-means cluster) mean.

    ``forward_old`` holds the forward-adapted old gallery vectors F(h^k) (the old vectors themselves when
    the serving contract reads them as they are). Without ``labels``, classes are k-means clusters.
    Ties keep index order.
    """
    x = _matrix(forward_old, "forward_old")
    if labels is None:
        _, labels = kmeans(x, n_clusters or default_n_clusters(x.shape[0]), seed=seed)
    d = class_mean_distances(x, labels, metric=metric)
    return np.argsort(-d, kind="stable")


def uncertainty_scores(
    vectors: np.ndarray, centres: np.ndarray, kind: str = "margin", temperature: float = 0.05
) -> np.ndarray:
    """Per-item uncertainty from cosine similarities to ``centres``; larger means more uncertain.

    ``margin``: minus the gap between the two highest similarities (needs >= 2 centres);
    ``entropy``: entropy of softmax(similarity / temperature) over the centres.
    """
    sims = unit_rows(_matrix(vectors, "vectors")) @ unit_rows(_matrix(centres, "centres")).T
    if kind == "margin":
        if sims.shape[1] < 2:
            raise ValueError("uncertainty margin needs at least 2 centres")
        top2 = np.sort(sims, axis=1)[:, -2:]
        return -(top2[:, 1] - top2[:, 0])
    if kind == "entropy":
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        z = sims / temperature
        z -= z.max(1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(1, keepdims=True)
        return -(p * np.log(np.maximum(p, 1e-300))).sum(1)
    raise ValueError(f"uncertainty kind must be 'margin' or 'entropy', got {kind!r}")


def order_uncertainty(
    vectors: np.ndarray,
    *,
    centres: np.ndarray | None = None,
    n_clusters: int | None = None,
    kind: str = "margin",
    seed: int = 0,
    temperature: float = 0.05,
) -> np.ndarray:
    """Most uncertain items first (see :func:`uncertainty_scores`); centres from k-means when not given."""
    x = _matrix(vectors, "vectors")
    if centres is None:
        centres, _ = kmeans(unit_rows(x), n_clusters or default_n_clusters(x.shape[0]), seed=seed)
    scores = uncertainty_scores(x, centres, kind=kind, temperature=temperature)
    return np.argsort(-scores, kind="stable")


def compute_order(
    order: str,
    n: int,
    *,
    seed: int = 0,
    embedded_at: np.ndarray | None = None,
    vectors: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    n_clusters: int | None = None,
) -> np.ndarray:
    """The positions of ``n`` items in backfill order ``order`` (one of :data:`ORDERS`)."""
    if order == "random":
        ranking = order_random(n, seed)
    elif order == "oldest_first":
        if embedded_at is None:
            raise ValueError("order 'oldest_first' needs embedded_at (one timestamp per item)")
        ranking = order_oldest_first(embedded_at)
    elif order in ("lambda_orth", "uncertainty"):
        if vectors is None:
            raise ValueError(f"order {order!r} needs the (forward-adapted) old gallery vectors")
        ranking = (
            order_lambda_orth(vectors, labels, n_clusters=n_clusters, seed=seed)
            if order == "lambda_orth"
            else order_uncertainty(vectors, n_clusters=n_clusters, seed=seed)
        )
    else:
        raise ValueError(f"unknown backfill order {order!r}; choose one of {', '.join(ORDERS)}")
    if len(ranking) != n:
        raise ValueError(f"order {order!r} ranked {len(ranking)} items, expected {n}")
    return np.asarray(ranking, dtype=np.int64)


def backfilled_count(n: int, fraction: float) -> int:
    """floor(fraction * n), robust to float rounding (0.29 * 100 -> 29)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    return min(n, int(math.floor(fraction * n + 1e-9)))


def mix_gallery(old: np.ndarray, new: np.ndarray, order: np.ndarray, fraction: float) -> np.ndarray:
    """The gallery at ``fraction``: the first floor(fraction * N) items of ``order`` take new vectors."""
    if old.shape[0] != new.shape[0] or old.shape[0] != len(order):
        raise ValueError(
            f"old ({old.shape[0]}), new ({new.shape[0]}) and order ({len(order)}) must have one "
            "entry per gallery item"
        )
    if old.shape[1] != new.shape[1]:
        raise ValueError(
            f"old vectors have dimension {old.shape[1]} and new ones {new.shape[1]}: a partial "
            "backfill needs one space (apply the serving contract's transform first)"
        )
    mixed = np.array(old, copy=True)
    done = np.asarray(order[: backfilled_count(len(order), fraction)])
    mixed[done] = new[done]
    return mixed


def curve_area(fractions: Sequence[float], values: Sequence[float]) -> float:
    """Trapezoid area under a backfill curve over [0, 1] = E_{beta~U[0,1]} M (FastFill / lambda-orth M~)."""
    f = np.asarray(fractions, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if f.shape != v.shape or f.ndim != 1 or len(f) < 2:
        raise ValueError("curve_area needs at least two (fraction, value) points of equal length")
    if not np.all(np.diff(f) > 0) or abs(f[0]) > 1e-12 or abs(f[-1] - 1.0) > 1e-12:
        raise ValueError(f"fractions must increase strictly from 0 to 1, got {f.tolist()}")
    return float(((v[1:] + v[:-1]) * np.diff(f)).sum() / 2.0)


def fraction_to_reach(fractions: Sequence[float], values: Sequence[float], target: float) -> float | None:
    """The first fraction at which the curve reaches ``target`` (None if it never does)."""
    return next((float(f) for f, v in zip(fractions, values, strict=True) if v >= target), None)


Metric = Callable[[np.ndarray], dict[str, float]]


def t2i_recall_metric(
    queries: np.ndarray, positives: Sequence[Sequence[int]], ks: Sequence[int] = (1, 5, 10)
) -> Metric:
    """A gallery -> {"R@K": percent} callback for text-to-image recall (compat.metrics.recall_at_k)."""
    import torch

    from compat.metrics import recall_at_k

    q = torch.from_numpy(unit_rows(_matrix(queries, "queries")).astype(np.float32))

    def metric(gallery: np.ndarray) -> dict[str, float]:
        g = torch.from_numpy(unit_rows(_matrix(gallery, "gallery")).astype(np.float32))
        return {f"R@{k}": v for k, v in recall_at_k(q, g, positives, ks).items()}

    return metric


def backfill_curve(
    metric: Metric,
    old: np.ndarray,
    new: np.ndarray,
    order: np.ndarray,
    fractions: Sequence[float] = DEFAULT_CURVE_FRACTIONS,
) -> list[dict[str, float]]:
    """[{"fraction": beta, **metric(mixed gallery at beta)}] for each beta in ``fractions``."""
    return [{"fraction": float(b), **metric(mix_gallery(old, new, order, float(b)))} for b in fractions]


# ------------------------------------------------------------------------------ keys stored with each row
# What a gallery index stores with each row so that a backfill stage is a filter on it
# (components.rollout.keys): a hash of the id, and the lambda-orth / uncertainty keys against centres.
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
