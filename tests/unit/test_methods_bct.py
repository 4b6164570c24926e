"""BCT: the loss equals CLIP's loss on the cross-model pairs computed by hand, zero-padding of narrower old
features, and a short fit that lowers the influence loss without touching the caller's model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import one_thread, pair_batches, pairs

from compat.methods import get_method
from compat.methods.bct import (
    bct_loss,
    cross_model_loss,
    old_model_matches,
    old_vector_rule,
    unmatched_to_old_image,
)
from compat.methods.model import load_compat_model
from compat.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def _clip_by_hand(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Symmetric InfoNCE written out: mean over rows of -log softmax of the diagonal, both ways."""
    logits = scale * a @ b.T
    log_rows = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    log_cols = logits - torch.logsumexp(logits, dim=0, keepdim=True)
    return -(torch.diagonal(log_rows).mean() + torch.diagonal(log_cols).mean()) / 2


def test_bct_loss_equals_clip_loss_on_cross_pairs_by_hand():
    torch.manual_seed(0)
    v_new, w_new, v_old, w_old = (F.normalize(torch.randn(6, 8), dim=-1) for _ in range(4))
    s_new, s_old, lam = 10.0, 25.0, 0.7
    terms = bct_loss(v_new, w_new, v_old, w_old, s_new, s_old, lam)
    own = _clip_by_hand(v_new, w_new, s_new)
    cross = (_clip_by_hand(v_new, w_old, s_old) + _clip_by_hand(v_old, w_new, s_old)) / 2
    assert terms.own.item() == pytest.approx(own.item(), rel=1e-5)
    assert terms.influence.item() == pytest.approx(cross.item(), rel=1e-5)
    assert terms.total.item() == pytest.approx(own.item() + lam * cross.item(), rel=1e-5)
    # gradients reach only the new features
    v_new.requires_grad_(True)
    w_old.requires_grad_(True)
    cross_model_loss(v_new, w_new, v_old, w_old, s_old).backward()
    assert v_new.grad is not None and w_old.grad is None


def test_unmatched_pairs_read_their_old_image_feature_as_the_i2t_classifier():
    """Rows 0 and 2 are matched by the old model (their old image is closest to their own caption); row 1's
    old image is closest to caption 0, so its i2t target becomes its own old image feature."""
    e = torch.eye(4)
    v_old = torch.stack([e[0], e[0] * 0.9 + e[3] * 0.1, e[2]])
    w_old = torch.stack([e[0], e[1], e[2]])
    v_old, w_old = F.normalize(v_old, dim=-1), F.normalize(w_old, dim=-1)
    assert old_model_matches(v_old, w_old).tolist() == [True, False, True]
    targets = unmatched_to_old_image(v_old, w_old)
    assert torch.equal(targets[0], w_old[0]) and torch.equal(targets[2], w_old[2])
    assert torch.equal(targets[1], v_old[1])

    torch.manual_seed(2)
    v_new, w_new = F.normalize(torch.randn(3, 4), dim=-1), F.normalize(torch.randn(3, 4), dim=-1)
    terms = bct_loss(v_new, w_new, v_old, w_old, 10.0, 20.0, 1.0, synthesize_unmatched=True)
    by_hand = (_clip_by_hand(v_new, targets, 20.0) + _clip_by_hand(v_old, w_new, 20.0)) / 2
    assert terms.influence.item() == pytest.approx(by_hand.item(), rel=1e-5)
    plain = bct_loss(v_new, w_new, v_old, w_old, 10.0, 20.0, 1.0)  # the default keeps every old caption
    assert plain.influence.item() == pytest.approx(cross_model_loss(v_new, w_new, v_old, w_old, 20.0).item())
    assert plain.influence.item() != pytest.approx(terms.influence.item())


def test_narrower_old_features_are_zero_padded():
    torch.manual_seed(1)
    v_new, w_new = F.normalize(torch.randn(5, 12), dim=-1), F.normalize(torch.randn(5, 12), dim=-1)
    v_old, w_old = F.normalize(torch.randn(5, 8), dim=-1), F.normalize(torch.randn(5, 8), dim=-1)
    padded = cross_model_loss(v_new, w_new, v_old, w_old, 10.0)
    by_hand = (_clip_by_hand(v_new[:, :8], w_old, 10.0) + _clip_by_hand(v_old, w_new[:, :8], 10.0)) / 2
    assert padded.item() == pytest.approx(by_hand.item(), rel=1e-5)  # <new, [old; 0]> = <new[:8], old>
    assert old_vector_rule(12, 8) == "zero_pad" and old_vector_rule(8, 8) == "as_is"
    assert old_vector_rule(8, 12) == "truncate"


def test_fit_lowers_the_influence_loss_and_leaves_the_caller_model_alone(tmp_path):
    old, new = build_model("cf-tiny", seed=0), build_model("cf-tiny", seed=1)
    before = {k: v.clone() for k, v in new.model.state_dict().items()}
    data = pair_batches(32, 32)  # one batch, seen every step: the loss must go down
    method = get_method("bct")
    model = method.fit(
        new, old, data, method.make_config({"steps": 25, "lr": 5e-4, "log_every": 24, "warmup_fraction": 0.0})
    )
    history = model.training_info["history"]
    assert history[-1]["influence"] < history[0]["influence"] - 0.3
    assert all(torch.equal(before[k], v) for k, v in new.model.state_dict().items())
    assert model.contract.old_vector_rule == "as_is" and model.contract.keeps_space
    assert model.trainable_parameters == new.num_parameters()
    images, texts = pairs(8, "eval")
    model.save(tmp_path / "bct")
    loaded = load_compat_model(tmp_path / "bct")
    assert loaded.contract == model.contract
    assert torch.allclose(loaded.encode_texts(texts), model.encode_texts(texts), atol=1e-6)
    assert torch.allclose(loaded.encode_images(images), model.encode_images(images), atol=1e-6)


def test_wider_new_model_serves_old_vectors_zero_padded():
    old, new = build_model("cf-tiny", seed=0), build_model("cf-small", seed=1)
    method = get_method("bct")
    model = method.fit(new, old, pair_batches(16, 8), method.make_config({"steps": 2}))
    assert (model.contract.dim, model.contract.old_dim, model.contract.old_vector_rule) == (
        128,
        64,
        "zero_pad",
    )
    q, g = model.read_old_gallery(
        F.normalize(torch.randn(3, 128), dim=-1), F.normalize(torch.randn(4, 64), dim=-1)
    )
    assert g.shape == (4, 128) and torch.equal(g[:, 64:], torch.zeros(4, 64))
