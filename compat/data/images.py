"""Image decoding to RGB, one way for every reader (validation, training, indexing, search); resize modes.

:func:`decode_rgb` turns the bytes of any image PIL reads into an 8-bit RGB image: EXIF orientation applied,
transparency (RGBA, LA, PA, palette or single-colour ``tRNS`` transparency) composited onto a background
(white by default), 16-bit and 32-bit integer greyscale scaled to 8 bits (not clipped), CMYK, palette,
bilevel and greyscale converted. Resizing belongs to the model's preprocessing; :data:`RESIZE_MODES` are
open_clip's own (``open_clip.transform.image_transform``), :data:`DEFAULT_RESIZE_MODE` keeps the
shortest-side resize and centre crop CLIP models were always trained with here.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
WHITE = (255, 255, 255)
RESIZE_MODES = ("shortest", "longest", "squash")
DEFAULT_RESIZE_MODE = "shortest"
_TRANSPARENT_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


class ImageDecodeError(ValueError):
    """The bytes are not an image PIL can read, or its mode has no conversion to RGB."""


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
) -> Image.Image:
    """Decode image bytes (or convert an opened PIL image) to an 8-bit RGB image (see the module doc).

    ``formats`` limits the decoders PIL may try (None: any it has). Raises :class:`ImageDecodeError`.
    """
    from PIL import Image, ImageOps

    background = check_background(background, "decode_rgb")
    try:
        if isinstance(data, Image.Image):
            image = data
        else:
            image = Image.open(io.BytesIO(data), formats=list(formats) if formats else None)
        image.load()
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageDecodeError(f"cannot decode the image: {detail}") from exc
    try:
        image = ImageOps.exif_transpose(image) or image
    except Exception:  # a malformed EXIF block: keep the stored orientation
        pass
    try:
        return _to_rgb(image, background)
    except ImageDecodeError:
        raise
    except Exception as exc:
        raise ImageDecodeError(f"cannot convert an image of mode {image.mode!r} to RGB: {exc}") from exc


def _to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT or mode in ("I", "F"):
        return _deep_to_l(image).convert("RGB")
    transparent = mode in _TRANSPARENT_MODES or (
        mode in ("P", "L", "RGB", "1") and "transparency" in image.info
    )
    if not transparent:
        if mode == "CMYK" and image.info.get("icc_profile"):
            converted = _cmyk_with_profile(image)
            if converted is not None:
                return converted
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    out = Image.new("RGB", rgba.size, background)
    out.paste(rgba, mask=rgba.getchannel("A"))
    return out


def _deep_to_l(image: Image.Image) -> Image.Image:
    """16-bit (``I;16*``), 32-bit integer (``I``) or float (``F``) greyscale as 8-bit ``L``, scaled.

    ``I;16*`` spans 0..65535; ``I`` is PIL's container for 16-bit PNG and TIFF data, so it is read as 16-bit
    when any value exceeds 255 and as 8-bit otherwise; ``F`` is read as 0..1 when its maximum is at most 1,
    else as 0..255.
    """
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
