"""Image decoding to RGB, one bounded way for every reader (validation, drift, training, indexing, search).

:func:`decode_rgb` turns any image PIL reads into 8-bit RGB: EXIF orientation applied, transparency
composited onto a background (white by default), deep greyscale scaled (not clipped), other modes converted.
It is bounded in memory: the header's size is checked before a pixel is decoded (:data:`MAX_PIXELS`), and a
caller that needs ``size`` pixels on the short side gets no more (a JPEG decoded by libjpeg at a reduced
scale). The original's upright size is kept in the result's ``info["original_size"]``.

:data:`RESIZE_MODES` (to the model input, in the model's preprocessing) are open_clip's own;
:data:`DEFAULT_RESIZE_MODE` is the shortest-side resize and centre crop CLIP models were trained with here.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
WHITE = (255, 255, 255)
RESIZE_MODES = ("shortest", "longest", "squash")
DEFAULT_RESIZE_MODE = "shortest"
_TRANSPARENT_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
# The most pixels any reader decodes (validation.max_pixels may only lower it): 40 megapixels, a 7,700 x 5,200
# camera photo, 120 MB as RGB; PIL warns at 89 and refuses at 179 megapixels.
MAX_PIXELS = 40_000_000
_ORIENTATION = 0x0112
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageDecodeError(ValueError):
    """The bytes are not an image PIL can read, or its mode has no conversion to RGB."""


class ImageTooLargeError(ImageDecodeError):
    """The header declares more pixels than allowed; nothing was decoded."""

    def __init__(self, pixels: int | None, max_pixels: int, size: tuple[int, int] | None = None) -> None:
        self.pixels, self.max_pixels, self.size = pixels, max_pixels, size
        what = (
            f"{size[0]}x{size[1]} ({size[0] * size[1] / 1e6:.1f} megapixels)"
            if size
            else f"{pixels / 1e6:.1f} megapixels"
            if pixels
            else "over PIL's decompression-bomb limit"
        )
        super().__init__(
            f"the image is {what}, above max_pixels {max_pixels:,} ({max_pixels / 1e6:g} megapixels); "
            "not decoded (import it with --max-side to store it smaller)"
        )


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header declares (nothing decoded): format, mode and stored size."""

    format: str
    mode: str
    width: int
    height: int
    transparent: bool = False  # an alpha channel or a transparent colour (:func:`has_transparency`)


def _open(data: bytes, formats: Sequence[str] | None, max_pixels: int | None) -> Image.Image:
    """Open ``data`` lazily (header only); raise :class:`ImageTooLargeError` above ``max_pixels``."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels is the bound here
            image = Image.open(io.BytesIO(data), formats=list(formats) if formats else None)
    except Image.DecompressionBombError as exc:
        found = _BOMB_PIXELS.search(str(exc))
        limit = max_pixels or 2 * int(Image.MAX_IMAGE_PIXELS or 0)
        raise ImageTooLargeError(int(found.group(1)) if found else None, limit) from exc
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageDecodeError(f"cannot decode the image: {detail}") from exc
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ImageTooLargeError(image.width * image.height, max_pixels, image.size)
    return image


def read_header(
    data: bytes, formats: Sequence[str] | None = IMAGE_FORMATS, max_pixels: int | None = None
) -> ImageHeader:
    """The header of ``data`` without decoding a pixel; :class:`ImageTooLargeError` above ``max_pixels``
    (None: PIL's own limit), :class:`ImageDecodeError` when it is not an image."""
    with _open(data, formats, max_pixels) as image:
        return ImageHeader(str(image.format), image.mode, image.width, image.height, has_transparency(image))


def has_transparency(image: Image.Image) -> bool:
    """Whether ``image`` (opened, not necessarily loaded) has an alpha channel or a transparent colour
    (``tRNS``): converted to RGB without a background, it would show what lies under it, often black."""
    return image.mode in _TRANSPARENT_MODES or (
        image.mode in ("P", "L", "RGB", "1") and "transparency" in image.info
    )


def check_resize_mode(value: object, where: str) -> str:
    """``value`` when it is one of :data:`RESIZE_MODES`; else a ``ValueError`` naming ``where``."""
    if value not in RESIZE_MODES:
        raise ValueError(
            f"{where}: resize mode {value!r} is not one of {', '.join(RESIZE_MODES)} (shortest: resize the "
            "short side and centre-crop; longest: resize the long side and pad; squash: stretch to a square)"
        )
    return str(value)


def check_background(value: object, where: str) -> tuple[int, int, int]:
    """An RGB triple of 0..255 integers from ``value``; else a ``ValueError`` naming ``where``."""
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in value)
    ):
        return (int(value[0]), int(value[1]), int(value[2]))
    raise ValueError(f"{where}: background must be three integers 0..255 (R, G, B), got {value!r}")


