"""What `compatflow status` calls a problem (exit 1) and what it says to run next, from its document."""

from __future__ import annotations

import pytest

from pipelines.status import next_step, problems


def _doc(served: str, production: str, rollout: dict | None) -> dict:
    return {
        "registry": {"production": {"version": production}},
        "gallery": {"query_model_version": served},
        "rollout": rollout,
    }


def test_a_served_version_other_than_production_with_no_change_under_way_is_a_disagreement() -> None:
    doc = _doc("3", "2", {"status": "completed", "new_version": "2"})
    found = problems(doc)
    assert len(found) == 1 and "disagree" in found[0]
    assert "compatflow rollback" in next_step(doc, found)


@pytest.mark.parametrize(
    "rollout",
    [
        {"status": "running", "new_version": "3"},
        {"status": "halted", "new_version": "3"},
        {"status": "completed", "new_version": "3"},  # killed after the backfill, before the promotion
    ],
)
def test_a_change_not_yet_promoted_is_unfinished_not_a_disagreement(rollout: dict) -> None:
    doc = _doc("3", "2", rollout)
    assert problems(doc) == []
    said = next_step(doc, [])
    assert "compatflow run" in said and "compatflow rollback" in said
