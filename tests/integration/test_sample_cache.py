"""Training keeps decoded shards in a bounded cache keyed by the shard's digest: epochs after the first decode
nothing, batches are the same as without the cache, and a rewritten shard is decoded again."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from compat.data.cache import SampleCache, sample_bytes
from compat.data.loader import ShardStream, StreamPosition
from compat.data.shards import write_shard
from compat.training.data import ShardBatchSource


def _shard(path: Path, start: int, n: int, side: int = 96) -> Path:
    def members(i: int) -> dict[str, bytes]:
        buffer = io.BytesIO()
        Image.new("RGB", (side, side + 32), (i * 9 % 256, 80, 160)).save(buffer, "JPEG")
        meta = {"key": f"k{i:04d}", "caption": f"sample {i}"}
        return {"jpg": buffer.getvalue(), "txt": f"sample {i}".encode(), "json": json.dumps(meta).encode()}

    write_shard(path, ((f"k{i:04d}", members(i)) for i in range(start, start + n)))
    return path


@pytest.fixture
def shards(tmp_path: Path) -> str:
    for s in range(3):
        _shard(tmp_path / f"{s:05d}.tar", s * 10, 10)
    return str(tmp_path / "*.tar")


def _transform(image: Image.Image) -> torch.Tensor:
    return torch.as_tensor(list(image.resize((32, 32)).getdata()), dtype=torch.float32).T.reshape(3, 32, 32)


def _tokens(texts: list[str]) -> torch.Tensor:
    return torch.tensor([[len(t), sum(map(ord, t)) % 1000] for t in texts])


def test_later_epochs_decode_nothing_and_batches_are_unchanged(shards: str) -> None:
    cached = ShardBatchSource(shards, 6, _transform, _tokens, seed=3, image_size=48)
    plain = ShardBatchSource(shards, 6, _transform, _tokens, seed=3, image_size=48, cache_bytes=0)
    a, b = cached.batches(None), plain.batches(None)
    for _ in range(15):  # three epochs of 30 samples
        x, y = next(a), next(b)
        assert x.keys == y.keys and x.position == y.position and torch.equal(x.images, y.images)
        assert torch.equal(x.texts, y.texts)
    assert cached.cache.misses == 3 and cached.cache.hits >= 6 and len(cached.cache) == 3
    assert plain.cache.hits == plain.cache.misses == 0
    # resuming mid-shard from a cached shard yields what an uninterrupted stream yields
    position = next(a).position
    resumed = next(cached.batches(position))
    assert resumed.keys == next(a).keys


def test_decoding_workers_fill_the_cache_and_change_no_batch(shards: str) -> None:
    """Decoding in 2 worker processes: the same batches and positions as in this process, the shards read in
    the first epoch are kept decoded in this process's cache, and later epochs decode nothing."""
    parallel = ShardBatchSource(shards, 6, _transform, _tokens, seed=3, image_size=48, workers=2)
    serial = ShardBatchSource(shards, 6, _transform, _tokens, seed=3, image_size=48)
    a, b = parallel.batches(None), serial.batches(None)
    for _ in range(15):  # three epochs of 30 samples
        x, y = next(a), next(b)
        assert x.keys == y.keys and x.position == y.position and torch.equal(x.images, y.images)
        assert torch.equal(x.texts, y.texts)
    a.close()
    assert parallel.cache.misses == 3 and parallel.cache.hits >= 6 and len(parallel.cache) == 3
    with pytest.raises(ValueError, match="loader workers must be >= 0"):
        ShardBatchSource(shards, 6, _transform, _tokens, workers=-1)


def test_the_cache_is_bounded_and_keyed_by_the_shard_bytes(tmp_path: Path) -> None:
    shard = _shard(tmp_path / "00000.tar", 0, 10)
    first = list(ShardStream(str(shard), shuffle_shards=False, image_size=48))
    one_shard = sum(sample_bytes(s) for s in first)
    assert min(first[0].image.size) == 48 and first[0].original_size == (96, 128)
    cache = SampleCache(max_bytes=one_shard)
    for _ in range(2):
        list(ShardStream(str(shard), shuffle_shards=False, image_size=48, cache=cache))
    assert (cache.misses, cache.hits, cache.bytes) == (1, 1, one_shard)
    list(ShardStream(str(shard), shuffle_shards=False, image_size=64, cache=cache))  # other decode size
    assert cache.misses == 2 and cache.bytes <= one_shard and len(cache) == 1  # the first one evicted
    _shard(shard, 100, 10)  # rewritten in place: new bytes, new digest, decoded again
    again = list(ShardStream(str(shard), shuffle_shards=False, image_size=64, cache=cache))
    assert again[0].key == "k0100" and cache.misses == 3
    small = SampleCache(max_bytes=one_shard // 2)  # a shard larger than the budget is never kept
    list(ShardStream(str(shard), shuffle_shards=False, image_size=48, cache=small))
    assert len(small) == 0 and small.bytes == 0
    resumed = ShardStream(
        str(shard), shuffle_shards=False, image_size=48, cache=cache, position=StreamPosition(0, 0, 4, 4)
    )
    assert [s.key for s in resumed] == [s.key for s in again[4:]]
    with pytest.raises(ValueError, match="max_bytes >= 0"):
        SampleCache(-1)
