"""The typed documents whose JSON schemas (``schemas/<name>.schema.json``) are generated from their models:
``make schemas`` (``python -m pipelines.documents``) writes them; a unit test holds the committed files equal
to what the models generate, so a model and its schema never drift apart."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from schemas import SCHEMA_DIR

# schema name -> "module:Model", the model that owns the document.
DOCUMENTS = {
    "gate_decision": "components.gate.decision:GateDecision",
    "rollout_state": "components.state.rollout_document:RolloutState",
}


def model_of(name: str) -> Any:
    module, _, attribute = DOCUMENTS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def generated_schema(name: str) -> dict[str, Any]:
    """The JSON schema of document ``name``, generated from its model (draft 2020-12)."""
    model = model_of(name)
    schema = model.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://compatflow.dev/schemas/{name}.schema.json",
        "$comment": f"Generated from {DOCUMENTS[name]} by `make schemas`: edit the model, not this file.",
        **schema,
    }


def schema_text(name: str) -> str:
    return json.dumps(generated_schema(name), indent=2) + "\n"


def write_schemas() -> list[Path]:
    """Write every generated schema into ``schemas/``; returns the files written."""
    written = []
    for name in DOCUMENTS:
        path = SCHEMA_DIR / f"{name}.schema.json"
        path.write_text(schema_text(name))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_schemas():
        print(path)