def decode_rgb(
    data: bytes | Image.Image,
    background: Sequence[int] = WHITE,
    formats: Sequence[str] | None = IMAGE_FORMATS,
    *,
    size: int | None = None,
    max_pixels: int | None = MAX_PIXELS,
    resample: int | None = None,
) -> Image.Image:
    """Decode image bytes (or an opened, not yet loaded PIL image) to 8-bit RGB (see the module doc).

    ``size``: the short side the caller needs (None: full size; a smaller image comes back as it is).
    ``max_pixels``: None is PIL's own limit. ``formats``: the decoders PIL may try (None: any).
    ``resample``: the filter of the last scaling (None: bicubic). Raises :class:`ImageTooLargeError` above
    ``max_pixels``, :class:`ImageDecodeError` for anything else.
    """
    from PIL import Image, ImageOps

    background = check_background(background, "decode_rgb")
    if size is not None and size < 1:
        raise ValueError(f"decode_rgb: size must be a positive number of pixels, got {size}")
    image = data if isinstance(data, Image.Image) else _open(data, formats, max_pixels)
    if max_pixels is not None and image.width * image.height > max_pixels:  # an opened image's own check
        raise ImageTooLargeError(image.width * image.height, max_pixels, image.size)
    stored = image.size
    try:
        if size is not None and image.format in ("JPEG", "MPO") and min(stored) > size:
            scale = size / min(stored)  # libjpeg scales by 1/2, 1/4 or 1/8 and never below this request
            image.draft(None, (max(1, int(stored[0] * scale)), max(1, int(stored[1] * scale))))
        image.load()
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageDecodeError(f"cannot decode the image: {detail}") from exc
    try:
        orientation = int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # a malformed EXIF block: keep the stored orientation
        orientation = 1
    upright = (stored[1], stored[0]) if orientation in (5, 6, 7, 8) else stored
    if size is not None and image.mode in ("RGB", "RGBA", "L") and min(image.size) >= 2 * size:
        image = image.reduce(min(image.size) // size)  # box-average first: no full-size copy is converted
    if orientation in range(2, 9):  # else exif_transpose would only copy the picture
        try:
            image = ImageOps.exif_transpose(image) or image
        except Exception:
            pass
    try:
        rgb = _to_rgb(image, background)
    except Exception as exc:
        raise ImageDecodeError(f"cannot convert an image of mode {image.mode!r} to RGB: {exc}") from exc
    if size is not None and min(rgb.size) > size:
        # the target from the original's shape, so that the reduced steps' rounding does not compound
        shape = upright if (upright[0] <= upright[1]) == (rgb.width <= rgb.height) else rgb.size
        long_side = max(1, round(max(shape) * size / min(shape)))
        target = (size, long_side) if shape[0] <= shape[1] else (long_side, size)
        filter_ = Image.Resampling.BICUBIC if resample is None else resample
        rgb = rgb.resize(target, filter_, reducing_gap=3.0)
    rgb.info["original_size"] = upright
    return rgb


def read_image_file(uri: str, size: int | None = None, max_bytes: int = 32 << 20) -> Image.Image:
    """The RGB image of a file named by a local path or ``file://`` URI (an item's own image, outside any
    shard), at most ``max_bytes``, decoded by :func:`decode_rgb` to ``size``. Raises :class:`OSError` for a
    file it cannot read or another scheme, :class:`ImageDecodeError` for one that is not an image."""
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    if "://" in path:
        raise OSError(f"{uri!r}: only local paths and file:// URIs are read")
    with Path(path).open("rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageDecodeError(f"{path} is over {max_bytes:,} bytes")
    return decode_rgb(data, size=size)


def _to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT or mode in ("I", "F"):
        return _deep_to_l(image).convert("RGB")
    if not has_transparency(image):
        if mode == "CMYK" and image.info.get("icc_profile"):
            if (converted := _cmyk_with_profile(image)) is not None:
                return converted
        return image.convert("RGB")
    rgba = image if mode == "RGBA" else image.convert("RGBA")
    out = Image.new("RGB", rgba.size, background)
    out.paste(rgba, mask=rgba.getchannel("A"))
    return out


def _deep_to_l(image: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer or float greyscale as 8-bit ``L``, scaled: ``I`` (PIL's container for 16-bit
    PNG and TIFF) is 16-bit when a value exceeds 255; ``F`` is 0..1 when its maximum is at most 1."""
    import numpy as np
    from PIL import Image

    values = np.asarray(image, dtype=np.float64)
    if image.mode in _SIXTEEN_BIT or (image.mode == "I" and values.size and values.max() > 255):
        scaled = values.clip(0, 65535) / 257.0
    elif image.mode == "F" and values.size and values.max() <= 1.0:
        scaled = values.clip(0, 1) * 255.0
    else:
        scaled = values.clip(0, 255)
    return Image.fromarray(np.rint(scaled).astype(np.uint8), mode="L")


def _cmyk_with_profile(image: Image.Image) -> Image.Image | None:
    """CMYK to sRGB through the image's embedded ICC profile (None when the profile cannot be used)."""
    try:
        from PIL import ImageCms

        source = ImageCms.ImageCmsProfile(io.BytesIO(image.info["icc_profile"]))
        return ImageCms.profileToProfile(image, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
    except Exception:
        return None
