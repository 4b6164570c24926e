"""Captions of gallery items, read from the gallery shards their rows point to (``source_uri =
"<shard url>#<key>"``), one shard at a time into a bounded LRU cache; an unreadable shard gives ``None``
captions, never a failed query. An uncached shard costs a read of the whole shard (~110 ms for 1,000
pictures, benchmarks/results/lineage.md); a ``fallback`` (:func:`lineage_captions`, ~5 ms) answers such
misses while their shards load in the background."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from components.state.workspace import resolved_path

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


# Captions of item keys from elsewhere than their shard: {key: caption or None}.
Fallback = Callable[[Sequence[str]], Mapping[str, str | None]]


MAX_SHARDS = 64  # shards whose captions are cached


class ShardCaptions:
    """Captions by ``source_uri``, with the captions of up to :data:`MAX_SHARDS` shards cached (thread-safe);
    with a ``fallback``, a hit whose shard is not cached is answered by it while the shard loads in the
    background (see the module docstring). A relative shard path lies under ``root`` (the workspace)."""

    def __init__(self, fallback: Fallback | None = None, root: str | os.PathLike[str] | None = None) -> None:
        self.fallback, self.root = fallback, root
        self._cache: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._idle = threading.Condition(threading.Lock())  # guards the background loader and its queue
        self._queued: set[str] = set()
        self._loader: threading.Thread | None = None
        self.failures = 0
        self.from_fallback = 0  # captions the fallback answered (a shard was not cached yet)

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
                captions = shard_captions(resolved_path(self.root, url) if self.root else url)
            except Exception as exc:  # noqa: BLE001 - a missing shard costs captions, not the query
                log.warning("captions of %s unavailable: %s", url, exc)
                with self._lock:
                    self.failures += 1
                captions = {}
            with self._lock:
                self._cache[url] = captions
                while len(self._cache) > MAX_SHARDS:
                    self._cache.popitem(last=False)
                self._loading.pop(url, None)
            return captions

    def lookup(self, source_uris: Sequence[str | None]) -> list[str | None]:
        """The caption of each ``<shard url>#<key>`` (None: the row names no shard, or the key is absent)."""
        parts = [str(uri or "").rpartition("#") for uri in source_uris]
        named = [(url, key) for url, sep, key in parts if sep and url]
        with self._lock:
            uncached = [(url, key) for url, key in named if url not in self._cache]
        answered = self._from_fallback(uncached)
        out = [
            (answered[(url, key)] if (url, key) in answered else self._shard(url).get(key))
            if sep and url
            else None
            for url, sep, key in parts
        ]
        self._load_in_background({url for url, _ in answered})  # after the answer: the request waits for none
        return out

    def _from_fallback(self, missing: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        """The fallback's captions of ``missing`` (url, key) pairs; {} without a fallback or when it fails
        (the shards are then read in the request, as without one)."""
        if not missing or self.fallback is None:
            return {}
        try:
            found = self.fallback(sorted({key for _, key in missing}))
        except Exception as exc:  # noqa: BLE001 - the shards answer instead
            log.warning("caption fallback failed, reading the shards: %s", exc)
            return {}
        with self._lock:
            self.from_fallback += len(missing)
        return {(url, key): found.get(key) for url, key in missing}

    def _load_in_background(self, urls: set[str]) -> None:
        """Read ``urls`` into the cache in one background thread (one, so a request in flight competes with a
        single reader for the interpreter, not one per shard)."""
        if not urls:
            return
        with self._idle:
            self._queued |= urls
            if self._loader is not None:
                return
            self._loader = threading.Thread(target=self._load_queued, name="caption-loader", daemon=True)
            self._loader.start()

    def _load_queued(self) -> None:
        while True:
            with self._idle:
                if not self._queued:
                    self._loader = None
                    self._idle.notify_all()
                    return
                url = self._queued.pop()
            self._shard(url)

    def wait_for_loads(self, timeout: float | None = None) -> bool:
        """Wait until the shards queued for a background read are cached; False when ``timeout`` ran out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._loader is None, timeout)


def lineage_captions(repo_dir: str) -> Fallback:
    """A :class:`ShardCaptions` fallback reading captions from the lineage store's online features (one
    ``get_online_features`` per request's misses; calls serialised, the online store being one connection)."""
    from components.adapters.lineage import LineageStore

    store, lock = LineageStore(repo_dir), threading.Lock()

    def captions(keys: Sequence[str]) -> dict[str, str | None]:
        with lock:
            return {row["item_id"]: row.get("caption") for row in store.get_items(keys)}

    return captions
