"""Every image read is bounded: the header's pixels are checked before decoding (validation quarantines a
150-megapixel PNG and a 20000x20000 JPEG as ``image_pixels``), and every reader decodes no more than the size
it needs (JPEG at a reduced scale, PNG decoded once then scaled), each step within its memory bound."""

from __future__ import annotations

import pytest
from _images import MiB, camera_jpeg, flat_png, forged_jpeg, peak_growth, png_bytes
from PIL import Image

from compat.data.images import MAX_PIXELS, ImageTooLargeError, decode_rgb, read_header


# ---------------------------------------------------------------------------------------- decode path
def test_planted_headers_are_refused_before_decoding():
    png, jpeg = flat_png(15000, 10000), forged_jpeg(20000, 20000)
    assert len(png) < 2 * MiB and len(jpeg) < 1024  # cheap to carry: the bytes say nothing of the pixels
    header = read_header(png)
    assert header.width * header.height == 150_000_000
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
