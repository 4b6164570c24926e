"""benchmarks/lambda_orth_table.py: the paper's columns and M~ on cases whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.lambda_orth_table import COLUMNS, backfill_area, paper_columns, render
from compat.evaluation import recalls, retrieval_hits
from compat.methods.lambda_orth import Adapters


def test_backfill_area_of_a_gallery_that_only_backfilled_items_answer_is_fifty():
    # item i's new vector is e_i and so is its query; every old vector is e_31, orthogonal to all queries:
    # a query hits exactly when its item is backfilled, so R@1(beta) = 100 beta and the area is 50
    n = 20
    target = torch.eye(32)[:n]
    start = torch.eye(32)[[31] * n]
    order = np.random.default_rng(0).permutation(n)
    assert backfill_area(target, start, target, order, list(range(n))) == pytest.approx(50.0)


def _vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_identity_adapters_on_one_model_give_old_old_everywhere():
    images, texts = _vectors(30, 16, 0), _vectors(60, 16, 1)
    images_noisy = F.normalize(images + 0.6 * _vectors(30, 16, 2), dim=-1)
    counts = [2] * 30
    hits = retrieval_hits(images_noisy, texts, images_noisy, texts, counts, ks=(1,))
    old_old = {d: recalls(hits[d], (1,))["R@1"] for d in ("t2i", "i2t")}
    assert 0 < old_old["t2i"] < 100  # the case is not trivial
    cols = paper_columns(Adapters("strict", 16, 16), images_noisy, texts, images_noisy, texts, counts)
    for name in COLUMNS:
        assert cols[name] == pytest.approx(old_old), name
    # start gallery = target gallery: the backfill curve is flat at old/old t2i in either order
    assert cols["M~ t2i"]["lambda_orth"] == pytest.approx(old_old["t2i"])
    assert cols["M~ t2i"]["random"] == pytest.approx(old_old["t2i"])


def test_fct_has_no_backward_pairs_and_no_own_order():
    old_img, old_txt = _vectors(20, 16, 3), _vectors(20, 16, 4)
    new_img, new_txt = _vectors(20, 24, 5), _vectors(20, 24, 6)
    cols = paper_columns(Adapters("fct", 16, 24), old_img, old_txt, new_img, new_txt, [1] * 20)
    assert cols["B(new)/old"] is None and cols["B(new)/B(new)"] is None
    assert cols["F(old)/old"] is None  # F maps into the 24-d new space: no pair with 16-d old vectors
    assert set(cols["M~ t2i"]) == {"random"}
    table = "\n".join(render([{"label": "fct", "paper_columns": cols}]))
    assert "\n| fct | - | " in table and table.count("\n| fct |") == 1
