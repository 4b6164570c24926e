"""Rendered image-caption pairs of the synthetic stream for the compatibility tests (memory or shards)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from PIL import Image

from compat.compat_training import PairBatch
from compat.data.shards import write_shard
from compat.data.synth import make_sample


def pairs(n: int, split: str = "train", phase: int = 0, seed: int = 0) -> tuple[list[Image.Image], list[str]]:
    """``n`` rendered images and their first captions."""
    images, texts = [], []
    for i in range(n):
        _, members = make_sample(seed, phase, split, i, 64)
        images.append(Image.open(io.BytesIO(members["jpg"])).convert("RGB"))
        texts.append(members["txt"].decode())
    return images, texts


def pair_batches(n: int, batch_size: int, split: str = "train", seed: int = 0) -> list[PairBatch]:
    images, texts = pairs(n, split, seed=seed)
    return [
        PairBatch(
            images[i : i + batch_size], texts[i : i + batch_size], [str(j) for j in range(i, i + batch_size)]
        )
        for i in range(0, n, batch_size)
    ]


def write_shards(
    directory: Path, split: str, n: int, per_shard: int, phase: int = 0, seed: int = 0
) -> list[str]:
    """Write ``n`` samples of ``split`` as tar shards in ``directory``; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, start in enumerate(range(0, n, per_shard)):
        path = directory / f"{split}-{shard:05d}.tar"
        write_shard(
            path, [make_sample(seed, phase, split, i, 64) for i in range(start, min(start + per_shard, n))]
        )
        paths.append(str(path))
    return paths


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine run far faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
