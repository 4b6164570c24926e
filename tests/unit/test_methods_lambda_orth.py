"""lambda-orth: Eq. 6 by hand and in its limits, strict B orthogonal, Eqs. 2/7/9 on known cases, the
truncation rule, recovering a known rotation on real CLIP towers, serving, backfill scores and save/load."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import one_thread, pair_batches, pairs

from compat.methods import get_method
from compat.methods.contract import CompatError
from compat.methods.lambda_orth import (
    Adapters,
    PairedFeatures,
    backfill_scores,
    lambda_orth_losses,
    lambda_orth_penalty,
)
from compat.methods.layers import OrthogonalMatrix
from compat.methods.model import load_compat_model
from compat.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def rotation_generator(dim: int, angle: float, seed: int = 0) -> torch.Tensor:
    """A skew-symmetric S with spectral norm ``angle``: exp(S) rotates by at most ``angle`` radians."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    skew = (a - a.T) / 2
    return skew / torch.linalg.matrix_norm(skew, ord=2) * angle


def small_rotation(dim: int, angle: float, seed: int = 0) -> torch.Tensor:
    return torch.linalg.matrix_exp(rotation_generator(dim, angle, seed)).float()


# -------------------------------------------------------------------------------------------- Eq. 6
def test_penalty_matches_a_hand_computation():
    w = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    # W W^T - I = [[4, 2], [2, 0]] -> Frobenius norm sqrt(16 + 4 + 4) = sqrt(24)
    norm = math.sqrt(24.0)
    for lam, alpha in ((3.0, 2.0), (6.0, 0.5), (0.0, 1.0)):
        expected = norm / (1 + math.exp(-alpha * (norm - lam)))
        assert lambda_orth_penalty(w, lam, alpha).item() == pytest.approx(expected, rel=1e-6)


def test_penalty_limits_heaviside_and_orthogonal():
    w = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    norm = math.sqrt(24.0)
    # alpha -> inf: the Heaviside step of Eq. 5 (no penalty below lambda, the full norm above)
    assert lambda_orth_penalty(w, norm + 0.1, 1e4).item() == pytest.approx(0.0, abs=1e-12)
    assert lambda_orth_penalty(w, norm - 0.1, 1e4).item() == pytest.approx(norm, rel=1e-6)
    # lambda = 0 with a steep sigmoid: the soft-orthogonality loss of Eq. 3 (the norm itself, not squared)
    assert lambda_orth_penalty(w, 0.0, 1e4).item() == pytest.approx(norm, rel=1e-6)
    # an orthogonal W costs nothing and keeps a finite gradient
    q = small_rotation(8, 0.7).requires_grad_(True)
    value = lambda_orth_penalty(q, 1.0, 10.0)
    value.backward()
    assert value.item() < 1e-5 and torch.isfinite(q.grad).all()
    # above lambda the gradient pulls W towards orthogonality
    w2 = (1.5 * torch.eye(4)).requires_grad_(True)
    lambda_orth_penalty(w2, 0.0, 10.0).backward()
    assert (torch.diagonal(w2.grad) > 0).all()


def test_strict_b_is_orthogonal():
    b = OrthogonalMatrix(64)
    with torch.no_grad():
        b.upper.normal_(0, 0.5)
    m = b.matrix()
    assert torch.allclose(m @ m.T, torch.eye(64), atol=1e-5)
    assert torch.linalg.det(m.double()).item() == pytest.approx(1.0, abs=1e-6)
    x = F.normalize(torch.randn(10, 64), dim=-1)
    assert torch.allclose(b(x).norm(dim=-1), torch.ones(10), atol=1e-5)  # an isometry
    assert b.num_trainable() == 64 * 63 // 2


