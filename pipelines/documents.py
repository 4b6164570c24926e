"""The typed documents whose JSON schemas (``schemas/<name>.schema.json``) are generated from their models:
``make schemas`` (``python -m pipelines.documents``) writes them; a unit test holds the committed files equal
to what the models generate, so a model and its schema never drift apart."""

from __future__ import annotations

import importlib
import json

from schemas import SCHEMA_DIR

# schema name -> "module:Model", the model that owns the document.
DOCUMENTS = {
    "pipeline_config": "components.deployment:Deployment",
    "workspace_state": "components.runs:PhaseRecord",
    "run_plan": "components.runs:RunPlan",
    "run_outcome": "components.runs:RunOutcome",
    "run_failure": "components.runs:RunFailure",
    "run_blocked": "components.runs:RunBlock",
    "gate_decision": "components.gate.decision:GateDecision",
    "gate_policy": "components.gate.policy:GatePolicy",
    "rollout_state": "components.state.rollout_document:RolloutState",
    "serving_record": "components.serving.record:ServingRecord",
    "validation_policy": "components.data.validation.policy:ValidationPolicy",
}


def schema_text(name: str) -> str:
    """The JSON schema of document ``name``, generated from its model (draft 2020-12), as committed."""
    module, _, model = DOCUMENTS[name].partition(":")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://compatflow.dev/schemas/{name}.schema.json",
        "$comment": f"Generated from {DOCUMENTS[name]} by `make schemas`: edit the model, not this file.",
        **getattr(importlib.import_module(module), model).model_json_schema(),
    }
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":  # ``make schemas``: every generated schema written into ``schemas/``
    for name in DOCUMENTS:
        path = SCHEMA_DIR / f"{name}.schema.json"
        path.write_text(schema_text(name))
        print(path)
