"""Typed documents (components.state.documents, pipelines.documents): each generated schema is the committed
one, a document round-trips through its model, and a damaged or inconsistent one is refused naming the file,
the field and what to do."""

from __future__ import annotations

import json

import pytest

from pipelines.documents import DOCUMENTS, schema_text
from schemas import SCHEMA_DIR, SchemaError, validate


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_committed_schema_is_the_one_its_model_generates(name):
    committed = (SCHEMA_DIR / f"{name}.schema.json").read_text()
    assert committed == schema_text(name), f"schemas/{name}.schema.json is stale: run `make schemas`"


def _blocked():
    from components.gate import decide

    return decide({"schema_version": 1}, None)  # a report missing every field: blocked, with reasons


def test_a_gate_decision_round_trips_and_matches_its_generated_schema(tmp_path):
    from components.gate import GateDecision

    decision = _blocked()
    path = decision.write(tmp_path)
    validate(json.loads(path.read_text()), "gate_decision", source=str(path))
    again = GateDecision.read(path)
    assert again == decision and again.decision == "block" and again.reason_codes == decision.reason_codes


def test_the_first_models_record_passes_with_its_reason():
    from components.gate import GateDecision

    record = GateDecision.bootstrap_record()
    assert record.passed and record.reason_codes == ["bootstrap"]
    validate(record.to_dict(), "gate_decision", source="bootstrap")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(decision="maybe"), "decision"),
        (lambda d: d.update(reasons=[]), "a block decision needs at least one reason"),
        (lambda d: d.update(decision="pass"), "a pass decision has no reasons"),
        (lambda d: d["checks"][0].update(status="unknown"), "checks.0.status"),
        (lambda d: d.update(unexpected=1), "unexpected"),
    ],
)
def test_a_broken_gate_decision_is_refused_naming_the_file_and_field(tmp_path, change, field):
    from components.gate import GateDecision

    document = _blocked().to_dict()
    change(document)
    path = tmp_path / "gate.json"
    path.write_text(json.dumps(document))
    with pytest.raises(SchemaError) as err:
        GateDecision.read(path)
    assert str(path) in str(err.value) and field in str(err.value) and "compatflow gate" in str(err.value)


def test_a_truncated_gate_decision_is_refused(tmp_path):
    from components.gate import GateDecision

    path = tmp_path / "gate.json"
    path.write_text('{"decision": "pa')
    with pytest.raises(SchemaError, match="not valid JSON"):
        GateDecision.read(path)
