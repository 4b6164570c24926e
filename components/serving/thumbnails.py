"""Thumbnails of gallery items (``"thumbnails": true``): as for captions, the image member of ``<key>`` in
the shard a hit's ``source_uri`` names, decoded through the one bounded path and cached as a JPEG data URI;
an unreadable picture gives ``None``, never a failed query."""

from __future__ import annotations

import base64
import io
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from components.state.workspace import resolved_path

log = logging.getLogger(__name__)

THUMBNAIL_SIDE = 96  # pixels on the longer side
THUMBNAIL_QUALITY = 85  # JPEG quality: about 3 KB a thumbnail


def thumbnail_uri(data: bytes, side: int = THUMBNAIL_SIDE) -> str:
    """``data`` (an encoded picture) as a JPEG data URI at most ``side`` pixels on its longer side, decoded
    through the bounded path. Raises :class:`compat.data.images.ImageDecodeError` (a ``ValueError``)."""
    from compat.data.images import MAX_PIXELS, decode_rgb, read_header

    header = read_header(data, max_pixels=MAX_PIXELS)
    short, long = sorted((header.width, header.height))
    image = decode_rgb(data, size=max(1, math.ceil(side * short / long)), max_pixels=MAX_PIXELS)
    if max(image.size) > side:  # rounding of the short side's scaling
        image.thumbnail((side, side))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=THUMBNAIL_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def shard_thumbnails(url: str, keys: Iterable[str], side: int = THUMBNAIL_SIDE) -> dict[str, str | None]:
    """``{key: data URI or None}`` for ``keys`` of shard ``url``, one pass stopped once all are found."""
    from compat.data.loader import IMAGE_EXTS
    from compat.data.shards import iter_raw_samples

    out: dict[str, str | None] = dict.fromkeys(keys)
    left = set(out)
    for raw in iter_raw_samples(url):
        if raw.key not in left:
            continue
        left.discard(raw.key)
        data = next((raw.members[e] for e in IMAGE_EXTS if isinstance(raw.members.get(e), bytes)), None)
        if data is not None:
            try:
                out[raw.key] = thumbnail_uri(data, side)
            except ValueError as exc:  # ImageDecodeError, ImageTooLargeError: no thumbnail for this hit
                log.warning("no thumbnail for %s#%s: %s", url, raw.key, exc)
        if not left:
            break
    return out


class ShardThumbnails:
    """Thumbnails by ``source_uri``, up to ``max_items`` cached (thread-safe); shards relative to ``root``."""

    def __init__(
        self, side: int = THUMBNAIL_SIDE, max_items: int = 4096, root: str | os.PathLike[str] | None = None
    ) -> None:
        if side < 8:
            raise ValueError(f"side must be at least 8 pixels, got {side}")
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.side, self.max_items, self.root = side, max_items, root
        self._cache: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self.failures = 0

    def lookup(self, source_uris: Sequence[str | None]) -> list[str | None]:
        """The thumbnail of each ``<shard url>#<key>`` (None: no shard named, key absent, or unreadable)."""
        found: dict[str, str | None] = {}
        missing: dict[str, set[str]] = {}
        with self._lock:
            for uri in source_uris:
                text = str(uri or "")
                url, sep, key = text.rpartition("#")
                if not (sep and url and key) or text in found:
                    continue
                if text in self._cache:
                    self._cache.move_to_end(text)
                    found[text] = self._cache[text]
                else:
                    missing.setdefault(url, set()).add(key)
        for url, keys in missing.items():
            try:
                shard = resolved_path(self.root, url) if self.root else url
                read = shard_thumbnails(shard, keys, self.side)
            except Exception as exc:  # noqa: BLE001 - a missing shard costs thumbnails, not the query
                log.warning("thumbnails of %s unavailable: %s", url, exc)
                with self._lock:
                    self.failures += 1
                continue  # None, not cached: the shard may come back
            with self._lock:
                for key, uri_data in read.items():
                    uri = f"{url}#{key}"
                    found[uri] = self._cache[uri] = uri_data
                while len(self._cache) > self.max_items:
                    self._cache.popitem(last=False)
        return [found.get(str(uri or "")) for uri in source_uris]
