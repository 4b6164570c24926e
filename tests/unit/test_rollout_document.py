"""The rollout state document (components.state.rollout_document): a version-1 file (statuses named
``state``, ``new_version`` repeated as ``model_version``) reads as this version's, a valid one passes its
model, a broken one is refused naming the file and the field."""

from __future__ import annotations

import copy
import json

import pytest

from schemas import SchemaError, validate


def _document(version: int = 2) -> dict:
    word = "status" if version == 2 else "state"
    model = {"version": "1", "uri": "models/v1"}
    return {
        "schema_version": version,
        "rollout_id": "0123456789ab",
        word: "halted",
        "mode": "staged",
        "new_version": "2",
        **({"model_version": "2"} if version == 1 else {}),  # an earlier release repeated new_version
        "stage": 1,
        "fractions": [0.5, 1.0],
        "n_items": 10,
        "fraction_backfilled": 0.5,
        "batch_size": 4,
        "order": {
            "policy": "random",
            "seed": 0,
            "offset": 0,
            "cuts": [None],
            "centres": "rollout/x/centres.npy",
        },
        "cursor": {"position": 5, "batches": 2},
        "query_model": model,
        "previous_query_model": model,
        "new_query_model": {"version": "2", "uri": "models/v2"},
        "gallery": {
            "uri": "index/gallery.db",
            "alias": "gallery",
            "source_collection": "g1",
            "source_space": "s1",
            "collection": "g1",
            "space": "s1",
            "dim": 8,
            "versions_before": {"1": 10},
        },
        "ks": [1, 5],
        "baseline": {"R@1": 40.0, "R@5": 70.0},
        "floors": {"R@1": 35.0},
        "stages": [
            {"stage": 0, "fraction": 0.0, "target_position": 0, word: "accepted", "kind": "query_switch"},
            {"stage": 1, "fraction": 0.5, "target_position": 5, word: "halted", "kind": "backfill"},
        ],
        "curve": [{"fraction": 0.5, "t2i_R@1": 38.0}],
        "restored": True,
        "halt_reason": "R@1 below its floor",
        "rollback": {
            "started_at": "2026-11-27T10:00:00+00:00",
            **({"from_state": "halted"} if version == 1 else {}),
        },
        "workers": 1,  # a field of the engine's own, kept
    }


def test_a_version_1_state_reads_as_this_versions(tmp_path):
    from components.state.rollout_document import SCHEMA_VERSION, RolloutState

    path = tmp_path / "rollout_state.json"
    path.write_text(json.dumps(_document(version=1)))
    doc = RolloutState.read(path, ValueError).document()
    assert doc["schema_version"] == SCHEMA_VERSION == 2 and doc["status"] == "halted" and "state" not in doc
    assert [s["status"] for s in doc["stages"]] == ["accepted", "halted"]
    assert doc["rollback"]["from_status"] == "halted" and doc["workers"] == 1 and "model_version" not in doc
    validate(doc, "rollout_state", source=str(path))  # the generated schema holds it too


def test_the_rollout_engines_reader_migrates_too(tmp_path):
    from components.rollout.state import load_state

    path = tmp_path / "rollout_state.json"
    path.write_text(json.dumps(_document(version=1)))
    state = load_state(path)
    assert state.status == "halted" and state.order.centres == str(tmp_path / "rollout/x/centres.npy")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(status="backfilling"), "status"),
        (lambda d: d["stages"][1].update(status="done"), "stages.1.status"),
        (lambda d: d["baseline"].pop("R@1"), "baseline"),
        (lambda d: d["baseline"].update({"recall": 3.0}), "baseline"),
        (lambda d: d.pop("cursor"), "cursor"),
        (lambda d: d.update(schema_version=3), "schema_version"),
    ],
)
def test_a_broken_rollout_state_is_refused_naming_the_file_and_field(tmp_path, change, field):
    from components.state.rollout_document import RolloutState

    document = copy.deepcopy(_document())
    change(document)
    path = tmp_path / "rollout_state.json"
    path.write_text(json.dumps(document))
    with pytest.raises(SchemaError) as err:
        RolloutState.read(path, ValueError)
    assert str(path) in str(err.value) and field in str(err.value)


def test_a_valid_state_passes_unchanged(tmp_path):
    from components.state.rollout_document import RolloutState

    document = _document()
    path = tmp_path / "rollout_state.json"
    path.write_text(json.dumps(document))
    assert RolloutState.read(path, ValueError).document() == document
