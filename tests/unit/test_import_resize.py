"""`compatflow data import` stores pictures at the size the pipeline needs, as img2dataset does
(--max-side N --resize-mode keep_ratio|center_crop|border|no), records the original in {key}.json, keeps the
untouched files on request (--keep-originals) and refuses a picture no reader would decode."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from _images import flat_png
from PIL import Image
from typer.testing import CliRunner

from compat.data.importer import ImportSettings, import_images, resized_size
from pipelines.cli import app
from schemas import schema_errors


def _jpeg(size: tuple[int, int], orientation: int = 1) -> bytes:
    picture = Image.linear_gradient("L").resize(size).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A photo stored landscape and shown portrait (EXIF 6), a wide PNG with transparency, a small PNG."""
    root = tmp_path_factory.mktemp("resize") / "src"
    root.mkdir()
    cut_out = Image.new("RGBA", (900, 300), (0, 0, 0, 0))
    cut_out.paste((200, 20, 20, 255), (300, 100, 600, 200))
    files = {
        "photo.jpg": _jpeg((1200, 800), orientation=6),
        "wide.png": _png(cut_out),
        "small.png": _png(Image.new("L", (28, 28), 120)),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
        (root / name).with_suffix(".txt").write_text(f"a picture called {name}")
    return root


def _samples(out: Path, under: str = "") -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted((out / under).glob("*/*.tar")):  # {split}/NNNNN.tar (originals/ is one deeper)
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def _by_source(out: Path) -> dict[str, tuple[dict, Image.Image, dict[str, bytes]]]:
    found = {}
    for members in _samples(out).values():
        if "json" not in members or "txt" not in members:
            continue
        meta = json.loads(members["json"])
        ext = next(e for e in ("jpg", "png", "webp") if e in members)
        found[meta["source"]] = (meta, Image.open(io.BytesIO(members[ext])), members)
    return found


def test_keep_ratio_stores_the_short_side_and_records_the_original(source: Path, tmp_path: Path) -> None:
    settings = ImportSettings(split=(1.0, 0.0, 0.0), max_side=256, resize_mode="keep_ratio")
    result = import_images(source, tmp_path / "out", settings, progress=False)
    assert result.report["resized"] == 2 and schema_errors(result.report, "stream_import") == []
    found = _by_source(tmp_path / "out")
    meta, image, _ = found["photo.jpg"]
    assert image.format == "JPEG" and image.size == (256, 384)  # upright: EXIF orientation applied
    assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (
        256,
        384,
        800,
        1200,
    )
    assert meta["format"] == "JPEG" and meta["mode"] == "RGB"
    assert meta["resize"] == {"mode": "keep_ratio", "max_side": 256, "applied": True}
    meta, image, _ = found["wide.png"]
    assert image.format == "PNG" and image.size == (768, 256) and meta["mode"] == "RGBA"
    assert image.getpixel((0, 0)) == (255, 255, 255)  # transparency on white, as every reader shows it
    assert meta["source_sha256"] != meta["sha256"]
    meta, image, members = found["small.png"]
    assert image.size == (28, 28) and meta["resize"]["applied"] is False
    assert members["png"] == (source / "small.png").read_bytes()  # never enlarged, stored untouched


@pytest.mark.parametrize(
    ("mode", "photo", "wide"),
    [
        ("center_crop", (128, 128), (128, 128)),
        ("border", (128, 128), (128, 128)),
        ("no", (1200, 800), (900, 300)),
    ],
)
def test_each_img2dataset_mode(source: Path, tmp_path: Path, mode: str, photo: tuple, wide: tuple) -> None:
    settings = ImportSettings(split=(1.0, 0.0, 0.0), max_side=128, resize_mode=mode)
    import_images(source, tmp_path / "out", settings, progress=False)
    found = _by_source(tmp_path / "out")
    assert found["photo.jpg"][1].size == photo and found["wide.png"][1].size == wide
    if mode == "border":  # the wide picture fills 128 x 43 in the middle, black above and below
        image = found["wide.png"][1]
        assert image.getpixel((64, 2)) == (0, 0, 0) and image.getpixel((64, 64)) == (200, 20, 20)
    if mode == "no":
        assert found["photo.jpg"][2]["jpg"] == (source / "photo.jpg").read_bytes()
    assert resized_size(1200, 800, 128, mode) == (
        None if mode == "no" else photo[::-1] if False else (128, 128)
    )


def test_keep_originals_and_the_cli(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["data", "import", str(source), "--out", str(out), "--max-side", "64", "--keep-originals"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "import.json").read_text())
    assert report["settings"]["max_side"] == 64 and report["settings"]["resize_mode"] == "keep_ratio"
    assert schema_errors(report, "stream_import") == []
    originals = _samples(out, "originals")
    stored = _by_source(out)
    assert len(originals) == 3
    for name, (meta, image, _) in stored.items():
        kept = originals[meta["key"]]
        assert kept[name.rsplit(".", 1)[1]] == (source / name).read_bytes()
        assert min(image.size) == min(64, meta["original_width"], meta["original_height"])
    assert all(
        f"originals/{p}" in sum(report["originals"].values(), []) for p in sum(report["shards"].values(), [])
    )
    again = CliRunner().invoke(app, args)  # the same import: nothing written
    assert again.exit_code == 0, again.output
    bad = CliRunner().invoke(app, [*args[:3], "--out", str(tmp_path / "x"), "--resize-mode", "squash"])
    assert bad.exit_code != 0 and "keep_ratio, center_crop, border, no" in bad.output


def test_a_picture_no_reader_decodes_is_refused_unless_resized(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "huge.png").write_bytes(flat_png(7000, 7000))  # 49 megapixels, 0.2 MB
    (src / "huge.txt").write_text("a green square")
    kept = import_images(src, tmp_path / "no", ImportSettings(resize_mode="no"), progress=False)
    assert kept.imported == 0 and kept.report["refused_by_reason"] == {"too_many_pixels": 1}
    assert "--resize-mode" in kept.report["refused_files"][0]["message"]
    resized = import_images(src, tmp_path / "yes", ImportSettings(split=(1.0, 0.0, 0.0)), progress=False)
    meta, image, _ = _by_source(tmp_path / "yes")["huge.png"]
    assert image.size == (512, 512) and (meta["original_width"], meta["original_height"]) == (7000, 7000)
    assert resized.report["resized"] == 1


def test_each_picture_is_decoded_once_and_the_spool_is_removed(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pictures resized and one kept: three decodes in all (the scan's), none when the shards are
    written; the resized bytes wait in the spool, gone when the import ends (a killed scan's too)."""
    from PIL import ImageFile

    from compat.data.importer import SPOOL

    decodes: list[str] = []
    real_load = ImageFile.ImageFile.load

    def load(self: ImageFile.ImageFile):  # a spy around PIL's own decoding: it still decodes
        if self.tile:
            decodes.append(str(self.format))
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    out = tmp_path / "out"
    (out / SPOOL).mkdir(parents=True)
    (out / SPOOL / "left-by-a-killed-scan.jpg").write_bytes(b"x")
    result = import_images(source, out, ImportSettings(split=(1.0, 0.0, 0.0), max_side=256), progress=False)
    assert result.report["resized"] == 2 and sorted(decodes) == ["JPEG", "PNG", "PNG"]
    assert not (out / SPOOL).exists() and len(_by_source(out)) == 3
