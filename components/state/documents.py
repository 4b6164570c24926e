"""Typed documents: a saved JSON file read back as its pydantic model, or refused with the file, each bad
field and what to do. The models live with their owners (the gate's decision with the gate); their JSON
schemas in ``schemas/`` are generated from them (``make schemas``, :mod:`pipelines.documents`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from compat.io import read_json

Document = TypeVar("Document", bound=BaseModel)


def read_document(model: type[Document], path: str | Path, remedy: str) -> Document:
    """The document at ``path`` as ``model``; a missing, unreadable, non-JSON or non-matching file raises
    :class:`schemas.SchemaError` naming the file, each bad field and ``remedy`` (what to do)."""
    from schemas import SchemaError

    document = read_json(path, lambda why: SchemaError(f"{why}; {remedy}"))
    if document is None:
        raise SchemaError(f"{path}: no such file; {remedy}")
    return validated(model, document, str(path), remedy)


def validated(model: type[Document], document: Any, source: str, remedy: str = "") -> Document:
    """``document`` as ``model``, or :class:`schemas.SchemaError` naming ``source``, each bad field and
    ``remedy``."""
    from schemas import SchemaError

    try:
        return model.model_validate(document)
    except ValidationError as err:
        # each violation as ``field.path: message`` (``<root>`` for the whole document)
        problems = "\n  ".join(
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in err.errors()
        )
        raise SchemaError(
            f"{source} is not a valid {model.__name__}:\n  {problems}\n{remedy}".rstrip()
        ) from None
