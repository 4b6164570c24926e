"""Backfill orders, mixed galleries and the backfill curve (compat.backfill), on known answers."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import backfill_curves as curves
from benchmarks.synthetic_upgrade import synthetic_upgrade
from compat import backfill as bf


def _blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.array([[10.0, 0.0], [0.0, 10.0], [-10.0, -10.0]])
    labels = np.repeat(np.arange(3), 30)
    return centres[labels] + 0.3 * rng.normal(size=(90, 2)), labels


def test_kmeans_recovers_separated_blobs() -> None:
    x, labels = _blobs()
    centres, found = bf.kmeans(x, 3, seed=1)
    # same partition up to a relabelling: each true blob maps to exactly one cluster
    mapping = {int(t): int(f) for t, f in zip(labels, found, strict=True)}
    assert len(set(mapping.values())) == 3
    assert all(mapping[int(t)] == int(f) for t, f in zip(labels, found, strict=True))
    assert np.allclose(np.sort(centres[:, 0]), [-10.0, 0.0, 10.0], atol=0.3)
    with pytest.raises(ValueError, match="k=4"):
        bf.kmeans(x[:3], 4)


def test_kmeans_in_mini_batches_recovers_blobs_and_is_seeded() -> None:
    """A gallery larger than one batch is clustered in mini-batches: 5 well-separated 8-d blobs of 2,000
    points each, batches of 512, come back as the 5 blobs, the same for the same seed."""
    rng = np.random.default_rng(3)
    true_centres = 20.0 * np.eye(8)[:5]
    labels = np.repeat(np.arange(5), 2000)
    x = true_centres[labels] + rng.normal(size=(10000, 8))
    centres, found = bf.kmeans(x, 5, seed=7, batch_size=512)
    pairs = set(zip(labels.tolist(), found.tolist(), strict=True))
    assert len(pairs) == 5 and len({f for _, f in pairs}) == 5  # a bijection blob <-> cluster
    for true, cluster in pairs:
        assert np.linalg.norm(centres[cluster] - true_centres[true]) < 0.5
    _, again = bf.kmeans(x, 5, seed=7, batch_size=512)
    _, threaded = bf.kmeans(x, 5, seed=7, batch_size=512, threads=None)
    assert again.tolist() == found.tolist() == threaded.tolist()
    with pytest.raises(ValueError, match="n_init=0"):
        bf.kmeans(x, 5, n_init=0)


def test_random_order_is_a_seeded_permutation() -> None:
    a, b, c = curves.order_random(50, 3), curves.order_random(50, 3), curves.order_random(50, 4)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_oldest_first_is_ascending_and_stable() -> None:
    assert curves.order_oldest_first([30, 10, 20, 10]).tolist() == [1, 3, 2, 0]


def test_class_mean_distances_by_hand() -> None:
    x = np.array([[0.0, 0.0], [2.0, 0.0], [5.0, 5.0], [1.0, 3.0]])
    y = np.array([0, 0, 1, 0])  # class 0 mean = (1, 1)
    d = bf.class_mean_distances(x, y)
    assert np.allclose(d, [np.sqrt(2), np.sqrt(2), 0.0, 2.0])
    cos = bf.class_mean_distances(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([0, 0]), metric="cosine")
    assert np.allclose(cos, 1 - np.cos(np.pi / 4))
    with pytest.raises(ValueError, match="metric"):
        bf.class_mean_distances(x, y, metric="manhattan")


def test_lambda_orth_order_is_descending_distance_to_class_mean() -> None:
    # Sec. 3.6: farthest from its class mean first.
    x = np.array([[0.0, 0.0], [2.0, 0.0], [5.0, 5.0], [1.0, 3.0]])
    y = np.array([0, 0, 1, 0])
    assert curves.order_lambda_orth(x, y).tolist() == [3, 0, 1, 2]


def test_lambda_orth_without_labels_uses_clusters() -> None:
    x, labels = _blobs()
    x[7] += np.array([4.0, 0.0])  # an outlier of blob 0, still nearest to it
    x[40] += np.array([0.0, -2.0])  # a smaller outlier of blob 1
    with_labels = curves.order_lambda_orth(x, labels)
    without = curves.order_lambda_orth(x, n_clusters=3, seed=0)
    assert with_labels[:2].tolist() == [7, 40]
    assert without.tolist() == with_labels.tolist()


def test_uncertainty_puts_boundary_items_first() -> None:
    centres = np.array([[1.0, 0.0], [0.0, 1.0]])
    x = np.array([[1.0, 0.05], [1.0, 1.0], [0.1, 1.0], [1.0, 0.5]])
    margin = curves.uncertainty_scores(x, centres, "margin")
    assert int(np.argmax(margin)) == 1  # equidistant from both centres
    assert curves.order_uncertainty(x, centres=centres).tolist() == [1, 3, 2, 0]
    assert curves.order_uncertainty(x, centres=centres, kind="entropy").tolist() == [1, 3, 2, 0]
    with pytest.raises(ValueError, match="2 centres"):
        curves.uncertainty_scores(x, centres[:1], "margin")


def test_compute_order_dispatch_and_errors() -> None:
    x, _ = _blobs()
    t = np.arange(90)[::-1]
    assert curves.compute_order("oldest_first", 90, embedded_at=t).tolist() == list(range(89, -1, -1))
    for policy in curves.ORDERS:
        order = curves.compute_order(policy, 90, embedded_at=t, vectors=x, n_clusters=3)
        assert sorted(order.tolist()) == list(range(90)), policy
    with pytest.raises(ValueError, match="unknown backfill order"):
        curves.compute_order("fifo", 3)
    with pytest.raises(ValueError, match="embedded_at"):
        curves.compute_order("oldest_first", 3)
    with pytest.raises(ValueError, match="old gallery vectors"):
        curves.compute_order("lambda_orth", 3)


def test_backfilled_count_and_mix() -> None:
    assert bf.backfilled_count(100, 0.29) == 29
    assert bf.backfilled_count(7, 1.0) == 7
    assert bf.backfilled_count(10, 0.0) == 0
    with pytest.raises(ValueError):
        bf.backfilled_count(10, 1.5)
    old, new = np.zeros((5, 2)), np.ones((5, 2))
    mixed = curves.mix_gallery(old, new, np.array([3, 1, 4, 0, 2]), 0.4)
    assert mixed[:, 0].tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="one space"):
        curves.mix_gallery(old, np.ones((5, 3)), np.arange(5), 0.5)


def test_curve_area_is_the_trapezoid_mean_over_beta() -> None:
    assert curves.curve_area([0, 1], [40, 40]) == pytest.approx(40)
    assert curves.curve_area([0, 0.5, 1], [0, 50, 100]) == pytest.approx(50)
    assert curves.curve_area([0, 0.25, 1], [20, 60, 60]) == pytest.approx((20 + 60) / 2 * 0.25 + 60 * 0.75)
    with pytest.raises(ValueError, match="from 0 to 1"):
        curves.curve_area([0.1, 1], [1, 2])
    assert curves.fraction_to_reach([0, 0.5, 1], [10, 30, 50], 30) == 0.5
    assert curves.fraction_to_reach([0, 1], [10, 20], 30) is None


def test_synthetic_upgrade_curves() -> None:
    """Known structure: old/old < new/old < new/new, and ordering by distance to the class mean
    (noisy, far-from-centre items first) has a larger curve area than a random order."""
    u = synthetic_upgrade(n_items=800, n_queries=400, seed=2)
    m_old = curves.t2i_recall_metric(u.old_queries, u.positives)
    m_new = curves.t2i_recall_metric(u.new_queries, u.positives)
    old_old, new_old, new_new = (
        m_old(u.old_gallery)["R@1"],
        m_new(u.old_gallery)["R@1"],
        m_new(u.new_gallery)["R@1"],
    )
    assert old_old < new_old < new_new
    fractions = np.linspace(0, 1, 11)
    areas = {}
    for policy in ("random", "lambda_orth"):
        order = curves.compute_order(policy, 800, seed=0, vectors=u.old_gallery, labels=None)
        curve = curves.backfill_curve(m_new, u.old_gallery, u.new_gallery, order, fractions)
        assert curve[0]["R@1"] == pytest.approx(new_old) and curve[-1]["R@1"] == pytest.approx(new_new)
        areas[policy] = curves.curve_area(fractions, [p["R@1"] for p in curve])
    assert areas["lambda_orth"] > areas["random"] + 3.0
    # the synthetic encoders address items and queries by name
    assert np.array_equal(u.gallery_vectors(u.item_ids[:2], "new"), u.new_gallery[:2])
    assert np.array_equal(u.query_vectors(u.query_texts[:1], "old"), u.old_queries[:1])
    with pytest.raises(ValueError, match="unknown synthetic query"):
        u.query_vectors(["hello"], "new")
