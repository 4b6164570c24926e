"""The serving record: which collection and query model answer queries, and the code it names.

It is written before the alias moves, so when they disagree the record's collection is searched. Query
encoders are built by a ``module:function`` factory imported only from the project's packages or
``$COMPATFLOW_TRUSTED_MODULES``, since the record names code to run."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compat.io import read_json, utc_now, write_json_atomic
from components.state.workspace import map_paths, resolved_path, stored_path

SERVING_PATHS = ("uri", "query_model.uri", "previous.query_model.uri")  # stored relative to the workspace
DEFAULT_FACTORY = "components.serving.record:model_query_encoder"
RENAMED_FACTORIES = {  # named by older records
    "components.search:model_query_encoder": DEFAULT_FACTORY,
    "components.rollout.serving:model_query_encoder": DEFAULT_FACTORY,
}
QueryEncoder = Callable[[list[str]], np.ndarray]  # texts -> (n, dim) query vectors
TRUSTED_ENV = "COMPATFLOW_TRUSTED_MODULES"
TRUSTED_PREFIXES = ("compat.", "components.")


class ServingError(RuntimeError):
    """The serving record is missing or malformed, or names an encoder that cannot be built."""


def read_serving(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The serving record at ``path``; None when there is none yet; ServingError when it is malformed."""
    path = Path(path)
    doc = read_json(path, lambda why: ServingError(f"{why}; restore it from the rollout state or re-index"))
    if doc is None:
        return None
    missing = [k for k in ("uri", "alias", "collection", "query_model") if k not in doc]
    if not isinstance(doc, dict) or missing:
        raise ServingError(f"{path}: missing field(s) {missing} of a serving record")
    if not isinstance(doc["query_model"], dict) or "version" not in doc["query_model"]:
        raise ServingError(f"{path}: field 'query_model' must be an object with a 'version'")
    root = Path(path).resolve().parent
    return map_paths(doc, SERVING_PATHS, lambda value: resolved_path(root, value))


def same_index(a: str, b: str) -> bool:
    """Whether two index URIs name one index (local paths by their real path, URIs as written)."""
    if "://" not in a and "://" not in b:
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def check_index_agrees(configured: str | None, record: Mapping[str, Any] | None, record_path: Any) -> None:
    """Refuse a configured index URI (``index.uri``, ``$COMPATFLOW_MILVUS_URI``) other than the one the
    serving record says the gallery is served from: reading or writing the configured one would serve, roll
    out and record lineage against another gallery than the served one."""
    if configured is None or record is None or same_index(configured, record["uri"]):
        return
    raise ServingError(
        f"index.uri is {configured} but this workspace's gallery is served from {record['uri']} (serving "
        f"record {record_path}): set index.uri to {record['uri']} (or leave it unset) to go on serving this "
        "gallery; editing the config does not move a gallery to another index"
    )


def write_serving(
    path: str | os.PathLike[str],
    *,
    uri: str,
    alias: str,
    collection: str,
    space: str,
    dim: int,
    query_model: Mapping[str, Any],
    previous: Mapping[str, Any] | None = None,
    rollout_id: str = "",
    layers: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Write the serving record atomically; returns it. ``layers`` (``[(collection, filter), ...]``, newest
    first): while a rollout moves the gallery into ``collection``, what each collection serves
    (:meth:`components.adapters.index.GalleryIndex.search`)."""
    doc = {
        "schema_version": 1,
        "uri": str(uri),
        "alias": alias,
        "collection": collection,
        "space": str(space),
        "dim": int(dim),
        "query_model": dict(query_model),
        "previous": dict(previous) if previous else None,
        "rollout_id": rollout_id,
        "layers": [[str(name), str(flt)] for name, flt in layers] if layers else None,
        "updated_at": utc_now(),
    }
    root = Path(path).resolve().parent  # the record lives in the workspace root
    write_json_atomic(Path(path), map_paths(doc, SERVING_PATHS, lambda value: stored_path(root, value)))
    return doc


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
