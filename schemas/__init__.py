"""JSON schemas of every file compatflow reads or writes, and the expectation suites.

A document the code works with as a model has its schema generated from it (``make schemas``,
:data:`pipelines.documents.DOCUMENTS`); each hand-written one is its document's one owner: step reports
built as plain data and checked against their schema (drift, validation, compat report), and formats that
other tools write too (sample metadata, model configs, stream manifests)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(__file__).resolve().parent


class SchemaError(ValueError):
    """A document does not match its schema; the message names the file and the field."""


@cache
def load_schema(name: str) -> dict[str, Any]:
    """Load ``schemas/<name>.schema.json`` (``name`` like ``"validation"``)."""
    path = SCHEMA_DIR / f"{name}.schema.json"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".schema.json") for p in SCHEMA_DIR.glob("*.schema.json"))
        raise FileNotFoundError(f"no schema named {name!r} in {SCHEMA_DIR}; known: {', '.join(known)}")
    return json.loads(path.read_text())


def schema_errors(document: Any, name: str) -> list[str]:
    """Every violation of schema ``name`` in ``document``, as ``"field.path: message"`` lines."""
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(load_schema(name))
    validator = validator_cls(load_schema(name), format_checker=validator_cls.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def validate(document: Any, name: str, source: str = "<document>") -> None:
    """Raise :class:`SchemaError` naming ``source`` and each bad field when ``document`` breaks ``name``."""
    errors = schema_errors(document, name)
    if errors:
        raise SchemaError(f"{source} does not match schemas/{name}.schema.json:\n  " + "\n  ".join(errors))
