"""BT^2: Algorithm 1's blocks and shapes, exact recovery of old vectors by truncation on a constructed case,
and the widened projections (a trained series of versions: tests/integration/test_methods_bt2_series.py)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import one_thread, pairs

from compat.methods.bt2 import BT2Head, split_widened, widen_projections
from compat.methods.contract import CompatError
from compat.methods.layers import truncate
from compat.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def test_head_blocks_orthonormal_norm_and_shapes():
    head = BT2Head(m=12, n=10, d=4, c=2.0)
    with torch.no_grad():
        head.b1.upper.normal_(0, 0.5)
        head.b2.upper.normal_(0, 0.5)
    for block, k in ((head.b1, 12), (head.b2, 10)):
        p = block.matrix()
        assert torch.allclose(p.T @ p, torch.eye(k), atol=1e-5)
    out = head(torch.randn(7, 22))
    assert out.phi_new.shape == (7, 16) and head.out_dim == 16
    assert out.phi5.shape == (7, 10) and out.phi3.shape == (7, 12)
    # ||phi_new|| = sqrt(1 + C^2) for every input (phi_2 unit, phi_4 of norm C, orthonormal blocks)
    assert torch.allclose(out.phi_new.norm(dim=-1), torch.full((7,), math.sqrt(5.0)), atol=1e-5)
    # the prefix is phi_5, the tail the incompatible part of phi_4
    assert torch.equal(out.phi_new[:, :10], out.phi5)
    with pytest.raises(CompatError, match="1 <= d <= n <= m \\+ d"):
        BT2Head(m=4, n=10, d=2)


def test_truncation_recovers_old_vectors_exactly_on_a_constructed_case():
    # d = n, B_2 = I and f selecting the last n coordinates of phi_1, which hold the old vector: the paper's
    # concatenation upper bound as a special case of Algorithm 1. phi_new[:n] must be the old vector exactly.
    m, n = 6, 5
    head = BT2Head(m=m, n=n, d=n, c=2.0)
    with torch.no_grad():
        head.f.weight.copy_(torch.cat([torch.zeros(n, m), torch.eye(n)], dim=1))
        head.f.bias.zero_()
    old = F.normalize(torch.randn(9, n), dim=-1)
    new_part = torch.randn(9, m)
    out = head(torch.cat([new_part, old], dim=1))
    served = F.normalize(out.phi_new, dim=-1)
    assert torch.allclose(truncate(served, n), old, atol=1e-6)
    # the full vector keeps phi'_new's geometry: <phi_new_i, phi_new_j> = <old_i, old_j> + C^2 <p3_i, p3_j>
    gram = out.phi_new @ out.phi_new.T
    p3 = F.normalize(new_part, dim=-1)
    assert torch.allclose(gram, old @ old.T + 4.0 * p3 @ p3.T, atol=1e-5)


def test_widened_projections_keep_the_original_embedding_and_split_back():
    bundle = build_model("cf-tiny", seed=0)
    images, texts = pairs(4, "eval")
    before_i, before_t = (
        bundle.encode_images(images, normalize=False),
        bundle.encode_texts(texts, normalize=False),
    )
    wide = dataclasses.replace(bundle, model=copy.deepcopy(bundle.model))
    grown = widen_projections(wide.model, 5, torch.Generator().manual_seed(0))
    assert set(grown) == {"visual.proj", "text_projection"}
    after_i, after_t = wide.encode_images(images, normalize=False), wide.encode_texts(texts, normalize=False)
    assert after_i.shape == (4, 69)
    assert torch.allclose(after_i[:, :64], before_i, atol=1e-5) and torch.allclose(
        after_t[:, :64], before_t, atol=1e-5
    )
    base, extra = split_widened(wide.model.state_dict(), grown, 64)
    plain = build_model("cf-tiny", seed=9)
    plain.model.load_state_dict(base, strict=True)
    assert torch.allclose(plain.encode_images(images, normalize=False), before_i, atol=1e-5)
    assert extra["extra.visual.proj"].shape == (64, 5)
