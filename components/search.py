"""Answering queries as the serving record says (:mod:`components.rollout.serving`): a long-lived
:class:`Searcher` that follows rollouts live, and a one-shot :func:`search`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from components.rollout.serving import ServingError, load_query_encoder, read_serving
from components.rollout.types import QueryEncoder


class Searcher:
    """A long-lived query server: keeps the index connection and the query encoder, and reloads the
    encoder when the serving record changes (a rollout's query switch or a rollback takes effect live)."""

    def __init__(
        self,
        record_path: str | os.PathLike[str],
        *,
        uri: str | None = None,
        index: Any = None,
        encoder: QueryEncoder | None = None,
    ) -> None:
        self.record_path = Path(record_path)
        self.uri = uri
        self._index = index
        self._own_index = index is None
        self._fixed_encoder = encoder
        self._stamp: tuple[int, int] | None = None
        self._record: dict[str, Any] = {}
        self._encoder: QueryEncoder | None = encoder

    def _refresh(self) -> dict[str, Any]:
        missing = ServingError(f"no serving record at {self.record_path}: index the gallery first")
        try:
            st = self.record_path.stat()
        except FileNotFoundError:
            raise missing from None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            record = read_serving(self.record_path)
            if record is None:
                raise missing
            if self._fixed_encoder is None and record["query_model"] != self._record.get("query_model"):
                self._encoder = load_query_encoder(record["query_model"])
            self._record, self._stamp = record, stamp
        if self._index is None:
            from components.index import GalleryIndex

            self._index = GalleryIndex(self.uri or self._record["uri"], self._record["alias"])
        return self._record

    def search(
        self, texts: Sequence[str], k: int = 10, *, filter: str | None = None
    ) -> list[list[dict[str, Any]]]:
        """Hits (``item_id``, ``score``, ``model_version``) per text, through the serving alias."""
        if isinstance(texts, str):
            raise TypeError("search expects a list of texts, got a single string")
        empty = [i for i, text in enumerate(texts) if not str(text).strip()]
        if empty or not texts:
            raise ServingError(
                f"empty query text (position {empty[:5] or 'none given'}): give words to search for"
            )
        record = self._refresh()
        vectors = np.asarray(self._encoder(list(texts)), dtype=np.float32)
        target = self._index.serving_collection()
        collection = record["collection"] if target != record["collection"] else None
        hits = self._index.search(vectors, k=k, filter=filter, collection=collection)
        return [[h.to_dict() for h in row] for row in hits]

    @property
    def query_model(self) -> dict[str, Any]:
        """The serving query model the last search used."""
        return dict(self._record.get("query_model", {}))

    def close(self) -> None:
        if self._own_index and self._index is not None:
            self._index.close()
            self._index = None


def search(
    texts: Sequence[str],
    k: int = 10,
    *,
    workspace: Any = None,
    record_path: str | os.PathLike[str] | None = None,
    uri: str | None = None,
    filter: str | None = None,
    encoder: QueryEncoder | None = None,
    index: Any = None,
) -> list[list[dict[str, Any]]]:
    """Hits (``item_id``, ``score``, ``model_version``) per text, served as the serving record says.

    ``record_path`` defaults to the workspace's ``serving.json``; ``uri`` overrides the record's index URI
    (e.g. a server URI while another process holds the embedded directory); ``encoder`` and ``index``
    replace the record's query model and a freshly opened index. A long-lived server uses :class:`Searcher`.
    """
    from components.workspace import Workspace

    path = Path(record_path) if record_path is not None else Workspace.coerce(workspace).serving_path
    searcher = Searcher(path, uri=uri, index=index, encoder=encoder)
    try:
        return searcher.search(texts, k, filter=filter)
    finally:
        searcher.close()
