"""The probe's scoring and the floors a backfill stage must hold (components.rollout.probes, .plan)."""

from __future__ import annotations

import math

import pytest

from components.rollout.plan import probe_margin, stage_floors
from components.rollout.probes import broken_floors, recall_from_hits


def test_recall_counts_a_query_once_whichever_of_its_relevant_items_is_found() -> None:
    ranked = [["a", "b", "c"], ["x", "y", "a"], ["q", "r", "s"], ["b", "a", "z"]]
    positives = [["a"], ["a"], ["a"], ["a", "b"]]  # the last query finds both of its items: one hit
    assert recall_from_hits(ranked, positives, ks=(1, 3)) == {"R@1": 50.0, "R@3": 75.0}
    with pytest.raises(ValueError, match="3 rankings for 4 queries"):
        recall_from_hits(ranked[:3], positives)


def test_the_margin_is_the_binomial_standard_error_of_the_baseline() -> None:
    assert probe_margin(50.0, 100, 1.0) == pytest.approx(5.0)  # 100 * sqrt(0.25 / 100)
    assert probe_margin(50.0, 100, 2.0) == pytest.approx(10.0)
    assert probe_margin(9.17, 600, 1.0) == pytest.approx(100 * math.sqrt(0.0917 * 0.9083 / 600))
    assert probe_margin(50.0, 100, 0.0) == 0.0  # exact floors when asked
    assert probe_margin(0.0, 100, 1.0) == probe_margin(100.0, 100, 1.0) == 0.0  # no spread at the ends
    with pytest.raises(ValueError, match="standard errors"):
        probe_margin(50.0, 0, 1.0)


def test_a_query_short_of_old_old_passes_within_the_margin_and_a_broken_gallery_does_not() -> None:
    """The case that halted an identical blue-green model: 600 probe queries, old/old R@10 9.17, the rebuilt
    index one query short (9.00). Within one standard error (1.18 points) it passes; a broken mixed gallery
    (R@10 0.5) is far below and halts, naming the metric."""
    baseline = {"R@10": 55 / 6}
    floors = {m: v - probe_margin(v, 600, 1.0) for m, v in baseline.items()}
    assert broken_floors({"R@10": 54 / 6}, floors) == []
    assert broken_floors({"R@10": 54 / 6}, baseline) == ["R@10 9.00 < floor 9.17"]  # exact floors halt
    assert broken_floors({"R@10": 0.5}, floors) == ["R@10 0.50 < floor 7.99"]


def test_floors_never_fall_below_zero_and_a_configured_floor_raises_them() -> None:
    baseline = {"R@1": 10.0, "R@5": 50.0}
    assert stage_floors(baseline, 100, 1.0, {}) == pytest.approx({"R@1": 7.0, "R@5": 45.0})
    assert stage_floors(baseline, 100, 100.0, {}) == {
        "R@1": 0.0,
        "R@5": 0.0,
    }  # a loose tolerance: 0, not less
    assert stage_floors(baseline, 100, 1.0, {"R@5": 48.0}) == pytest.approx({"R@1": 7.0, "R@5": 48.0})
    assert stage_floors(baseline, 100, 0.0, {}) == baseline
