"""The serving record: which collection and query model answer queries, and the code it names.

It is written before the alias moves, so when they disagree the record's collection is searched. Query
encoders are built by a ``module:function`` factory imported only from the project's packages or
``$COMPATFLOW_TRUSTED_MODULES``, since the record names code to run."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from compat.io import read_json, utc_now, write_json_atomic
from components.state.documents import validated
from components.state.rollout_document import ModelRef
from components.state.workspace import map_paths, resolved_path, stored_path
from schemas import SchemaError

SERVING_PATHS = ("uri", "query_model.uri", "previous.query_model.uri")  # stored relative to the workspace
DEFAULT_FACTORY = "components.serving.record:model_query_encoder"
RENAMED_FACTORIES = {  # named by older records
    "components.search:model_query_encoder": DEFAULT_FACTORY,
    "components.rollout.serving:model_query_encoder": DEFAULT_FACTORY,
}
QueryEncoder = Callable[[list[str]], np.ndarray]  # texts -> (n, dim) query vectors
TRUSTED_ENV = "COMPATFLOW_TRUSTED_MODULES"
TRUSTED_PREFIXES = ("compat.", "components.")
REMEDY = "restore it from the rollout state or re-index"


class ServingError(RuntimeError):
    """The serving record is missing or malformed, or names an encoder that cannot be built."""


class PreviousServing(BaseModel):
    """What served before the last rollout: the rollback target."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    collection: str
    space: str
    query_model: ModelRef


class ServingRecord(BaseModel):
    """``serving.json`` (its schema: ``make schemas``): which collection and query model answer queries;
    ``layers``: while a rollout moves the gallery into ``collection``, what each collection serves."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="Serving record")
    schema_version: Literal[1]
    uri: str = Field(description="The index the gallery is served from.")
    alias: str
    collection: str = Field(description="The collection searched, whatever the alias says.")
    space: str
    dim: int = Field(ge=1)
    query_model: ModelRef
    previous: PreviousServing | None = None
    rollout_id: str = ""
    layers: list[tuple[str, str]] | None = Field(None, description="(collection, filter), newest first")
    updated_at: str | None = None

    def collections(self) -> list[str]:
        """The collections queries read: the layers' while a rollout moves the gallery, else the one."""
        return [name for name, _ in self.layers or [(self.collection, "")]]


def read_serving(path: str | os.PathLike[str]) -> ServingRecord | None:
    """The serving record at ``path``; None when there is none yet; ServingError when it is malformed."""
    doc = read_json(path, lambda why: ServingError(f"{why}; {REMEDY}"))
    if doc is None:
        return None
    doc = map_paths(doc, SERVING_PATHS, lambda value: resolved_path(Path(path).resolve().parent, value))
    try:
        return validated(ServingRecord, doc, str(path), REMEDY)
    except SchemaError as err:
        raise ServingError(str(err)) from None


def same_index(a: str, b: str) -> bool:
    """Whether two index URIs name one index (local paths by their real path, URIs as written)."""
    if "://" not in a and "://" not in b:
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def check_index_agrees(configured: str | None, record: ServingRecord | None, record_path: Any) -> None:
    """Refuse a configured index URI (``index.uri``, ``$COMPATFLOW_MILVUS_URI``) other than the one the
    serving record says the gallery is served from: reading or writing the configured one would serve, roll
    out and record lineage against another gallery than the served one."""
    if configured is None or record is None or same_index(configured, record.uri):
        return
    raise ServingError(
        f"index.uri is {configured} but this workspace's gallery is served from {record.uri} (serving "
        f"record {record_path}): set index.uri to {record.uri} (or leave it unset) to go on serving this "
        "gallery; editing the config does not move a gallery to another index"
    )


def write_serving(path: str | os.PathLike[str], **fields: Any) -> ServingRecord:
    """Build the serving record from ``fields`` (:class:`ServingRecord`'s) and write it atomically, the paths
    it names relative to the workspace root it lives in; returns it."""
    record = ServingRecord(**{**fields, "schema_version": 1, "updated_at": utc_now()})
    root, doc = Path(path).resolve().parent, record.model_dump(mode="json", exclude_unset=True)  # as given
    write_json_atomic(Path(path), map_paths(doc, SERVING_PATHS, lambda value: stored_path(root, value)))
    return record


def import_factory(spec: str) -> Callable[..., Any]:
    """The callable named ``module:function``, imported from a trusted module only (see the module doc)."""
    module_name, _, function = RENAMED_FACTORIES.get(spec, spec).partition(":")
    if not module_name or not function:
        raise ServingError(f"encoder factory {spec!r} must look like 'package.module:function'")
    trusted = [m.strip() for m in os.environ.get(TRUSTED_ENV, "").split(",") if m.strip()]
    if not (module_name.startswith(TRUSTED_PREFIXES) or module_name in trusted):
        raise ServingError(
            f"encoder factory module {module_name!r} is not trusted: use one under "
            f"{', '.join(TRUSTED_PREFIXES)} or list it in ${TRUSTED_ENV}"
        )
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise ServingError(f"cannot import encoder factory {spec!r}: {exc}") from exc
    if not callable(factory):
        raise ServingError(f"encoder factory {spec!r} is not callable")
    return factory


def load_query_encoder(query_model: Mapping[str, Any]) -> QueryEncoder:
    """Build the query encoder a ``query_model`` mapping describes (its ``factory`` or the default)."""
    return import_factory(str(query_model.get("factory") or DEFAULT_FACTORY))(query_model)


def model_query_encoder(query_model: Mapping[str, Any]) -> QueryEncoder:
    """Text encoder of the model at ``query_model["uri"]``, in its serving space (numpy float32): its text
    tower alone, in numpy, where :mod:`compat.models.text_tower` restates it (no torch imported), else the
    full model."""
    from compat.models.text_tower import load_text_tower

    if not query_model.get("uri"):
        raise ServingError("the query model has no 'uri' (a model or checkpoint directory) to load")
    tower = load_text_tower(str(query_model["uri"]))
    if tower is not None:
        return tower.encode_texts
    from compat.production import load_encoder

    model = load_encoder(str(query_model["uri"]))

    def encode(texts: list[str]) -> np.ndarray:
        return model.encode_texts(list(texts)).numpy().astype(np.float32)

    return encode
