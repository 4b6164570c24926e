"""Captions of gallery items, read from the gallery shards their rows point to.

Every gallery row carries ``source_uri = "<shard url>#<key>"`` (written by indexing and kept by every
backfill), so a hit's caption is the ``<key>.txt`` member of that shard (or the ``caption`` of its
``.json``), exactly what the item was indexed from. This is the cheapest reliable source: it needs no
extra service (the Feast online store holds captions only where the lineage step ran, and costs a feature
lookup per query) and no schema change to the index. A shard is read once, captions only (images are not
decoded), and kept in a bounded LRU cache; a shard that cannot be read gives ``None`` captions, never a
failed query.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

log = logging.getLogger(__name__)


def shard_captions(url: str) -> dict[str, str]:
    """``{key: caption}`` of every sample in shard ``url`` (``.txt`` member, else the json ``caption``)."""
    from compat.data.shards import iter_raw_samples

    out: dict[str, str] = {}
    for raw in iter_raw_samples(url):
        text = raw.members.get("txt")
        caption = text.decode("utf-8", "replace").strip() if isinstance(text, bytes) else None
        if not caption and isinstance(raw.members.get("json"), bytes):
            try:
                meta = json.loads(raw.members["json"])
            except ValueError:
                meta = {}
            found = meta.get("caption") if isinstance(meta, dict) else None
            caption = found.strip() if isinstance(found, str) else None
        if caption:
            out[raw.key] = caption
    return out


class ShardCaptions:
    """Captions by ``source_uri``, with the captions of up to ``max_shards`` shards cached (thread-safe)."""

    def __init__(self, max_shards: int = 64) -> None:
        if max_shards < 1:
            raise ValueError(f"max_shards must be >= 1, got {max_shards}")
        self.max_shards = max_shards
        self._cache: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self.failures = 0

    def _shard(self, url: str) -> dict[str, str]:
        with self._lock:
            if url in self._cache:
                self._cache.move_to_end(url)
                return self._cache[url]
            gate = self._loading.setdefault(url, threading.Lock())
        with gate:  # one reader per shard; other shards load meanwhile
            with self._lock:
                if url in self._cache:
                    return self._cache[url]
            try:
                captions = shard_captions(url)
            except Exception as exc:  # noqa: BLE001 - a missing shard costs captions, not the query
                log.warning("captions of %s unavailable: %s", url, exc)
                with self._lock:
                    self.failures += 1
                captions = {}
            with self._lock:
                self._cache[url] = captions
                while len(self._cache) > self.max_shards:
                    self._cache.popitem(last=False)
                self._loading.pop(url, None)
            return captions

    def lookup(self, source_uris: Sequence[str | None]) -> list[str | None]:
        """The caption of each ``<shard url>#<key>`` (None: the row names no shard, or the key is absent)."""
        out: list[str | None] = []
        for uri in source_uris:
            url, sep, key = str(uri or "").rpartition("#")
            out.append(self._shard(url).get(key) if sep and url else None)
        return out