# ---------------------------------------------------------------------------------- Eqs. 2, 7, 9, 10
def test_losses_on_a_known_case():
    torch.manual_seed(0)
    n, d = 6, 8
    old_i, old_t = F.normalize(torch.randn(n, d), dim=-1), F.normalize(torch.randn(n, d), dim=-1)
    skew = rotation_generator(d, 0.4)
    rot = torch.linalg.matrix_exp(skew).float()
    new_i, new_t = old_i @ rot.T, old_t @ rot.T
    feats = PairedFeatures(old_i, old_t, new_i, new_t)
    adapters = Adapters("strict", d, d)  # B = I, F = identity at initialisation
    terms = lambda_orth_losses(adapters, feats, temperature=0.5)
    # Eq. 2 with B = I: ||R h - h||^2, averaged over pairs and the two modalities
    l_b = (((new_i - old_i) ** 2).sum(1).mean() + ((new_t - old_t) ** 2).sum(1).mean()) / 2
    assert terms.backward.item() == pytest.approx(l_b.item(), rel=1e-5)
    # Eq. 7 with F = I and B = I: ||h_k - h_t||^2, the same number
    assert terms.forward.item() == pytest.approx(l_b.item(), rel=1e-5)

    # Eq. 9, unlabelled image-text form, by hand: CLIP-style cross-modal CE in both directions
    def clip_by_hand(a, b, scale):
        logits = scale * a @ b.T
        target = torch.arange(a.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    def contr(ai, at, ci, ct):
        return (clip_by_hand(ai, ct, 2.0) + clip_by_hand(ci, at, 2.0)) / 2

    l_c = contr(old_i, old_t, new_i, new_t) + contr(old_i, old_t, old_i, old_t)
    assert terms.contrastive.item() == pytest.approx(l_c.item(), rel=1e-5)
    assert terms.penalty.item() == 0.0
    assert terms.total.item() == pytest.approx(2 * l_b.item() + l_c.item(), rel=1e-5)

    # once B undoes the rotation, L_B vanishes and L_F measures F against B(h_t) = h_k
    with torch.no_grad():
        adapters.backward.orth.upper.copy_(torch.triu(-skew, 1).float())  # exp(-S) = R^T
    exact = lambda_orth_losses(adapters, feats)
    assert exact.backward.item() < 1e-8 and exact.forward.item() < 1e-8

    # relaxed B adds Eq. 6 at weight 1 on the same W
    relaxed = Adapters("relaxed", d, d)
    with torch.no_grad():
        relaxed.backward.linear.weight.mul_(1.5)
    r = lambda_orth_losses(relaxed, feats, lam=0.5, alpha=3.0)
    assert r.penalty.item() == pytest.approx(
        lambda_orth_penalty(1.5 * torch.eye(d), 0.5, 3.0).item(), rel=1e-6
    )
    assert r.total.item() == pytest.approx(
        r.forward.item() + r.backward.item() + r.contrastive.item() + r.penalty.item(), rel=1e-6
    )


def test_truncation_rule_on_dimension_mismatch():
    # new wider than old: B is square on the first m = old_dim coordinates of the new vector
    a = Adapters("strict", old_dim=8, new_dim=12)
    new = F.normalize(torch.randn(3, 12), dim=-1)
    assert a.dim == 8 and a.queries(new).shape == (3, 8)
    assert torch.allclose(a.queries(new), F.normalize(new[:, :8], dim=-1), atol=1e-6)  # B = I at init
    assert a(torch.randn(3, 8)).shape == (3, 8)
    # old wider than new: the old side is truncated in L_B; F still reads the whole old vector
    b = Adapters("strict", old_dim=12, new_dim=8)
    feats = PairedFeatures(*(F.normalize(torch.randn(5, k), dim=-1) for k in (12, 12, 8, 8)))
    assert b.dim == 8 and b.forward_map.in_features == 12
    assert torch.isfinite(lambda_orth_losses(b, feats).total)
    # FCT keeps the new space: F maps old to the full new dimension, no B
    fct = Adapters("fct", old_dim=8, new_dim=12)
    assert fct.backward is None and fct.dim == 12 and fct(torch.randn(2, 8)).shape == (2, 12)


# ------------------------------------------------------------------------------------ real towers
@pytest.fixture(scope="module")
def towers():
    old = build_model("cf-tiny", seed=3)
    rot = small_rotation(old.embed_dim, 0.3, seed=1)
    model = copy.deepcopy(old.model)
    with torch.no_grad():  # new = old followed by a known rotation: e_new = R e_old
        model.visual.proj.copy_(model.visual.proj @ rot.T)
        model.text_projection.copy_(model.text_projection @ rot.T)
    return old, dataclasses.replace(old, model=model), rot


def test_strict_fit_recovers_a_known_rotation_and_serves_through_b(towers, tmp_path):
    old, new, rot = towers
    method = get_method("lambda_orth")
    config = method.make_config({"steps": 400, "batch_size": 64, "lr": 3e-3, "w_contrastive": 0.0})
    data = pair_batches(64, 32)
    model = method.fit(new, old, data, config)
    b = model.adapters.backward.weight().detach()
    assert torch.allclose(b @ b.T, torch.eye(64), atol=1e-5)
    assert (b - rot.T).abs().max().item() < 0.05, "B did not learn R^-1"
    images, texts = pairs(16, "eval")
    cos = (model.encode_texts(texts) * old.encode_texts(texts)).sum(-1)
    assert cos.min().item() > 0.99  # B(new) reads the old space
    assert model.trainable_parameters == 64 * 63 // 2 + 64 * 64 + 64
    assert model.contract.old_vector_rule == "forward_adapter" and model.contract.keeps_space
    assert model.training_info["final_orthogonality_gap"] < 1e-4

    # the old gallery is read through F; save / load restores the same serving encoders and adapters
    old_gallery = old.encode_images(images)
    q, g = model.read_old_gallery(model.encode_texts(texts), old_gallery)
    with torch.no_grad():
        assert torch.allclose(g, F.normalize(model.adapters(old_gallery), dim=-1), atol=1e-6)
    model.save(tmp_path / "lo")
    loaded = load_compat_model(tmp_path / "lo")
    assert loaded.contract == model.contract and loaded.trainable_parameters == model.trainable_parameters
    assert torch.allclose(loaded.encode_texts(texts), model.encode_texts(texts), atol=1e-6)
    assert torch.allclose(loaded.forward_adapter(old_gallery), model.forward_adapter(old_gallery), atol=1e-6)
    # a tampered adapter file is refused by name
    path = tmp_path / "lo" / "adapters.safetensors"
    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CompatError, match="adapters.safetensors: sha256 mismatch"):
        load_compat_model(tmp_path / "lo")


