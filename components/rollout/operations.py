"""Rollout operations on a workspace: its gallery index, indexing (first and new items), rolling out; called
by the pipeline's gallery steps and by ``compatflow rollout``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from components.adapters.index import GalleryIndex, Owner
from components.deployment import RolloutSection
from components.rollout.engine import run_rollout
from components.rollout.types import ProbeSet, RolloutConfig, RolloutPaths
from components.serving.record import (
    DEFAULT_FACTORY,
    ServingRecord,
    check_index_agrees,
    import_factory,
    read_serving,
    write_serving,
)
from components.state.rollout_document import RolloutState

DEFAULT_ENCODERS = "components.rollout.encoders:model_encoders"


def index_gallery(
    index: GalleryIndex,
    paths: RolloutPaths,
    ids: Sequence[str],
    vectors: np.ndarray,
    *,
    version: str,
    space: str,
    query_model: Mapping[str, Any],
    phase: int | Sequence[int] = 0,
    source_uris: Sequence[str] | None = None,
    embedded_at: int | Sequence[int] | None = None,
    batch_size: int = 1000,
) -> ServingRecord:
    """Index a gallery (first run) into the serving collection, creating it and the alias when missing;
    writes the serving record (``query_model`` answers queries). Idempotent; returns the serving record."""
    from components.rollout.keys import SAMPLE_ROWS, fit_centres, load_centres, save_centres

    v = np.asarray(vectors, dtype=np.float32)
    collection = index.serving_collection() or index.create_collection(space, int(v.shape[1]))
    centres = load_centres(paths.centres(collection))
    if centres is None:  # the first vectors a collection gets: its centres (its rows' order keys)
        centres = fit_centres(v[:SAMPLE_ROWS])
        save_centres(paths.centres(collection), centres)
    index.index_items(
        ids,
        v,
        version,
        space,
        phase=phase,
        source_uris=source_uris,
        embedded_at=embedded_at,
        collection=collection,
        batch_size=batch_size,
        centres=centres,
    )
    index.flush(collection, wait_indexed=True)  # served whole at once
    index.switch_alias(collection)
    return write_serving(
        paths.serving,
        uri=index.uri,
        alias=index.alias,
        collection=collection,
        space=space,
        dim=index.collection_dim(collection),
        query_model={"version": version, **query_model},
    )


def open_index(workspace: Any = None) -> GalleryIndex:
    """A workspace's gallery index, where its serving record says it is, else at the workspace's index URI,
    opened for the workspace's deployment (:func:`deployment_owner`); a configured URI other than the
    record's is refused (:func:`components.serving.record.check_index_agrees`)."""
    from components.state.workspace import Workspace

    ws = Workspace.coerce(workspace)
    record = read_serving(ws.serving_path)
    check_index_agrees(ws.configured_index_uri, record, ws.serving_path)
    uri = record.uri if record else ws.index_uri
    alias = record.alias if record else ws.index_alias
    return GalleryIndex(uri, alias=alias, owner=deployment_owner(ws))


def deployment_owner(workspace: Any = None, *, legacy: bool = True) -> Owner:
    """The deployment a workspace writes into an index for (:class:`components.adapters.index.Owner`); with
    ``legacy``, the collections it names (made before owner marks) count as its own too."""
    from components.state.workspace import Workspace

    ws = Workspace.coerce(workspace)
    named = frozenset(gallery_collections(ws)) if legacy else frozenset()
    return Owner(ws.deployment_id(), str(ws.root), named, moved_from=ws.moved_from)


def gallery_collections(workspace: Any = None) -> list[str]:
    """The collections a workspace's gallery is made of, the served one first: those its serving record and
    its rollout states (live and archived) name. Empty when nothing is served."""
    from components.rollout.state import load_state

    paths = RolloutPaths.for_workspace(workspace)
    record = read_serving(paths.serving)
    if record is None:
        return []
    names = [*record.collections(), record.previous.collection if record.previous else None]
    for path in [paths.state, *paths.archived_states()]:
        state = load_state(path, paths.root)
        if state is not None:
            names += [state.gallery.collection, state.gallery.source_collection]
    return [str(name) for name in dict.fromkeys(names) if name]


