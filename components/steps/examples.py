"""Retrieval examples for the on-call report: a few captions of the phase's newest gallery items searched
as the gallery is now served, each hit with its caption and thumbnail (a person checks a retrieval by
looking). Written by the steps that change what is served (the first model's indexing, a rollout) to
``<run_dir>/rollout/examples.json``; best effort: examples that cannot be made leave a reason, never a failed
step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from compat.io import write_json_atomic
from components.state.run_dir import RunDir
from components.state.workspace import Workspace

log = logging.getLogger(__name__)

QUERIES = 3
HITS = 3


def example_queries(gallery_shards: list[str], n: int = QUERIES) -> list[str]:
    """The captions of the first ``n`` items of the last shard (the newest phase's gallery), read without
    decoding a picture."""
    from components.serving.captions import shard_captions

    for url in reversed(gallery_shards):
        captions = list(shard_captions(url).values())
        if captions:
            return captions[:n]
    return []


def record_examples(workspace: Workspace, run_dir: Path, gallery_shards: list[str]) -> dict[str, Any]:
    """Search :func:`example_queries` through the serving record, ``HITS`` hits each with caption and
    thumbnail, and write them to ``<run_dir>/rollout/examples.json``; returns the document (with ``error``
    instead of ``queries`` when they could not be made)."""
    from components.serving.search import search

    document: dict[str, Any]
    try:
        queries = example_queries(gallery_shards)
        rows = search(queries, HITS, workspace=workspace, captions=True, thumbnails=True) if queries else []
        document = {"queries": [{"text": q, "hits": hits} for q, hits in zip(queries, rows, strict=True)]}
    except Exception as exc:  # noqa: BLE001 - examples are for a person to look at, never a reason to fail
        log.warning("no retrieval examples for the report: %s", exc)
        document = {"error": f"{type(exc).__name__}: {exc}"}
    write_json_atomic(RunDir(run_dir).examples_file, document)  # where the on-call report reads it
    return document
