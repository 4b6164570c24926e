"""A bounded in-memory cache of decoded shards, so that training epochs after the first decode nothing.

A :class:`SampleCache` holds the decoded samples of whole local shards, keyed by the SHA-256 of the shard's
bytes (computed once per path, size and mtime) with the decode settings: a shard rewritten in place is
decoded again. Shards past ``max_bytes`` are evicted oldest first; one larger than the budget is not kept.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from compat.data.shards import is_local, local_path

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: ~70,000 samples decoded at 64 px, ~6,000 at 224 px
_SAMPLE_OVERHEAD = 1024  # bytes per sample besides its pixels (objects, caption, metadata)


def sample_bytes(sample: Any) -> int:
    """An estimate of the memory one decoded sample holds (its RGB pixels plus a fixed overhead)."""
    image = sample.image
    text = sum(len(c) for c in sample.captions)
    return image.width * image.height * len(image.getbands()) + text + _SAMPLE_OVERHEAD


class SampleCache:
    """Decoded samples of whole local shards, at most ``max_bytes`` (estimated) in all; see the module doc."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"a sample cache needs max_bytes >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = self.hits = self.misses = 0
        self._shards: OrderedDict[Hashable, tuple[list[Any], int]] = OrderedDict()
        self._digests: dict[tuple[str, int, int], str] = {}

    def key(self, url: str, settings: Sequence[Any]) -> Hashable | None:
        """The cache key of shard ``url`` decoded with ``settings`` (None: not cacheable, e.g. remote)."""
        if self.max_bytes == 0 or not is_local(url):
            return None
        path = local_path(url)
        try:
            st = os.stat(path)
        except OSError:
            return None
        identity = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        digest = self._digests.get(identity)
        if digest is None:
            with open(path, "rb") as f:
                digest = self._digests[identity] = hashlib.file_digest(f, "sha256").hexdigest()
        return (digest, *settings)

    def get(self, key: Hashable | None) -> list[Any] | None:
        """The decoded samples of a shard, in shard order, or None when not held."""
        if key is None or key not in self._shards:
            self.misses += key is not None
            return None
        self._shards.move_to_end(key)
        self.hits += 1
        return self._shards[key][0]

    def put(self, key: Hashable | None, samples: list[Any]) -> bool:
        """Keep a whole shard's decoded samples, evicting the oldest shards; False when it does not fit."""
        if key is None:
            return False
        size = sum(sample_bytes(s) for s in samples)
        if size > self.max_bytes:
            return False
        if key in self._shards:
            self.bytes -= self._shards.pop(key)[1]
        while self._shards and self.bytes + size > self.max_bytes:
            self.bytes -= self._shards.popitem(last=False)[1][1]
        self._shards[key] = (samples, size)
        self.bytes += size
        return True

    def __len__(self) -> int:
        return len(self._shards)
