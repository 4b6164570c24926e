"""Render a structured scene (see :mod:`compat.data.synth`) to a PIL image.

The scene holds every random choice (texture parameters and noise seeds included), so the same
scene always renders to the same pixels. Objects are drawn at ``SUPERSAMPLE`` times the output
size and box-filtered down, which anti-aliases edges at little cost.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from compat.data.domains import BLACK, RGB, WHITE, Domain, Kind

SUPERSAMPLE = 2
_STROKES: dict[str, dict[str, Any]] = {  # how a style outlines its objects
    "outlined": {"outline": BLACK, "width_frac": 0.1},
    "sticker": {"outline": WHITE, "width_frac": 0.16},
    "stencil": {"outline_only": True, "width_frac": 0.22},
    "neon": {"outline_only": True, "width_frac": 0.3},
}


def shade(rgb: RGB, factor: float) -> RGB:
    """Darken (factor < 1) or lighten towards white (factor > 1) a colour."""
    if factor <= 1.0:
        return tuple(int(c * factor) for c in rgb)  # type: ignore[return-value]
    t = min(factor - 1.0, 1.0)
    return tuple(int(c + (255 - c) * t) for c in rgb)  # type: ignore[return-value]


@lru_cache(maxsize=8)
def _grid(res: int) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:res, 0:res].astype(np.float32)
    return xs, ys


def _paint(index: np.ndarray, a: RGB, b: RGB) -> Image.Image:
    """Colour an index map (bool: two tones; float in [0, 1]: a blend from ``a`` to ``b``) through a palette
    of 256 colours from ``a`` (index 0) to ``b`` (index 255)."""
    idx = index.astype(np.uint8) * 255 if index.dtype == bool else (index * 255).astype(np.uint8)
    start, end = np.asarray(a, np.float32), np.asarray(b, np.float32)
    palette = (start + np.linspace(0.0, 1.0, 256, dtype=np.float32)[:, None] * (end - start)).astype(np.uint8)
    return Image.fromarray(np.take(palette, idx, axis=0), "RGB")


def render_background(background: dict[str, Any], res: int) -> Image.Image:
    """Texture ``background["texture"]`` in tone ``background["rgb"]`` with its ``params``, at ``res`` px."""
    tone: RGB = tuple(background["rgb"])  # type: ignore[assignment]
    texture = background["texture"]
    p = background.get("params", {})
    other = shade(tone, 0.72) if sum(tone) > 380 else shade(tone, 1.35)  # the second tone: contrasting
    xs, ys = _grid(res)
    if texture == "plain":
        return Image.new("RGB", (res, res), tone)
    if texture == "stripes":
        angle = math.radians(p["angle"])
        proj = (xs * math.cos(angle) + ys * math.sin(angle)) * (1.0 / (p["period"] * res))
        index = proj - np.floor(proj) < 0.5
    elif texture == "checks":
        cell = 1.0 / max(1.0, p["period"] * res)
        index = (np.floor(xs * cell) + np.floor(ys * cell)).astype(np.int32) % 2 == 1
    elif texture == "dots":
        inv = 1.0 / (p["period"] * res)
        u = xs * inv
        v = ys * inv + 0.5 * (np.floor(u) % 2)
        du, dv = u - np.floor(u) - 0.5, v - np.floor(v) - 0.5
        index = du * du + dv * dv < p["radius"] ** 2
    elif texture == "weave":
        freq = 2 * math.pi / (p["period"] * res)
        index = 0.5 + 0.5 * np.sin(xs * freq) * np.sin(ys * freq)
    elif texture == "gradient":
        index = ys / (res - 1) if p["direction"] == "down" else 1.0 - ys / (res - 1)
    elif texture == "noise":
        rng = np.random.default_rng(p["seed"])
        small = Image.fromarray(rng.integers(0, 256, (p["cells"], p["cells"]), dtype=np.uint8), "L")
        index = np.asarray(small.resize((res, res), Image.BILINEAR), dtype=np.float32) / 255.0
    elif texture == "waves":
        freq = 2 * math.pi / (p["period"] * res)
        index = 0.5 + 0.5 * np.sin(ys * freq + p["amplitude"] * np.sin(xs * freq * 0.5))
    elif texture == "bubbles":
        img = Image.new("RGB", (res, res), tone)
        draw = ImageDraw.Draw(img)
        rng = np.random.default_rng(p["seed"])
        for _ in range(p["count"]):
            cx, cy = rng.random(2) * res
            r = (0.02 + 0.05 * rng.random()) * res
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=other, width=max(1, res // 64))
        return img
    else:
        raise ValueError(f"unknown background texture {texture!r}")
    return _paint(index, tone, other)


def _draw_kind(
    draw: ImageDraw.ImageDraw,
    kind: Kind,
    box: tuple[float, float, float, float],
    main: RGB,
    effect: str,
    outline_only: bool = False,
    outline: RGB | None = None,
    width_frac: float = 0.0,
) -> None:
    """Draw ``kind``'s primitives into pixel ``box``; outline-only mode strokes shapes at ``width_frac``."""
    x0, y0, x1, y1 = box
    cx, cy, hx, hy = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2

    def pt(u: float, v: float) -> tuple[float, float]:
        return cx + u * hx, cy + v * hy

    def bx(b: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        return (*pt(b[0], b[1]), *pt(b[2], b[3]))

    stroke = max(1, round(width_frac * hx))
    for part in kind.parts:
        shape, geom, role = part[0], part[1], part[2]
        colour = main if role == "main" else shade(main, 0.6) if role == "dark" else tuple(role)
        if effect == "watercolor":
            colour = shade(colour, 1.2)
        fill = None if outline_only else colour
        line_colour = colour if outline_only else outline
        if shape == "ellipse":
            draw.ellipse(bx(geom), fill=fill, outline=line_colour, width=stroke)
        elif shape == "poly":
            draw.polygon([pt(u, v) for u, v in geom], fill=fill, outline=line_colour, width=stroke)
        elif shape == "pieslice":
            start, end = part[3]
            draw.pieslice(bx(geom), start, end, fill=fill, outline=line_colour, width=stroke)
        elif shape == "ring":
            draw.ellipse(bx(geom), outline=colour, width=max(1, round(part[3] * hx)))
        elif shape == "line":
            draw.line(
                [pt(u, v) for u, v in geom], fill=colour, width=max(1, round(part[3] * hx)), joint="curve"
            )
        else:
            raise ValueError(f"unknown primitive {shape!r}")


def render_scene(scene: dict[str, Any], domain: Domain, size: int) -> Image.Image:
    """Render ``scene`` (objects drawn with ``domain``'s kinds) as a ``size`` x ``size`` RGB image; style
    effects (blur, glow, grain, darkening) apply at the output size."""
    res = size * SUPERSAMPLE
    effect = scene["style_effect"]
    background = dict(scene["background"])
    if effect == "neon":
        background["rgb"] = shade(tuple(background["rgb"]), 0.3)
    img = render_background(background, size).resize((res, res), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    kinds = {k.names[0]: k for k in domain.kinds}
    objects = scene["objects"]
    for obj in objects:
        box = tuple(c * res for c in obj["box"])
        _draw_kind(draw, kinds[obj["kind"]], box, tuple(obj["rgb"]), effect, **_STROKES.get(effect, {}))
    if effect == "pixel":
        cells = max(8, size // 3)
        return img.resize((cells, cells), Image.BOX).resize((size, size), Image.NEAREST)
    img = img.reduce(SUPERSAMPLE)
    if effect == "neon":
        img = img.filter(ImageFilter.GaussianBlur(1.5))
        draw = ImageDraw.Draw(img)
        for obj in objects:
            box = tuple(c * size for c in obj["box"])
            bright = shade(tuple(obj["rgb"]), 1.25)
            _draw_kind(draw, kinds[obj["kind"]], box, bright, effect, outline_only=True, width_frac=0.1)
    elif effect == "watercolor":
        img = img.filter(ImageFilter.GaussianBlur(0.9))
    elif effect == "underwater":
        haze = Image.new("RGB", img.size, (0, 100, 130))
        img = Image.blend(img, haze, 0.25).filter(ImageFilter.GaussianBlur(0.6))
    elif effect == "crayon":
        rng = np.random.default_rng(scene["effect_seed"])
        grain = rng.integers(-22, 23, size=(size, size, 1), dtype=np.int16)
        img = Image.fromarray((np.asarray(img, dtype=np.int16) + grain).clip(0, 255).astype(np.uint8), "RGB")
    elif effect == "night":
        arr = np.asarray(img, dtype=np.uint16) * 140 // 256 + np.array([0, 0, 25], dtype=np.uint16)
        img = Image.fromarray(arr.clip(0, 255).astype(np.uint8), "RGB")
    return img
