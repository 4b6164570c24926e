"""Thumbnails of gallery hits read from a real gallery shard through the bounded decode path: small JPEG data
URIs, giants and missing shards give None (never an error), decoded pictures cached within a bound."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from _images import camera_jpeg, flat_png, forged_jpeg
from PIL import Image

from compat.data.shards import write_shard
from components.serving.thumbnails import ShardThumbnails, thumbnail_uri


def _picture(uri: str | None) -> Image.Image:
    assert uri is not None and uri.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


@pytest.fixture
def shard(tmp_path: Path) -> str:
    """A gallery shard: a portrait photo stored landscape (EXIF 6), a flat PNG, a 20000x20000 JPEG header,
    a 7000x7000 PNG (49 megapixels, over the decode bound) and a caption-only item."""
    pictures = {
        "photo": ("jpg", camera_jpeg(1200, 800, orientation=6)),
        "green": ("png", flat_png(300, 100, (40, 160, 90))),
        "forged": ("jpg", forged_jpeg(20000, 20000)),
        "huge": ("png", flat_png(7000, 7000)),
    }
    samples = [
        (key, {ext: data, "txt": f"a picture called {key}".encode(), "json": json.dumps({}).encode()})
        for key, (ext, data) in pictures.items()
    ]
    samples.append(("words", {"txt": b"no picture at all"}))
    path = tmp_path / "gallery-000000.tar"
    write_shard(path, samples)
    return str(path)


def test_hits_get_small_upright_thumbnails_and_giants_none(shard: str, tmp_path: Path) -> None:
    thumbs = ShardThumbnails(side=64)
    keys = ["photo", "green", "forged", "huge", "words", "absent"]
    uris = [f"{shard}#{k}" for k in keys] + [None, "no-hash-here"]
    found = dict(zip([*keys, "none", "bad"], thumbs.lookup(uris), strict=True))
    photo, green = _picture(found["photo"]), _picture(found["green"])
    assert photo.size == (43, 64)  # upright (EXIF applied), longer side 64
    assert green.size == (64, 21) and green.convert("RGB").getpixel((32, 10)) == pytest.approx(
        (40, 160, 90), abs=6
    )
    assert all(found[k] is None for k in ("forged", "huge", "words", "absent", "none", "bad"))
    assert thumbs.failures == 0
    Path(shard).rename(tmp_path / "moved.tar")  # served from the cache: the shard is not read again
    assert thumbs.lookup([f"{shard}#photo"]) == [found["photo"]]
    assert thumbs.lookup([f"{shard}#never-asked"]) == [None] and thumbs.failures == 1  # gone: None


def test_the_cache_is_bounded(shard: str) -> None:
    thumbs = ShardThumbnails(max_items=2)
    thumbs.lookup([f"{shard}#photo", f"{shard}#green", f"{shard}#words"])
    assert len(thumbs._cache) == 2
    with pytest.raises(ValueError, match="max_items"):
        ShardThumbnails(max_items=0)


def test_a_thumbnail_is_a_few_kilobytes() -> None:
    uri = thumbnail_uri(camera_jpeg(4000, 3000))
    assert max(_picture(uri).size) == 96 and len(uri) < 8_000
