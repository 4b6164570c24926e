"""The streaming shard loader: URL expansion, deterministic shard order, exact resumption, batches, errors."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _shards import jpeg, members
from PIL import Image

from compat.data.loader import (
    LoaderError,
    ShardStream,
    StreamPosition,
    expand_urls,
    iter_batches,
    load_captioned_set,
    pick_caption,
    shard_order,
)
from compat.data.shards import ShardError, iter_raw_samples, sample_keys, write_shard
from compat.data.synth import make_sample, phase_urls


def keys_of(stream: ShardStream) -> list[str]:
    return [s.key for s in stream]


def test_expand_urls_braces_globs_dirs_and_fsspec(stream: Path, train_urls: list[str]) -> None:
    train_dir = stream / "phase-00" / "train"
    assert len(train_urls) == 8
    assert expand_urls(f"{train_dir}/shard-{{00000..00007}}.tar") == [str(Path(u)) for u in train_urls]
    assert expand_urls(f"{train_dir}/shard-0000[0-2].tar") == [str(Path(u)) for u in train_urls[:3]]
    assert expand_urls(str(train_dir)) == [str(Path(u)) for u in train_urls]
    assert expand_urls([train_urls[1], train_urls[0], train_urls[1]]) == [train_urls[1], train_urls[0]]
    assert expand_urls(f"file://{train_dir}/*.tar") == [f"file://{u}" for u in train_urls]
    assert expand_urls("s3://bucket/shard-{0..2}.tar") == [f"s3://bucket/shard-{i}.tar" for i in range(3)]


def test_specs_matching_nothing_raise_naming_the_spec(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match=r"nowhere/\*\.tar.*matches no shard"):
        expand_urls(str(tmp_path / "nowhere" / "*.tar"))
    with pytest.raises(LoaderError, match="matches no shard"):
        expand_urls(str(tmp_path / "shard-{0..3}.tar"))
    with pytest.raises(LoaderError, match="matches no shard"):
        expand_urls(f"file://{tmp_path}/missing.tar")
    with pytest.raises(LoaderError, match="pipe: URLs"):
        expand_urls("pipe:cat shard.tar")
    with pytest.raises(LoaderError, match="no shard spec"):
        expand_urls([])


def test_stream_yields_every_sample_once_per_epoch(stream: Path, train_urls: list[str]) -> None:
    ss = ShardStream(train_urls, seed=1, epochs=2)
    samples = list(ShardStream(train_urls, shuffle_shards=False))
    assert [s.key for s in samples] == [f"p00-train-{i:06d}" for i in range(50)]
    first = samples[0]
    assert first.image.mode == "RGB" and first.image.size == (32, 32)
    assert first.caption == first.captions[0] and len(first.captions) == 5
    assert first.meta["key"] == first.key and first.shard == train_urls[0]
    keys = keys_of(ss)
    assert len(keys) == 100 and sorted(keys[:50]) == sorted(keys[50:]) == sorted(s.key for s in samples)
    assert ss.position == StreamPosition(epoch=2, shard_index=0, sample_offset=0, samples_seen=100)
    assert keys_of(ss) == []  # exhausted: iterating again continues from the end


def test_shard_order_is_a_deterministic_permutation_per_seed_and_epoch(train_urls: list[str]) -> None:
    orders = {(seed, epoch): shard_order(8, seed, epoch) for seed in (0, 1) for epoch in (0, 1)}
    assert all(sorted(o) == list(range(8)) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 4
    assert shard_order(8, 1, 1) == orders[(1, 1)] and shard_order(8, 1, 1, shuffle=False) == list(range(8))
    a = ShardStream(train_urls, seed=5, epochs=2)
    b = ShardStream(train_urls, seed=5, epochs=2)
    assert keys_of(a) == keys_of(b)
    assert a.order(0) == [train_urls[i] for i in shard_order(8, 5, 0)]
    first_shard = shard_order(8, 5, 0)[0]
    first_keys = [s.key for s in ShardStream(train_urls[first_shard])]
    assert keys_of(ShardStream(train_urls, seed=5))[: len(first_keys)] == first_keys


@pytest.mark.parametrize("consumed", [0, 3, 7, 13, 49, 50, 51, 99, 100])
def test_resume_from_position_continues_exactly(train_urls: list[str], consumed: int) -> None:
    full = keys_of(ShardStream(train_urls, seed=2, epochs=2))
    first = ShardStream(train_urls, seed=2, epochs=2)
    it = iter(first)
    head = [next(it).key for _ in range(consumed)]
    saved = json.loads(json.dumps(first.position.to_dict()))
    assert saved["samples_seen"] == consumed
    rest = keys_of(ShardStream(train_urls, seed=2, epochs=2, position=StreamPosition.from_dict(saved)))
    assert head + rest == full
    assert keys_of(first) == rest  # the same object also continues where it stopped


def test_skipped_samples_are_not_decoded(tmp_path: Path) -> None:
    shard = tmp_path / "shard.tar"
    write_shard(
        shard,
        [
            ("k0", members("k0", image=b"not a jpeg")),
            ("k1", members("k1", image=b"\xff\xd8 broken")),
            ("k2", members("k2")),
            ("k3", members("k3")),
        ],
    )
    with pytest.raises(LoaderError, match=r"shard .*shard\.tar, key 'k0': cannot decode member \.jpg"):
        list(ShardStream(str(shard)))
    resumed = ShardStream(str(shard), position=StreamPosition(0, 0, 2, 2))
    assert keys_of(resumed) == ["k2", "k3"]
    assert [r.key for r in iter_raw_samples(str(shard), skip=3)] == ["k3"]
    assert len(sample_keys(str(shard))) == 4


def test_malformed_shards_raise_errors_naming_shard_and_key(tmp_path: Path) -> None:
    good = tmp_path / "good.tar"
    write_shard(good, [(f"s{i}", members(f"s{i}")) for i in range(5)])
    truncated = tmp_path / "truncated.tar"
    import tarfile

    with tarfile.open(good) as tar:
        last = tar.getmembers()[-1]
        end_of_members = last.offset_data + -(-last.size // 512) * 512
    cuts = (
        (2600, "s0.txt"),
        (2048, "s0.txt"),
        (700, "s0.jpg"),
        (end_of_members, "s4.json"),
        (end_of_members + 512, "s4.json"),
    )
    for cut, where in cuts:
        truncated.write_bytes(good.read_bytes()[:cut])
        with pytest.raises(
            LoaderError, match=rf"truncated\.tar is malformed \(at or after member '{where}'\)"
        ):
            list(ShardStream(str(truncated)))
    assert len(list(ShardStream(str(good)))) == 5
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(LoaderError, match=r"garbage\.tar"):
        list(ShardStream(str(garbage)))
    no_image = tmp_path / "noimage.tar"
    write_shard(no_image, [("a", {"txt": b"caption"})])
    with pytest.raises(LoaderError, match=r"noimage\.tar, key 'a': no image member"):
        list(ShardStream(str(no_image)))
    no_caption = tmp_path / "nocaption.tar"
    write_shard(no_caption, [("b", members("b", caption=None))])
    with pytest.raises(LoaderError, match=r"nocaption\.tar, key 'b': no caption"):
        list(ShardStream(str(no_caption)))
    with pytest.raises(ShardError, match="must not contain"):
        write_shard(tmp_path / "bad-key.tar", [("a.b", members("x"))])
    assert not (tmp_path / "bad-key.tar").exists() and not list(tmp_path.glob(".bad-key*"))


def test_plain_img2dataset_shards_without_json_captions(tmp_path: Path) -> None:
    shard = tmp_path / "00000.tar"
    write_shard(
        shard,
        [
            ("000000000", {"jpg": jpeg(), "txt": b"a photo of a dog"}),
            ("000000001", {"png": _png(), "txt": b"a cat", "json": b'{"url": "http://x"}'}),
        ],
    )
    samples = list(ShardStream(str(shard)))
    assert [s.caption for s in samples] == ["a photo of a dog", "a cat"]
    assert samples[1].captions == ["a cat"] and samples[1].meta == {"url": "http://x"}
    assert samples[1].image.mode == "RGB"


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (4, 4), 128).save(buf, format="PNG")
    return buf.getvalue()


def test_fsspec_urls_file_and_memory(stream: Path, train_urls: list[str]) -> None:
    import fsspec

    expected = keys_of(ShardStream(train_urls, seed=3))
    assert keys_of(ShardStream([f"file://{u}" for u in train_urls], seed=3)) == expected

    fs = fsspec.filesystem("memory")
    for u in train_urls:
        fs.pipe(f"/loader-test/{Path(u).name}", Path(u).read_bytes())
    try:
        urls = expand_urls("memory://loader-test/shard-*.tar")
        assert all(u.startswith("memory://") for u in urls)
        assert [u.rsplit("/", 1)[-1] for u in urls] == [Path(u).name for u in train_urls]
        assert keys_of(ShardStream(urls, seed=3)) == expected
        it = iter(remote := ShardStream(urls, seed=3))
        head = [next(it).key for _ in range(17)]
        assert head + keys_of(ShardStream(urls, seed=3, position=remote.position)) == expected
    finally:
        fs.rm("/loader-test", recursive=True)
    with pytest.raises(LoaderError, match="cannot open shard memory://loader-test/nothing.tar"):
        list(ShardStream("memory://loader-test/nothing.tar"))


def to_tensor(image: Image.Image):
    import torch

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def test_iter_batches_collates_and_resumes(train_urls: list[str]) -> None:
    import open_clip

    full = keys_of(ShardStream(train_urls, seed=4))
    batches = list(iter_batches(ShardStream(train_urls, seed=4), 16, to_tensor, open_clip.tokenize))
    assert [len(b.keys) for b in batches] == [16, 16, 16, 2]
    assert batches[0].images.shape == (16, 3, 32, 32) and batches[0].texts.shape == (16, 77)
    assert [k for b in batches for k in b.keys] == full
    assert batches[1].position.samples_seen == 32

    resumed = ShardStream(train_urls, seed=4, position=batches[1].position)
    rest = list(iter_batches(resumed, 16, to_tensor, open_clip.tokenize, drop_last=True))
    assert [len(b.keys) for b in rest] == [16]
    assert rest[0].keys == full[32:48] and rest[0].position.samples_seen == 48
    assert rest[0].images.equal(batches[2].images) and rest[0].texts.equal(batches[2].texts)

    with pytest.raises(ValueError, match="batch_size"):
        next(iter_batches(ShardStream(train_urls), 0, to_tensor, open_clip.tokenize))


def test_random_caption_choice_is_deterministic_and_varied(train_urls: list[str]) -> None:
    import torch

    def texts(seed: int) -> list[str]:
        captions: list[str] = []

        def recording_tokenizer(batch: list[str]) -> torch.Tensor:
            captions.extend(batch)
            return torch.zeros(len(batch), 4, dtype=torch.long)

        for _ in iter_batches(
            ShardStream(train_urls, seed=0), 25, to_tensor, recording_tokenizer, "random", seed
        ):
            pass
        return captions

    picks = texts(7)
    samples = {s.key: s for s in ShardStream(train_urls, seed=0)}
    assert all(p in s.captions for p, s in zip(picks, samples.values(), strict=True))
    assert picks == texts(7) and picks != texts(8)
    assert sum(p != s.caption for p, s in zip(picks, samples.values(), strict=True)) > 20
    with pytest.raises(ValueError, match="caption_choice"):
        pick_caption(next(iter(samples.values())), "best", 0, 0)


def test_load_captioned_set(stream: Path, tmp_path: Path) -> None:
    urls = phase_urls(stream, 0, "gallery")
    gallery = load_captioned_set(urls)
    assert len(gallery) == 8 and gallery.keys == [f"p00-gallery-{i:06d}" for i in range(8)]
    assert all(len(c) == 5 for c in gallery.captions) and all(m["split"] == "gallery" for m in gallery.metas)
    assert gallery.images[0].mode == "RGB"
    reference = make_sample(9, 0, "gallery", 3, 32)[1]
    assert np.array_equal(np.asarray(gallery.images[3]), np.asarray(Image.open(io.BytesIO(reference["jpg"]))))
    copy = tmp_path / "copy.tar"
    shutil.copy(urls[0], copy)
    with pytest.raises(LoaderError, match="appears twice"):
        load_captioned_set([urls[0], str(copy)])


def test_position_validation(train_urls: list[str]) -> None:
    assert StreamPosition.from_dict(StreamPosition(1, 2, 3, 4).to_dict()) == StreamPosition(1, 2, 3, 4)
    with pytest.raises(ValueError, match="'sample_offset'"):
        StreamPosition.from_dict({"epoch": 0, "shard_index": 0, "sample_offset": -1, "samples_seen": 0})
    with pytest.raises(ValueError, match="'epoch'"):
        StreamPosition.from_dict({})
    with pytest.raises(ValueError, match="past the 8 shards"):
        ShardStream(train_urls, position=StreamPosition(0, 9, 0, 0))
    with pytest.raises(ValueError, match="epochs"):
        ShardStream(train_urls, epochs=0)
    infinite = iter(ShardStream(train_urls[:1], epochs=None))
    assert len([next(infinite) for _ in range(30)]) == 30
