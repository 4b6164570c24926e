"""Folders of pictures as people keep them (JPEG, PNG, transparent, several sizes), for the import tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

LABELS = ("red", "green", "blue", "grey")


def picture(seed: int, size: tuple[int, int], mode: str) -> Image.Image:
    """A small image of ``mode`` with content that differs per seed (so no two are byte-identical)."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize(size, Image.BILINEAR)
    if mode == "I;16":
        return Image.fromarray(np.asarray(base.convert("L"), dtype="<u2") * 257)
    if mode == "P":
        return base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return base.convert(mode)


# (mode, file extension, PIL format, member extension): formats the pipeline decodes keep their bytes
KINDS = [
    ("RGB", "jpg", "JPEG", "jpg"),
    ("L", "jpeg", "JPEG", "jpg"),
    ("RGBA", "png", "PNG", "png"),
    ("P", "png", "PNG", "png"),
    ("LA", "png", "PNG", "png"),
    ("I;16", "png", "PNG", "png"),
    ("RGB", "webp", "WEBP", "webp"),
    ("RGB", "bmp", "BMP", "png"),
    ("P", "gif", "GIF", "png"),
    ("CMYK", "tiff", "TIFF", "jpg"),  # PNG holds no CMYK: JPEG, the one format the pipeline decodes that does
]


SIZES = [(32, 32), (48, 20), (20, 64), (57, 41), (100, 30)]


def image_folder(root: Path, n: int, start: int = 0) -> Path:
    """``n`` images of every kind in KINDS (mixed sizes) with sidecar captions, in a nested folder tree."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        mode, ext, fmt, _ = KINDS[i % len(KINDS)]
        sub = root / ("a" if i % 3 else "b/c")
        sub.mkdir(parents=True, exist_ok=True)
        picture(i, SIZES[i % len(SIZES)], mode).save(sub / f"img{i:04d}.{ext}", format=fmt)
        (sub / f"img{i:04d}.txt").write_text(f"a {LABELS[i % 4]} thing number {i}\n")
    return root


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
