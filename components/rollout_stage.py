"""Pipeline entry points of the gallery: index a gallery (first run) and roll a gate-passed model out.

Plain functions on a workspace (``components.workspace.Workspace``), called by the KFP components and
by ``compatflow rollout``. Encoders come from a factory named ``module:function`` (default: real models,
:func:`components.rollout_encoders.model_encoders`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components.index import DEFAULT_ALIAS, GalleryIndex
from components.rollout import (
    DEFAULT_FRACTIONS,
    ProbeSet,
    RolloutConfig,
    RolloutPaths,
    index_gallery,
    run_rollout,
)
from components.search import DEFAULT_FACTORY, import_factory, read_serving

DEFAULT_ENCODERS = "components.rollout_encoders:model_encoders"
PROBE_FILE = "probe.json"


def probe_path(paths: RolloutPaths) -> Path:
    """Where :func:`index_stage` writes the probe set: ``<workspace>/rollout/probe.json``."""
    return paths.state.parent / "rollout" / PROBE_FILE


def open_index(workspace: Any = None, uri: str | None = None) -> GalleryIndex:
    """A workspace's gallery index: ``uri``, the serving record's, or ``<workspace>/milvus/gallery.db``."""
    from components.workspace import Workspace

    paths = RolloutPaths.for_workspace(workspace)
    record = read_serving(paths.serving)
    uri = uri or (record["uri"] if record else str(Workspace.coerce(workspace).milvus_dir / "gallery.db"))
    return GalleryIndex(uri, alias=record["alias"] if record else DEFAULT_ALIAS)


def index_stage(
    workspace: Any,
    model: str | Path,
    version: str,
    space: str,
    gallery: str | Sequence[str],
    *,
    probe_size: int = 500,
    seed: int = 0,
    uri: str | None = None,
) -> dict[str, Any]:
    """Embed the gallery shards with ``model``, index them behind the serving alias and write the probe set
    (``probe_size`` items, the first caption of each as its query). Idempotent; returns the serving record."""
    import numpy as np

    from compat.data.loader import expand_urls, load_captioned_set
    from compat.io import write_json_atomic
    from components.search import load_model

    paths = RolloutPaths.for_workspace(workspace)
    encoder = load_model(str(model))
    ids: list[str] = []
    uris: list[str] = []
    phases: list[int] = []
    texts: list[str] = []
    vectors = []
    for url in expand_urls(gallery):
        items = load_captioned_set(url)
        ids += items.keys
        uris += [f"{url}#{k}" for k in items.keys]
        phases += [int(m.get("phase", 0)) for m in items.metas]
        texts += [c[0] for c in items.captions]
        vectors.append(encoder.encode_images(items.images).numpy())
    if not ids:
        raise ValueError(f"gallery {gallery!r} holds no samples")
    with open_index(workspace, uri) as index:
        record = index_gallery(
            index,
            paths,
            ids,
            np.concatenate(vectors),
            version=version,
            space=space,
            query_model={"uri": str(model), "factory": DEFAULT_FACTORY},
            phase=phases,
            source_uris=uris,
        )
    pick = np.random.default_rng(seed).permutation(len(ids))[:probe_size]
    write_json_atomic(
        probe_path(paths), {"texts": [texts[i] for i in pick], "positives": [[ids[i]] for i in pick]}
    )
    return {**record, "n_items": len(ids), "probe": str(probe_path(paths))}


def rollout_stage(
    workspace: Any,
    new_version: str,
    *,
    new_model: str = "",
    old_model: str = "",
    probe: str | Path | None = None,
    policy: str = "random",
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
    batch_size: int = 256,
    space: str | None = None,
    floors: Mapping[str, float] | None = None,
    encoders: str = DEFAULT_ENCODERS,
    query_factory: str = DEFAULT_FACTORY,
    options: Mapping[str, Any] | None = None,
    uri: str | None = None,
) -> dict[str, Any]:
    """Roll ``new_version`` out (plan, or resume after a crash) and return the final rollout state.

    ``old_model`` defaults to the serving record's query model; ``probe`` to the probe set written by
    :func:`index_stage`; ``options`` go to the encoder factory and into the recorded query model.
    """
    paths = RolloutPaths.for_workspace(workspace)
    options = dict(options or {})
    record = read_serving(paths.serving)
    old = old_model or (record["query_model"].get("uri", "") if record else "")
    built = import_factory(encoders)({"old_model": old, "new_model": new_model, "options": options})
    config = RolloutConfig(
        new_version=new_version,
        policy=policy,
        fractions=tuple(fractions),
        seed=seed,
        batch_size=batch_size,
        space=space,
        floors=dict(floors or {}),
        query_model={"uri": new_model, "factory": query_factory, "options": options, "side": "new"},
    )
    probe_set = ProbeSet.from_file(probe or probe_path(paths))
    with open_index(workspace, uri) as index:
        return run_rollout(index, paths, config, built, probe_set)
