"""Validation quarantines giant pictures (a 150-megapixel PNG, a forged 20000x20000 JPEG) within its memory
bound, and every reader downsizes within its bound and refuses unvalidated giants."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _images import MiB, camera_jpeg, flat_png, forged_jpeg, peak_growth, png_bytes
from PIL import Image

from compat.data.shards import write_shard

STEP_BOUND = 512 * MiB  # the most one big picture may add to any step's peak RSS


# ------------------------------------------------------------------------ every step on a planted shard
def _sample(key: str, image: bytes, ext: str, caption: str = "a green square on grey") -> list:
    meta = {"key": key, "status": "success"}
    return [
        (f"{key}.{ext}", image),
        (f"{key}.txt", caption.encode()),
        (f"{key}.json", json.dumps(meta).encode()),
    ]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, Any]:
    """A phase of small samples with, planted among them, a 150-megapixel PNG, a JPEG whose header says
    20000x20000, a 24-megapixel camera JPEG and a 30-megapixel PNG; validated with the default policy."""
    from components.data.validation import ValidationPolicy, validate_phase

    root = tmp_path_factory.mktemp("planted")
    small = [
        m
        for i in range(12)
        for m in _sample(f"s{i:02d}", png_bytes(Image.new("RGB", (64, 64), (i * 20, 90, 200))), "png")
    ]
    big = (
        _sample("huge-png", flat_png(15000, 10000), "png")
        + _sample("huge-jpeg", forged_jpeg(20000, 20000), "jpg")
        + _sample("camera", camera_jpeg(6000, 4000), "jpg")
        + _sample("big-png", flat_png(6000, 5000), "png")
    )
    write_shard(root / "in" / "00000.tar", ((k, dict(m)) for k, m in _grouped(small[:18] + big + small[18:])))
    policy = ValidationPolicy(max_quarantined_fraction=0.2)
    validate_phase(str(root / "in" / "*.tar"), root / "warm", policy)  # imports and suites loaded once
    summary, grew = peak_growth(lambda: validate_phase(str(root / "in" / "*.tar"), root / "out", policy))
    return {"root": root, "summary": summary, "validate_growth": grew}


def _grouped(members: list) -> list:
    """(key, [(ext, bytes), ...]) in order, from ``key.ext`` members."""
    out: dict[str, list] = {}
    for name, data in members:
        key, ext = name.split(".", 1)
        out.setdefault(key, []).append((ext, data))
    return list(out.items())


def test_validation_quarantines_the_planted_images_within_its_bound(planted):
    summary = planted["summary"]
    doc = json.loads(summary.path.read_text())
    assert not doc["blocked"] and doc["passed"] == 14 and doc["quarantined"] == 2, doc["blocked_reasons"]
    reasons = {p["key"]: p for p in doc["problems"]}
    assert set(reasons) == {"huge-png", "huge-jpeg"}
    assert reasons["huge-png"]["reason"] == "image_pixels"
    assert "15000x10000 (150.0 megapixels), above max_pixels 40,000,000" in reasons["huge-png"]["message"]
    assert reasons["huge-jpeg"]["reason"] == "image_pixels"
    assert planted["validate_growth"] < STEP_BOUND, planted["validate_growth"] / MiB


def test_every_reader_downsizes_within_its_bound_and_refuses_unvalidated_giants(planted):
    from compat.data.loader import LoaderError, ShardStream, load_captioned_set
    from compat.models import build_model
    from compat.training.data import ShardBatchSource
    from components.data.drift import sample_phase

    accepted = str(planted["root"] / "out" / "accepted" / "*.tar")
    drift, grew = peak_growth(lambda: sample_phase(accepted, 100, seed=0))
    assert grew < STEP_BOUND and len(drift) == 14
    camera = next(s for s in drift if s.key == "camera")
    assert camera.original_size == (6000, 4000) and min(camera.image.size) == 128

    bundle = build_model("cf-tiny")
    source = ShardBatchSource(
        accepted,
        8,
        bundle.preprocess_train,
        bundle.tokenizer,
        shuffle_shards=False,
        image_size=bundle.image_size,
    )
    batches = source.batches(None)
    batch, grew = peak_growth(lambda: [next(batches) for _ in range(4)])  # two epochs: both big ones twice
    assert grew < STEP_BOUND and batch[0].images.shape[1:] == (3, bundle.image_size, bundle.image_size)

    gallery, grew = peak_growth(lambda: load_captioned_set(accepted, image_size=bundle.image_size))
    assert grew < STEP_BOUND
    assert max(min(image.size) for image in gallery.images) == bundle.image_size

    raw = str(planted["root"] / "in" / "*.tar")
    with pytest.raises(LoaderError, match="huge-png.*above max_pixels"):
        _, grew = peak_growth(lambda: list(ShardStream(raw, shuffle_shards=False, image_size=64)))
