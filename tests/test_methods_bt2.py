"""BT^2: Algorithm 1's blocks and shapes, exact recovery of old vectors by truncation on a constructed case,
the widened projections, and a series of three versions where v3 reads the v1 and v2 galleries by
truncation."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import one_thread, pair_batches, pairs

from compat.methods import get_method
from compat.methods.bt2 import BT2Head, split_widened, widen_projections
from compat.methods.contract import CompatError
from compat.methods.layers import truncate
from compat.methods.model import load_compat_model
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


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    v1 = build_model("cf-tiny", seed=0)
    indep2, indep3 = build_model("cf-tiny", seed=1), build_model("cf-tiny", seed=2)
    data = pair_batches(64, 32)
    method = get_method("bt2")
    common = {"steps": 40, "lr": 1e-3, "old_space_id": "space-v1"}
    v2 = method.fit(indep2, v1, data, method.make_config({**common, "extra_dims": 16, "version": "v2"}))
    v3 = method.fit(indep3, v2, data, method.make_config({**common, "extra_dims": 32, "version": "v3"}))
    return v1, v2, v3, indep3


def _alignment(query_model, gallery_model, images, texts) -> float:
    """Mean cosine of a query model's vectors, truncated to the gallery width, with the gallery model's."""
    scores = []
    for q, g in (
        (query_model.encode_images(images), gallery_model.encode_images(images)),
        (query_model.encode_texts(texts), gallery_model.encode_texts(texts)),
    ):
        qq, gg = truncate(q, g.shape[1]), F.normalize(g, dim=-1)
        scores.append((qq * gg).sum(-1).mean().item())
    return sum(scores) / 2


def test_series_of_three_versions_reads_every_earlier_gallery_by_truncation(series, tmp_path):
    v1, v2, v3, indep3 = series
    assert (v2.contract.dim, v2.contract.old_dims) == (80, (64,))
    assert (v3.contract.dim, v3.contract.old_dims) == (96, (80, 64))
    assert v3.contract.old_vector_rule == "truncate" and v3.contract.space_id == "space-v1"
    images, texts = pairs(24, "eval")
    queries = v3.encode_texts(texts)
    for gallery in (
        v1,
        v2,
    ):  # v3 queries read the v1 and v2 galleries through the contract: prefix truncation
        g = gallery.encode_images(images)
        q, gg = v3.read_old_gallery(queries, g)
        assert q.shape[1] == g.shape[1] and torch.allclose(q, truncate(queries, g.shape[1]))
    with pytest.raises(CompatError, match="reads \\(80, 64\\)"):
        v3.read_old_gallery(queries, torch.randn(3, 72))
    # compatibility was learned: v2 -> v1, v3 -> v2 and, through the nested prefixes, v3 -> v1
    baseline = _alignment(indep3, v1, images, texts)
    for query_model, gallery_model in ((v2, v1), (v3, v2), (v3, v1)):
        aligned = _alignment(query_model, gallery_model, images, texts)
        assert aligned > 0.5 and aligned > baseline + 0.3, (
            query_model.contract.query_model_version,
            aligned,
            baseline,
        )
    # saved and loaded, v3 serves the same vectors and keeps its lineage
    v3.save(tmp_path / "v3")
    loaded = load_compat_model(tmp_path / "v3")
    assert loaded.contract == v3.contract
    assert torch.allclose(loaded.encode_texts(texts), queries, atol=1e-5)
    assert torch.allclose(loaded.encode_images(images), v3.encode_images(images), atol=1e-5)


def test_bt2_trains_the_backbone_and_reports_its_parameters(series):
    v1, v2, _, _ = series
    head = v2.head
    assert v2.trainable_parameters == v2.backbone.num_parameters() + head.num_trainable() + 1
    assert (
        v2.training_info["steps"] == 40
        and v2.training_info["history"][-1]["old_cos"] < v2.training_info["history"][0]["old_cos"]
    )
