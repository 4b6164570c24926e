"""Partial backfill offline: backfill orders, mixed galleries and the backfill curve (benchmarks and tests).

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

from collections.abc import Callable, Sequence

import numpy as np

from compat.backfill import (
    as_matrix,
    backfilled_count,
    class_mean_distances,
    default_n_clusters,
    kmeans,
    unit_rows,
)

ORDERS: tuple[str, ...] = ("random", "oldest_first", "lambda_orth", "uncertainty")
DEFAULT_CURVE_FRACTIONS: tuple[float, ...] = tuple(float(x) for x in np.linspace(0.0, 1.0, 21))


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
    x = as_matrix(forward_old, "forward_old")
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
    sims = unit_rows(as_matrix(vectors, "vectors")) @ unit_rows(as_matrix(centres, "centres")).T
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
    x = as_matrix(vectors, "vectors")
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

    q = torch.from_numpy(unit_rows(as_matrix(queries, "queries")).astype(np.float32))

    def metric(gallery: np.ndarray) -> dict[str, float]:
        g = torch.from_numpy(unit_rows(as_matrix(gallery, "gallery")).astype(np.float32))
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
