"""Retrieval recall (multi-caption protocol) and Spatial Disorder histograms on cases with known answers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from compat.metrics import (
    RAM_BINS,
    SAM_BINS,
    angle_histogram,
    correctly_retrieved,
    cross_model_retrieval,
    recall_at_k,
    retrieval_metrics,
    rotation_angles,
    sam_change_histogram,
    spatial_disorder,
)


def _rand(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1)


def _brute_recall(q, g, positives, ks):
    """Reference: full score matrix, rank of the best positive with ties counted against the query."""
    scores = q.double() @ g.double().T
    hits = {k: 0 for k in ks}
    for i, pos in enumerate(positives):
        best = scores[i, pos].max()
        mask = torch.ones(g.shape[0], dtype=torch.bool)
        mask[pos] = False
        ahead = int((scores[i][mask] >= best).sum())
        for k in ks:
            hits[k] += ahead < k
    return {k: 100.0 * hits[k] / len(positives) for k in ks}


# ----------------------------------------------------------------------------------------------- recall_at_k
def test_recall_known_ranks():
    # Gallery = the 12 one-hot directions, so a query's scores are its own (normalised) coordinates.
    gallery = torch.eye(12)
    raw = torch.tensor(
        [
            [9, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0.5],  # positive 0 ranked 1st
            [9, 8, 7, 6, 5, 4, 3, 2, 1.5, 1.2, 1.1, 1.0],  # positive 3 ranked 4th
            [9, 8, 7, 6, 5, 4, 3, 2, 1.5, 1.2, 1.1, 1.0],  # positive 11 ranked 12th
            [9, 8, 7, 6, 5, 4, 3, 2, 1.5, 1.2, 1.1, 1.0],  # positives {10, 7}: best is 7, ranked 8th
        ]
    )
    queries = F.normalize(raw, dim=-1)
    got = recall_at_k(queries, gallery, [[0], [3], [11], [10, 7]], ks=(1, 5, 10))
    assert got == {1: 25.0, 5: 50.0, 10: 75.0}


def test_recall_ties_count_against_the_query_whatever_the_order():
    gallery = torch.eye(3)
    queries = F.normalize(torch.tensor([[1.0, 1.0, 0.0]]), dim=-1)  # items 0 and 1 tie
    assert recall_at_k(queries, gallery, [[0]], ks=(1, 2)) == {1: 0.0, 2: 100.0}
    assert recall_at_k(queries, gallery, [[1]], ks=(1, 2)) == {1: 0.0, 2: 100.0}
    # Two tied relevant items do not compete with each other.
    assert recall_at_k(queries, gallery, [[0, 1]], ks=(1,)) == {1: 100.0}


def test_recall_chunked_equals_brute_force():
    base = _rand(300, 16, 0)
    gallery = F.normalize(base + 2.0 * _rand(300, 16, 1), dim=-1)
    queries = base
    positives = [[i] if i % 3 else [i, (i + 1) % 300] for i in range(300)]
    ks = (1, 5, 10)
    expected = _brute_recall(queries, gallery, positives, ks)
    assert 0 < expected[1] < expected[10] < 100
    got_small = recall_at_k(queries, gallery, positives, ks, query_chunk=7, gallery_chunk=13)
    got_big = recall_at_k(queries, gallery, positives, ks)
    assert got_small == pytest.approx(expected) and got_big == pytest.approx(expected)


def test_recall_on_a_100k_gallery_in_chunks():
    gallery = _rand(100_000, 32, 2)
    idx = torch.arange(0, 100_000, 500)  # 200 queries, each a noisy copy of one gallery item
    queries = F.normalize(gallery[idx] + 0.25 * _rand(200, 32, 3), dim=-1)
    positives = [[int(i)] for i in idx]
    got = recall_at_k(queries, gallery, positives, (1, 10), query_chunk=64, gallery_chunk=8192)
    assert got == pytest.approx(_brute_recall(queries, gallery, positives, (1, 10)))


def test_recall_rejects_bad_input():
    q, g = _rand(2, 4, 0), _rand(3, 4, 1)
    with pytest.raises(ValueError, match="empty"):
        recall_at_k(q, g, [[0], []])
    with pytest.raises(ValueError, match="outside"):
        recall_at_k(q, g, [[0], [3]])
    with pytest.raises(ValueError, match="one list per query"):
        recall_at_k(q, g, [[0]])
    with pytest.raises(ValueError, match="dimension"):
        recall_at_k(q, _rand(3, 5, 1), [[0], [1]])
    with pytest.raises(ValueError, match="NaN"):
        recall_at_k(q * float("nan"), g, [[0], [1]])


# ------------------------------------------------------------------------------------ multi-caption protocol
def test_multi_caption_protocol_known_values():
    # Two images along e0 and e1; captions 0,1 belong to image 0, captions 2,3 to image 1.
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    captions = F.normalize(
        torch.tensor(
            [
                [1.0, 0.1],  # image 0's caption, right side
                [0.1, 1.0],  # image 0's caption, but closer to image 1
                [0.0, 1.0],  # image 1's caption
                [0.2, 1.0],  # image 1's caption
            ]
        ),
        dim=-1,
    )
    got = retrieval_metrics(images, captions, captions_per_image=2, ks=(1, 2))
    # t2i: captions 0, 2, 3 find their image first, caption 1 second -> R@1 = 75, R@2 = 100.
    assert got["t2i"] == {"R@1": 75.0, "R@2": 100.0}
    # i2t: image 0's top caption is caption 0 (its own) -> hit; image 1's top is caption 2 -> hit.
    assert got["i2t"] == {"R@1": 100.0, "R@2": 100.0}
    # Per-image caption counts work too: image 0 has 1 caption, image 1 has 3.
    got = retrieval_metrics(images, captions, captions_per_image=[1, 3], ks=(1,))
    assert got["t2i"]["R@1"] == 100.0  # caption 1 now belongs to image 1, and it is closer to image 1


def test_cross_model_pairs_new_queries_old_gallery():
    n, d = 64, 16
    base = _rand(n, d, 5)
    old_img = base
    old_txt = F.normalize(base.repeat_interleave(5, dim=0) + 1.2 * _rand(5 * n, d, 6), dim=-1)
    q = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(7)))[0]
    new_img, new_txt = old_img @ q, old_txt @ q  # the new model = the old one rotated
    same = retrieval_metrics(old_img, old_txt, 5)
    assert 30 < same["t2i"]["R@1"] < 100 and 30 < same["i2t"]["R@1"] < 100
    rotated = retrieval_metrics(new_img, new_txt, 5)
    for direction in ("t2i", "i2t"):  # a rotation of both modalities keeps retrieval
        assert rotated[direction] == pytest.approx(same[direction])
    assert cross_model_retrieval(old_img, old_txt, old_img, old_txt, 5) == same
    broken = cross_model_retrieval(new_img, new_txt, old_img, old_txt, 5)  # new queries vs old gallery
    assert broken["t2i"]["R@1"] < same["t2i"]["R@1"] - 30
    assert broken["i2t"]["R@1"] < same["i2t"]["R@1"] - 30
    with pytest.raises(ValueError, match="caption embeddings"):
        retrieval_metrics(old_img, old_txt[:-1], 5)


# --------------------------------------------------------------------------------------- spatial disorder
def _plane_rotation(d: int, degrees: float) -> torch.Tensor:
    """Rotate every coordinate pair by ``degrees``: every vector turns by exactly that angle."""
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    r = torch.zeros(d, d, dtype=torch.float64)
    for k in range(0, d, 2):
        r[k : k + 2, k : k + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    return r


def test_histogram_bins_are_right_closed():
    angles = torch.tensor([0.0, 15.0, 15.001, 20.0, 25.5, 30.0, 30.01, 180.0])
    counts = [p * len(angles) / 100 for p in angle_histogram(angles, RAM_BINS)]
    assert counts == pytest.approx([2, 2, 0, 2, 2])


@pytest.mark.parametrize(("degrees", "ram_bin"), [(10.0, 0), (17.0, 1), (22.0, 2), (28.0, 3), (75.0, 4)])
def test_known_rotation_of_both_modalities(degrees, ram_bin):
    d = 8
    img = _rand(200, d, 0).double()
    txt = F.normalize(img + 0.5 * _rand(200, d, 1).double(), dim=-1)
    r = _plane_rotation(d, degrees)
    sd = spatial_disorder(img, txt, img @ r.T, txt @ r.T)
    expected = [0.0] * 5
    expected[ram_bin] = 100.0
    assert sd["ram"]["image"] == pytest.approx(expected) and sd["ram"]["text"] == pytest.approx(expected)
    assert sd["ram_mean_deg"]["image"] == pytest.approx(degrees, abs=1e-4)
    # An orthogonal map keeps every self-angle and every image-text angle.
    assert sd["sam"]["image"] == pytest.approx([100.0, 0, 0, 0, 0])
    assert sd["sam"]["text"] == pytest.approx([100.0, 0, 0, 0, 0])
    assert sd["imav"] == pytest.approx([100.0, 0, 0, 0, 0])
    assert 0 < sd["imav_samples"] <= 200


def test_flipping_one_modality_keeps_sam_breaks_alignment():
    """App A.1: R = -I on the image space keeps its topology but breaks retrieval."""
    img = _rand(100, 8, 2).double()
    txt = F.normalize(img + 0.3 * _rand(100, 8, 3).double(), dim=-1)
    sd = spatial_disorder(img, txt, -img, txt)
    assert sd["sam"]["image"] == pytest.approx([100.0, 0, 0, 0, 0])
    assert sd["ram"]["image"] == pytest.approx([0, 0, 0, 0, 100.0])
    assert sd["ram"]["text"] == pytest.approx([100.0, 0, 0, 0, 0])
    assert sd["imav"][-1] > 90  # image-text angles jump from small to near 180 - small
    assert retrieval_metrics(-img, txt, 1)["i2t"]["R@1"] < 5 < retrieval_metrics(img, txt, 1)["i2t"]["R@1"]


def test_sam_change_known_pairs_and_chunking():
    old = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    # Move sample 2 from 180 to 135 degrees: pair (0,2) changes 45, pair (1,2) changes 45, pair (0,1) 0.
    new = old.clone()
    new[2] = torch.tensor([math.cos(math.radians(135)), math.sin(math.radians(135))])
    hist = sam_change_histogram(old, new)
    assert hist == pytest.approx([100 / 3, 0, 0, 0, 200 / 3])
    a, b = _rand(50, 6, 4), _rand(50, 6, 5)
    assert sam_change_histogram(a, b, SAM_BINS, chunk=7) == pytest.approx(sam_change_histogram(a, b))


def test_rotation_angles_and_correct_retrieval():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = F.normalize(torch.tensor([[1.0, 1.0], [0.0, 1.0]]), dim=-1)
    assert rotation_angles(a, b).tolist() == pytest.approx([45.0, 0.0], abs=1e-5)
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    txt = F.normalize(torch.tensor([[1.0, 0.2], [1.0, 0.3], [-1.0, 0.1]]), dim=-1)
    # Image 1 (e1) is nearest text 1 -> right; text 1 is nearest image 0 -> wrong in t2i.
    assert correctly_retrieved(img, txt, "i2t").tolist() == [True, True, True]
    assert correctly_retrieved(img, txt, "t2i").tolist() == [True, False, True]
    assert correctly_retrieved(img, txt, "both").tolist() == [True, False, True]
    with pytest.raises(ValueError, match="L2-normalised"):
        rotation_angles(a * 3, b)