def index_new_items(
    workspace: Any,
    model: str | Path,
    version: str,
    space: str,
    gallery: str | Sequence[str],
    *,
    probe_size: int = 500,
    seed: int = 0,
    on_items: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> dict[str, Any]:
    """Index the items of ``gallery`` the serving collection does not hold yet with ``model``, a shard at a
    time (the first call creates the collection in ``space`` and the serving record). Each shard's lineage
    rows go to ``on_items`` before its vectors are written, so no indexed item lacks its lineage; up to
    ``probe_size`` new pictures join the probe set (a seeded reservoir sample). Idempotent. Returns the
    serving record plus ``n_items``, ``n_new`` and ``probe`` (the probe file)."""
    from compat.compat_training import decode_size
    from compat.data.loader import expand_urls, load_captioned_set
    from compat.io import write_json_atomic
    from compat.production import load_encoder
    from components.rollout.keys import load_centres
    from components.state.workspace import stored_path

    paths = RolloutPaths.for_workspace(workspace)
    probe = json.loads(paths.probe.read_text()) if paths.probe.is_file() else {"texts": [], "positives": []}
    sample = _ProbeSample(probe_size, seed, known={p for positives in probe["positives"] for p in positives})
    n_new = 0
    with open_index(workspace) as index:
        record = read_serving(paths.serving)
        # a rollout in progress serves its target over its source: new items go to the target, whichever
        # collection holds an item already counts
        collection = record.collection if record else index.serving_collection()
        held = record.collections() if record else [collection] if collection else []
        encoder = None
        for url in expand_urls(gallery):
            encoder = encoder or load_encoder(model)  # its input size bounds the decoded images
            items = load_captioned_set(url, image_size=decode_size(encoder))
            # which of this shard's items the gallery holds: a read by id, bounded by the shard
            present = set().union(*(index.existing_ids(items.keys, name) for name in held))
            keep = [i for i, key in enumerate(items.keys) if key not in present]
            if not keep:
                continue
            vectors = encoder.encode_images([items.images[i] for i in keep]).numpy()
            space_id = index.collection_space(collection) if collection is not None else space
            rows = _lineage_rows(items, keep, stored_path(paths.root, url), str(version), str(space_id))
            if on_items is not None:
                on_items(rows)
            ids = [row["item_id"] for row in rows]
            columns = {"phase": [r["phase"] for r in rows], "source_uris": [r["image_uri"] for r in rows]}
            if collection is None:
                first = {"uri": str(model), "factory": DEFAULT_FACTORY}
                record = index_gallery(
                    index, paths, ids, vectors, version=version, space=space, query_model=first, **columns
                )
                collection, held = record.collection, record.collections()
            else:
                centres = load_centres(paths.centres(collection))
                index.index_items(
                    ids, vectors, version, space_id, collection=collection, centres=centres, **columns
                )
            sample.offer((items.keys[i], tuple(items.captions[i])) for i in keep)
            n_new += len(rows)
        if collection is None:
            raise ValueError(f"gallery {gallery!r} holds no samples")
        if n_new:
            index.flush(collection)
        n_items = index.count()
    for item_id, captions in sample.picked():
        probe["texts"] += captions
        probe["positives"] += [[item_id] for _ in captions]
    write_json_atomic(paths.probe, probe)
    summary = {"n_items": n_items, "n_new": n_new, "probe": str(paths.probe)}
    return {**record.model_dump(mode="json"), **summary} if record else summary


def _lineage_rows(
    items: Any, keep: list[int], shard: str, version: str, space_id: str
) -> list[dict[str, Any]]:
    """The lineage rows of a shard's new items (positions ``keep``); ``shard`` as the workspace names it (a
    shard inside it relative to it: a copy of the workspace reads its own)."""
    return [
        {
            "item_id": items.keys[i],
            "caption": items.captions[i][0],
            "image_uri": f"{shard}#{items.keys[i]}",
            "phase": int((items.metas[i] or {}).get("phase", 0)),
            "domain": (items.metas[i] or {}).get("domain"),
            "model_version": version,
            "space_id": space_id,
        }
        for i in keep
    ]


class _ProbeSample:
    """A seeded reservoir sample (Algorithm R) of up to ``size`` new pictures (id, captions), skipping those
    ``known`` already: bounded whatever the number of new items."""

    def __init__(self, size: int, seed: int, known: set[str]) -> None:
        self.size, self.known = int(size), known
        self.rng = np.random.default_rng(seed)
        self.kept: list[tuple[str, tuple[str, ...]]] = []
        self.seen = 0

    def offer(self, pictures: Iterable[tuple[str, tuple[str, ...]]]) -> None:
        for picture in pictures:
            if picture[0] in self.known:
                continue
            if len(self.kept) < self.size:
                self.kept.append(picture)
            else:
                j = int(self.rng.integers(0, self.seen + 1))
                if j < self.size:
                    self.kept[j] = picture
            self.seen += 1

    def picked(self) -> list[tuple[str, tuple[str, ...]]]:
        return sorted(self.kept)


def roll_out(
    workspace: Any,
    new_version: str,
    settings: RolloutSection,
    *,
    new_model: str = "",
    old_model: str = "",
    probe: str | Path | None = None,
    seed: int = 0,
    space: str | None = None,
    encoders: str | None = None,
    query_factory: str | None = None,
    options: Mapping[str, Any] | None = None,
    range_tasks: bool = False,
) -> RolloutState:
    """Roll ``new_version`` out (plan, or resume after a crash) and return the final rollout state (with
    ``range_tasks``, the state as it waits for ranges run by pipeline tasks). ``old_model`` defaults to the
    serving record's query model, ``probe`` to the workspace's probe set."""
    paths = RolloutPaths.for_workspace(workspace)
    options = dict(options or {})
    record = read_serving(paths.serving)
    old = old_model or (record.query_model.uri or "" if record else "")
    # root: where gallery rows' relative source URIs lie (components.state.workspace.stored_path)
    args = {"old_model": old, "new_model": new_model, "options": options, "root": str(paths.root)}
    encoders = encoders or DEFAULT_ENCODERS
    built = import_factory(encoders)(args)
    built.recipe = {"factory": encoders, "args": args}
    config = RolloutConfig.from_section(
        settings,
        new_version=new_version,
        seed=seed,
        space=space,
        range_tasks=range_tasks,
        query_model={
            "uri": new_model,
            "factory": query_factory or DEFAULT_FACTORY,
            "options": options,
            "side": "new",
        },
    )
    probe_set = ProbeSet.from_file(probe or paths.probe)
    with open_index(workspace) as index:
        return run_rollout(index, paths, config, built, probe_set)
