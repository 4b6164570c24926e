"""Answering queries as the serving record says: a long-lived :class:`Searcher` that follows rollouts
live, and a one-shot :func:`search`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from components.serving.limits import check_search
from components.serving.pair import PairFollower
from components.serving.record import QueryEncoder, ServingError


class Searcher(PairFollower):
    """A long-lived query server: keeps the index connection and the query encoder, and swaps both when the
    serving record changes (a rollout's query switch or a rollback takes effect live)."""

    _captions: Any = None
    _thumbnails: Any = None

    def search(
        self,
        texts: Sequence[str],
        k: int = 10,
        *,
        filter: str | None = None,
        captions: bool = False,
        thumbnails: bool = False,
    ) -> list[list[dict[str, Any]]]:
        """Hits per text: ``item_id``, ``score``, ``model_version``; ``caption``, ``thumbnail`` if asked."""
        if isinstance(texts, str):
            raise TypeError("search expects a list of texts, got a single string")
        empty = [i for i, text in enumerate(texts) if not str(text).strip()]
        if empty or not texts:
            raise ServingError(
                f"empty query text (position {empty[:5] or 'none given'}): give words to search for"
            )
        check_search(texts, k)  # k, number and length of queries: the service's bounds
        fields = ("source_uri",) if captions or thumbnails else ()
        texts = list(texts)
        hits, _ = self.answer(lambda p: p.search(texts, k, filter=filter, output_fields=fields))
        rows = [[h.to_dict() for h in row] for row in hits]
        uris = [h.fields.get("source_uri") for row in hits for h in row]
        if captions:
            from components.serving.captions import ShardCaptions

            self._captions = self._captions or ShardCaptions(root=self.record_path.parent)
            _fill(rows, "caption", self._captions.lookup(uris))
        if thumbnails:
            from components.serving.thumbnails import ShardThumbnails

            self._thumbnails = self._thumbnails or ShardThumbnails(root=self.record_path.parent)
            _fill(rows, "thumbnail", self._thumbnails.lookup(uris))
        return rows


def _fill(rows: list[list[dict[str, Any]]], key: str, values: Sequence[Any]) -> None:
    found = iter(values)
    for row in rows:
        for hit in row:
            hit[key] = next(found)


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
    captions: bool = False,
    thumbnails: bool = False,
    verify: Callable[[Mapping[str, Any]], None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Hits per text (see :meth:`Searcher.search`) from a one-off :class:`Searcher` of the serving record
    (by default the workspace's); ``uri``, ``index``, ``encoder`` and ``verify`` as for
    :class:`~components.serving.pair.PairFollower`."""
    from components.state.workspace import Workspace

    path = Path(record_path) if record_path is not None else Workspace.coerce(workspace).serving_path
    searcher = Searcher(path, uri=uri, index=index, encoder=encoder, verify=verify)
    try:
        return searcher.search(texts, k, filter=filter, captions=captions, thumbnails=thumbnails)
    finally:
        searcher.close()