def test_as_is_rule_relaxed_variant_and_fct(towers):
    old, new, _ = towers
    method = get_method("lambda_orth")
    data = pair_batches(64, 32)
    relaxed = method.fit(
        new,
        old,
        data,
        method.make_config({"steps": 60, "variant": "relaxed", "lam": 0.5, "old_vector_rule": "as_is"}),
    )
    assert relaxed.contract.old_vector_rule == "as_is"
    assert relaxed.trainable_parameters == 2 * (64 * 64 + 64)
    assert "penalty" in relaxed.training_info["history"][-1]
    fct = method.fit(new, old, data, method.make_config({"steps": 60, "variant": "fct"}))
    texts = pairs(4, "eval")[1]
    assert torch.allclose(fct.encode_texts(texts), new.encode_texts(texts), atol=1e-6)  # FCT: raw new queries
    with pytest.raises(CompatError, match="FCT variant"):
        method.make_config({"variant": "fct", "old_vector_rule": "as_is"})
    with pytest.raises(CompatError, match="variant must be one of"):
        method.make_config({"variant": "orthogonal"})


def test_backfill_scores_class_means_and_clusters():
    f = torch.tensor([[0.0, 0.0], [2.0, 0.0], [10.0, 10.0], [10.0, 13.0], [10.0, 10.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    # class 0 mean (1, 0): distances 1, 1; class 1 mean (10, 11): distances 1, 2, 1
    assert torch.allclose(backfill_scores(f, labels), torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0]))
    # unlabelled: k-means clusters of F(h_k) play the classes (two well separated blobs here)
    assert torch.allclose(backfill_scores(f, n_clusters=2), torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0]))
