"""BT2 over a series of three versions, trained (two fits of forty steps): the backbone trains and reports
its parameters, and every later model reads every earlier gallery by truncation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import pair_batches, pairs

from compat.methods import get_method
from compat.methods.contract import CompatError
from compat.methods.layers import truncate
from compat.methods.model import load_compat_model
from compat.models import build_model


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
