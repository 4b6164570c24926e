"""The loader's decoding worker processes: order, positions and augmentations kept, a damaged shard ends the
stream after the samples before it, workers end with the training process."""

from __future__ import annotations

from pathlib import Path

import pytest
from _shards import members
from PIL import Image

from compat.data.loader import (
    LoaderError,
    ShardStream,
    StreamPosition,
    iter_batches,
)
from compat.data.shards import write_shard


# ------------------------------------------------------------------------------------- decoding workers
def random_crop(image: Image.Image):
    """A random augmentation that draws from torch's generator, as open_clip's training transform does."""
    from torchvision import transforms

    crop = transforms.RandomResizedCrop(16, scale=(0.3, 1.0))
    return transforms.Compose([crop, transforms.ToTensor()])(image)


def test_workers_keep_the_samples_order_positions_and_augmentations(train_urls: list[str]) -> None:
    """Decoding in 2 processes yields what 0 workers yields: the same samples in the same order with the same
    position after each, the same batches (a random crop draws per (seed, epoch, key), not per process), and a
    stream resumed mid-shard in workers continues exactly; the caller's torch generator is left alone."""
    import open_clip
    import torch

    def walk(workers: int, **kw) -> list[tuple[str, StreamPosition, bytes]]:
        s = ShardStream(train_urls, seed=6, epochs=2, workers=workers, **kw)
        return [(x.key, s.position, x.image.tobytes()) for x in s]

    serial = walk(0)
    assert walk(2, chunk=3) == serial and len(serial) == 100

    def batches(workers: int, position: StreamPosition | None = None) -> list:
        s = ShardStream(train_urls, seed=6, epochs=2, workers=workers, position=position)
        return list(iter_batches(s, 12, random_crop, open_clip.tokenize, "random", seed=1))

    torch.manual_seed(123)
    before = torch.get_rng_state()
    plain = batches(0)
    assert torch.equal(torch.get_rng_state(), before)
    parallel = batches(2)
    assert [b.keys for b in parallel] == [b.keys for b in plain]
    assert [b.position for b in parallel] == [b.position for b in plain]
    for p, q in zip(parallel, plain, strict=True):
        assert p.images.equal(q.images) and p.texts.equal(q.texts)
    flat = [(k, image) for b in plain for k, image in zip(b.keys, b.images, strict=True)]
    first, second = dict(flat[:50]), dict(flat[50:])
    assert sum(not first[k].equal(second[k]) for k in first) > 40  # each epoch draws its own crops
    resumed = batches(2, position=plain[3].position)
    assert [b.keys for b in resumed] == [b.keys for b in plain[4:]]
    assert resumed[0].images.equal(plain[4].images)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_shard_ends_the_stream_after_the_samples_before_it(tmp_path: Path, workers: int) -> None:
    good, bad = tmp_path / "a.tar", tmp_path / "b.tar"
    write_shard(good, [(f"a{i}", members(f"a{i}")) for i in range(20)])
    write_shard(bad, [(f"b{i}", members(f"b{i}")) for i in range(3)] + [("b3", members("b3", image=b"x"))])
    stream = ShardStream([str(good), str(bad)], shuffle_shards=False, workers=workers, chunk=4)
    seen = []
    with pytest.raises(LoaderError, match=r"b\.tar, key 'b3': cannot decode member \.jpg"):
        for sample in stream:
            seen.append(sample.key)
    assert seen == [f"a{i}" for i in range(20)] + ["b0", "b1", "b2"]
    assert stream.position == StreamPosition(0, 1, 3, 23)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(LoaderError, match=r"cut\.tar is malformed"):
        list(ShardStream([str(good), str(cut)], shuffle_shards=False, workers=workers))
    with pytest.raises(ValueError, match="workers must be >= 0"):
        ShardStream(str(good), workers=-1)


_WORKER_PIDS = """
import multiprocessing, sys, time
from compat.data.loader import ShardStream
stream = iter(ShardStream(sys.argv[1:], workers=2, chunk=1))
next(stream)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_workers_end_when_the_training_process_is_killed(train_urls: list[str]) -> None:
    """A killed process (SIGKILL: no clean-up runs) leaves no decoding worker behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if not Path("/proc/self/stat").exists():
        pytest.skip("reads process states from /proc")
    child = subprocess.Popen(
        [sys.executable, "-c", _WORKER_PIDS, *train_urls], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in child.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
