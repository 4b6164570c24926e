"""Every image read is bounded: the header's pixels are checked before decoding (validation quarantines a
150-megapixel PNG and a 20000x20000 JPEG as ``image_pixels``), and every reader decodes no more than the size
it needs (JPEG at a reduced scale, PNG decoded once then scaled), each step within its memory bound."""

from __future__ import annotations

import io
import json
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from compat.data.images import MAX_PIXELS, ImageTooLargeError, decode_rgb, read_header
from compat.data.shards import write_shard

MiB = 1 << 20
STEP_BOUND = 512 * MiB  # the most one big picture may add to any step's peak RSS


# ------------------------------------------------------------------------------------ planted images
def forged_jpeg(width: int, height: int) -> bytes:
    """A 16x16 JPEG whose frame header claims ``width`` x ``height`` (what a hostile shard can carry)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    at = data.index(b"\xff\xc0")  # baseline start-of-frame: length, precision, height, width
    struct.pack_into(">HH", data, at + 5, height, width)
    return bytes(data)


def flat_png(width: int, height: int, colour: tuple[int, int, int] = (40, 160, 90)) -> bytes:
    """A valid RGB PNG of one colour, built without holding its pixels: one deflate segment of 100 rows
    (flushed to a byte boundary, so it can be repeated), repeated, and the Adler-32 of the whole."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + bytes(colour) * width
    blocks, rest = divmod(height, 100)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = deflate.compress(row * 100) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.compress(row * rest) + deflate.flush(zlib.Z_FINISH)
    adler = 1
    for _ in range(blocks):
        adler = zlib.adler32(row * 100, adler)
    adler = zlib.adler32(row * rest, adler)
    stream = b"\x78\xda" + segment * blocks + tail + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")


def camera_jpeg(width: int, height: int, orientation: int = 1) -> bytes:
    """A real JPEG of ``width`` x ``height`` (a gradient, not one flat block), EXIF orientation set."""
    picture = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=85, exif=exif.tobytes())
    return buffer.getvalue()


def peak_growth(step: Callable[[], Any]) -> tuple[Any, int]:
    """``step()``'s result and how far this process's peak RSS rose above its RSS before it (bytes)."""

    def status(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    result = step()
    return result, status("VmHWM") - before


# ---------------------------------------------------------------------------------------- decode path
def test_planted_headers_are_refused_before_decoding():
    png, jpeg = flat_png(15000, 10000), forged_jpeg(20000, 20000)
    assert len(png) < 2 * MiB and len(jpeg) < 1024  # cheap to carry: the bytes say nothing of the pixels
    assert read_header(png).pixels == 150_000_000
    with pytest.raises(ImageTooLargeError, match="decompression-bomb|400.0 megapixels"):
        read_header(jpeg)  # past PIL's own limit: refused by PIL's header check, reported as too large
    for data in (png, jpeg):
        with pytest.raises(ImageTooLargeError, match="above max_pixels 40,000,000") as refused:
            _, grew = peak_growth(lambda d=data: decode_rgb(d, size=64))
        assert "--max-side" in str(refused.value)
    _, grew = peak_growth(lambda: [_refused(d) for d in (png, jpeg)])
    assert grew < 16 * MiB


def _refused(data: bytes) -> None:
    with pytest.raises(ImageTooLargeError):
        decode_rgb(data)


def test_decode_to_the_size_the_caller_needs():
    photo = camera_jpeg(3000, 2000, orientation=6)  # stored landscape, shown portrait
    full = decode_rgb(photo)
    assert full.size == (2000, 3000) and full.info["original_size"] == (2000, 3000)
    small, grew = peak_growth(lambda: decode_rgb(photo, size=64))
    assert small.size == (64, 96) and small.info["original_size"] == (2000, 3000)
    assert grew < 16 * MiB  # libjpeg decodes 375x250 (1/8 scale), not 6 megapixels
    # the same picture as the model's preprocessing would have made it from the full decode
    reference = full.resize((64, 96), Image.Resampling.BICUBIC)
    diff = max(abs(a - b) for a, b in zip(small.getdata(0), reference.getdata(0), strict=True))
    assert diff <= 12
    png = decode_rgb(flat_png(300, 200), size=50)
    assert png.size == (75, 50) and png.getpixel((10, 10)) == (40, 160, 90)
    tiny = decode_rgb(flat_png(40, 30), size=64)  # smaller than asked: as it is, never upscaled
    assert tiny.size == (40, 30) and tiny.info["original_size"] == (40, 30)
    with pytest.raises(ValueError, match="size must be a positive"):
        decode_rgb(png_bytes(tiny), size=0)
    assert MAX_PIXELS == 40_000_000


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


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
    from components.validation import ValidationPolicy, validate_phase

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
    from components.drift import sample_phase

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
