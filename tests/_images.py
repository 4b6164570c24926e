"""Planted pictures for the image tests: forged headers, giant flat PNGs built without their pixels, camera
JPEGs with an EXIF orientation."""

from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image


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


MiB = 1 << 20


def peak_growth(step: Callable[[], Any]) -> tuple[Any, int]:
    """``step()``'s result and how far this process's peak RSS rose above its RSS before it (bytes)."""

    def status(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    result = step()
    return result, status("VmHWM") - before


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()
