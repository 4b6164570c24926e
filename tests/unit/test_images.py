"""Any image decodes to RGB one way (compat.data.images); the resize mode is recorded and reused."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from compat.data.images import ImageDecodeError, decode_rgb
from compat.data.loader import load_captioned_set
from compat.data.shards import write_shard
from compat.models import build_model, load_checkpoint, read_sidecar, save_checkpoint


def _png(image: Image.Image, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **kwargs)
    return out.getvalue()


def _jpeg(image: Image.Image, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95, **kwargs)
    return out.getvalue()


def test_rgba_transparency_is_white_not_black():
    cut_out = Image.new("RGBA", (32, 16), (0, 0, 0, 0))  # fully transparent, black underneath
    cut_out.paste((200, 10, 10, 255), (8, 4, 24, 12))  # an opaque red object
    cut_out.putpixel((0, 15), (0, 0, 255, 128))  # half-transparent blue
    rgb = decode_rgb(_png(cut_out))
    assert rgb.mode == "RGB" and rgb.size == (32, 16)
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((10, 6)) == (200, 10, 10)
    r, g, b = rgb.getpixel((0, 15))
    assert 120 <= r <= 135 and 120 <= g <= 135 and b == 255
    assert decode_rgb(_png(cut_out), background=(0, 128, 0)).getpixel((0, 0)) == (0, 128, 0)
    with pytest.raises(ValueError, match="background"):
        decode_rgb(_png(cut_out), background=(0, 0))


def test_palette_with_transparency_and_plain_palette():
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    palette.paste(1, (4, 0, 8, 8))
    data = _png(palette, transparency=0)
    assert Image.open(io.BytesIO(data)).mode == "P"
    rgb = decode_rgb(data)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((6, 0)) == (255, 0, 0)
    assert decode_rgb(_png(palette)).getpixel((0, 0)) == (0, 0, 0)  # no transparency: black stays black


def test_la_and_greyscale():
    la = Image.new("LA", (4, 4), (0, 0))
    la.putpixel((1, 1), (0, 255))
    rgb = decode_rgb(_png(la))
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 1)) == (0, 0, 0)
    assert decode_rgb(_png(Image.new("L", (4, 4), 77))).getpixel((2, 2)) == (77, 77, 77)
    assert decode_rgb(_png(Image.new("1", (4, 4), 1))).getpixel((2, 2)) == (255, 255, 255)


def test_cmyk_jpeg():
    data = _jpeg(Image.new("CMYK", (16, 16), (0, 255, 255, 0)))
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    r, g, b = decode_rgb(data).getpixel((8, 8))
    assert r > 230 and g < 30 and b < 30


def test_sixteen_bit_is_scaled_not_clipped():
    values = np.array([[0, 257 * 100, 65535, 40000]], dtype=np.uint16)
    data = _png(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode in ("I;16", "I")
    row = [decode_rgb(data).getpixel((x, 0))[0] for x in range(4)]
    assert row == [0, 100, 255, round(40000 / 257)]
    wide = Image.fromarray(values.astype(np.int32), mode="I")  # PIL's 32-bit container of 16-bit data
    assert [decode_rgb(wide).getpixel((x, 0))[0] for x in range(4)] == row
    small = Image.fromarray(np.array([[0, 100, 255]], dtype=np.int32), mode="I")  # 8-bit data in "I"
    assert [decode_rgb(small).getpixel((x, 0))[0] for x in range(3)] == [0, 100, 255]


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 10, 20))  # blue on the left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    rgb = decode_rgb(_jpeg(image, exif=exif))
    assert rgb.size == (20, 40)
    top = rgb.getpixel((10, 2))
    assert top[2] > 200 and top[0] < 60  # the stored left edge is now on top


def test_undecodable_bytes_name_the_problem():
    with pytest.raises(ImageDecodeError, match="cannot decode"):
        decode_rgb(b"not an image at all")


def test_loader_decodes_with_the_same_function(tmp_path):
    cut_out = Image.new("RGBA", (24, 24), (0, 0, 0, 0))
    grey16 = Image.fromarray(np.full((24, 24), 65535, dtype=np.uint16))
    samples = [
        ("rgba", {"png": _png(cut_out), "txt": b"a cut-out", "json": b'{"key": "rgba"}'}),
        ("deep", {"png": _png(grey16), "txt": b"a white square", "json": b'{"key": "deep"}'}),
    ]
    write_shard(tmp_path / "shard.tar", samples)
    loaded = load_captioned_set(str(tmp_path / "shard.tar"))
    assert [im.mode for im in loaded.images] == ["RGB", "RGB"]
    assert loaded.images[0].getpixel((3, 3)) == (255, 255, 255)
    assert loaded.images[1].getpixel((3, 3)) == (255, 255, 255)
    black = load_captioned_set(str(tmp_path / "shard.tar"), background=(0, 0, 0))
    assert black.images[0].getpixel((3, 3)) == (0, 0, 0)


def _wide_image() -> Image.Image:
    image = Image.new("RGB", (128, 64), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 16, 64))  # a blue band at the left end
    return image


@pytest.fixture(scope="module")
def bundles():
    return {
        mode: build_model("cf-tiny", seed=0, resize_mode=mode) for mode in ("shortest", "longest", "squash")
    }


def test_resize_modes_shapes_and_what_they_keep(bundles):
    image = _wide_image()
    out = {mode: bundle.preprocess_eval(image) for mode, bundle in bundles.items()}
    assert all(t.shape == (3, 64, 64) for t in out.values())
    blue_minus_red = {mode: (t[2] - t[0]) for mode, t in out.items()}
    # shortest: short side to 64, centre crop: the blue left end is cut off
    assert blue_minus_red["shortest"][:, :4].max() < 0
    # squash: the whole width kept, stretched: the blue band is there, no padding
    assert blue_minus_red["squash"][32, :4].min() > 0
    # longest: long side to 64, letterboxed: the band is there and the top rows are padding (one value)
    assert blue_minus_red["longest"][32, :4].min() > 0
    top = out["longest"][:, :8, :]
    assert torch.allclose(top, top[:, :1, :1].expand_as(top))
    for mode in ("longest", "squash"):  # whole-image modes train on the geometry they are served with
        assert torch.equal(bundles[mode].preprocess_train(image), out[mode])
    assert bundles["shortest"].resize_mode == "shortest"  # today's default
    assert build_model("cf-tiny", seed=0).resize_mode == "shortest"
    with pytest.raises(ValueError, match="resize mode 'crop'"):
        build_model("cf-tiny", resize_mode="crop")


def test_resize_mode_recorded_and_reused_when_loaded(bundles, tmp_path):
    from compat.production import load_encoder

    longest = bundles["longest"]
    save_checkpoint(longest, tmp_path / "m", version="v1")
    assert read_sidecar(tmp_path / "m")["resize_mode"] == "longest"
    for loaded in (load_checkpoint(tmp_path / "m"), load_encoder(tmp_path / "m")):  # serving loads the same
        assert loaded.resize_mode == "longest"
        assert torch.equal(loaded.preprocess_eval(_wide_image()), longest.preprocess_eval(_wide_image()))
        assert torch.allclose(
            loaded.encode_images([_wide_image()]), longest.encode_images([_wide_image()]), atol=1e-6
        )
    # an older sidecar without the field means today's behaviour
    sidecar = json.loads((tmp_path / "m" / "model.json").read_text())
    del sidecar["resize_mode"]
    (tmp_path / "m" / "model.json").write_text(json.dumps(sidecar))
    assert load_checkpoint(tmp_path / "m").resize_mode == "shortest"
    sidecar["resize_mode"] = "stretch"
    (tmp_path / "m" / "model.json").write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match="resize_mode"):
        load_checkpoint(tmp_path / "m")


def test_model_config_schema_checks_the_resize_mode():
    from compat.models import read_config
    from schemas import SchemaError, validate

    config = read_config("cf-tiny")
    validate({**config, "preprocess_cfg": {"resize_mode": "longest"}}, "model_config")
    with pytest.raises(SchemaError, match="preprocess_cfg.resize_mode"):
        validate({**config, "preprocess_cfg": {"resize_mode": "crop"}}, "model_config", source="cf-x.json")
