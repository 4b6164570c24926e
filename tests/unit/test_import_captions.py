"""Data as people have it: several captions per picture (tables, Karpathy split files), transparent pictures
stored flat, and a too-large picture refused with the pixel rule's reason (`compatflow data import`)."""

from __future__ import annotations

import csv
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from compat.data.importer import MAX_DECODE_PIXELS, REPORT, ImportSettings, import_images
from compat.data.shards import iter_raw_samples
from pipelines.cli import app
from schemas import schema_errors

runner = CliRunner()


def picture(seed: int, size: tuple[int, int] = (32, 24)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def samples(out: Path, prefix: str = "") -> dict[str, dict[str, bytes]]:
    report = json.loads((out / REPORT).read_text())
    found = {}
    for split, shards in report["shards"].items():
        for rel in shards:
            for sample in iter_raw_samples(str(out / prefix / rel)):
                found[sample.key] = {**sample.members, "split": split.encode()}
    return found


def test_a_table_of_two_pictures_by_three_captions_imports_two_samples_of_three_captions(
    tmp_path: Path,
) -> None:
    (tmp_path / "img").mkdir()
    for i in range(2):
        picture(i).save(tmp_path / "img" / f"{i}.jpg")
    rows = [(f"img/{i}.jpg", f"picture {i}, caption {c}") for c in range(3) for i in range(2)]
    rows.append(("img/1.jpg", "picture 1, caption 2"))  # an exact repeat: dropped and said so
    table = tmp_path / "pairs.csv"
    with open(table, "w", newline="") as f:
        csv.writer(f).writerows([("path", "caption"), *rows])  # the captions' commas quoted
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(table), "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert printed["imported"] == 2 and printed["captions"] == 6 and printed["duplicates"] == 1
    report = json.loads((out / REPORT).read_text())
    assert schema_errors(report, "stream_import") == []
    assert report["imported"] == 2 and report["captions"] == 6 and report["grouped"] == 4
    assert sum(report["caption_counts"].values()) == 6
    assert report["duplicate_files"] == [
        {"source": "pairs.csv row 7: img/1.jpg", "duplicate_of": "pairs.csv row 2: img/1.jpg",
         "caption": "picture 1, caption 2"}
    ]  # fmt: skip
    found = samples(out)
    assert len(found) == 2
    for members in found.values():
        meta = json.loads(members["json"])
        i = int(meta["source"][4])
        assert meta["captions"] == [f"picture {i}, caption {c}" for c in range(3)]
        assert members["txt"].decode() == meta["caption"] == meta["captions"][0]
        assert meta["source_row"] == i + 1 and schema_errors(meta, "sample") == []
        assert report["caption_counts"][meta["split"]] >= 3


def test_training_draws_one_caption_per_visit_and_evaluation_reads_every_caption(tmp_path: Path) -> None:
    """The loader hands every caption on; the training pick is seeded per (seed, epoch, key), the same on a
    resumed run, and visits each caption over the epochs."""
    from compat.data.loader import ShardStream, pick_caption

    (tmp_path / "img").mkdir()
    picture(7).save(tmp_path / "img" / "7.jpg")
    table = tmp_path / "pairs.csv"
    table.write_text("path,caption\n" + "".join(f"img/7.jpg,caption {c}\n" for c in range(5)))
    out = tmp_path / "out"
    settings = ImportSettings(source_format="table", split=(1.0, 0.0, 0.0))
    import_images(table, out, settings, progress=False)
    (sample,) = list(ShardStream(str(out / "train" / "00000.tar"), shuffle_shards=False, seed=0, epochs=1))
    assert sample.captions == [f"caption {c}" for c in range(5)] and sample.caption == "caption 0"
    picks = [pick_caption(sample, "random", 3, epoch) for epoch in range(40)]
    assert picks == [pick_caption(sample, "random", 3, epoch) for epoch in range(40)]  # resumable
    assert set(picks) == set(sample.captions)


def karpathy_file(root: Path, name: str = "dataset_coco.json") -> tuple[Path, dict[str, str]]:
    """A Karpathy split file of 12 generated pictures (COCO layout: filepath + filename), with the splits
    each picture must keep, and the data set name after the images (the reader finds the list wherever)."""
    splits = ["train", "restval", "val", "test"] * 3
    images, expected = [], {}
    for n, split in enumerate(splits):
        folder = "val2014" if split != "train" else "train2014"
        (root / folder).mkdir(parents=True, exist_ok=True)
        filename = f"COCO_{folder}_{n:012d}.jpg"
        picture(100 + n).save(root / folder / filename)
        sentences = [
            {"raw": f"picture {n} sentence {s}.", "tokens": ["x"], "sentid": 5 * n + s} for s in range(5)
        ]
        if n == 0:
            sentences.append({"raw": "picture 0 sentence 1.", "tokens": [], "sentid": 99})  # a repeat
            sentences.append({"raw": "  ", "tokens": [], "sentid": 100})  # empty: left out alone
        images.append(
            {"filepath": folder, "filename": filename, "imgid": n, "cocoid": 1000 + n, "split": split,
             "sentences": sentences, "sentids": [s["sentid"] for s in sentences]}
        )  # fmt: skip
        expected[f"{folder}/{filename}"] = {"train": "train", "restval": "train", "test": "eval"}.get(
            split, "gallery"
        )
    images.append({"filename": "gone.jpg", "split": "train", "sentences": [{"raw": "no file"}]})
    images.append({"filepath": "val2014", "filename": "x.jpg", "split": "holdout", "sentences": []})
    path = root / name
    path.write_text(json.dumps({"images": images, "dataset": "coco"}, indent=1))
    return path, expected


def test_a_karpathy_file_keeps_its_splits_and_every_sentence(tmp_path: Path) -> None:
    path, expected = karpathy_file(tmp_path / "coco")
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(path), "--out", str(out), "--samples-per-shard", "4"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    assert schema_errors(report, "stream_import") == []
    assert report["settings"]["source_format"] == "karpathy"
    assert report["counts"] == {"train": 6, "eval": 3, "gallery": 3}
    assert report["caption_counts"] == {"train": 30, "eval": 15, "gallery": 15} and report["captions"] == 60
    assert report["duplicates"] == 1 and report["duplicate_files"][0]["caption"] == "picture 0 sentence 1."
    reasons = {r["source"]: r["reason"] for r in report["refused_files"]}
    assert reasons == {
        "dataset_coco.json image 1: train2014/COCO_train2014_000000000000.jpg sentence 7": "caption_empty",
        "dataset_coco.json image 13: gone.jpg": "image_missing",
        "dataset_coco.json image 14: val2014/x.jpg": "entry_invalid",
    }
    found = samples(out)
    assert len(found) == 12
    for members in found.values():
        meta = json.loads(members["json"])
        n = meta["source_meta"]["imgid"]
        assert meta["split"] == members["split"].decode() == expected[meta["source"]]  # the file's split
        assert meta["captions"] == [f"picture {n} sentence {s}." for s in range(5)]
        assert meta["source_meta"]["cocoid"] == 1000 + n and "sentences" not in meta["source_meta"]
    # no picture in two splits, whatever the split fractions say (they do not apply to a Karpathy file)
    again = tmp_path / "again"
    assert (
        runner.invoke(app, ["data", "import", str(path), "--out", str(again), "--split", "0,0,1"]).exit_code
        == 0
    )
    assert json.loads((again / REPORT).read_text())["counts"] == report["counts"]
    # the phase carries its captions: data info counts them per split beside the pictures
    stream = tmp_path / "stream"
    added = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(out), "--domain", "coco"])
    assert added.exit_code == 0, added.output
    info = runner.invoke(app, ["data", "info", str(stream)])
    assert info.exit_code == 0, info.output
    doc = json.loads(info.output)
    assert doc["phases"][0]["counts"] == {"train": 6, "eval": 3, "gallery": 3}
    assert doc["captions"] == [{"phase": 0, "train": 30, "eval": 15, "gallery": 15}]


def test_a_malformed_karpathy_file_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "dataset_flickr30k.json"
    for text, words in (
        ('{"dataset": "flickr30k"}', "has no 'images' list"),
        ('{"images": [{"filename": "a.jpg"} {"filename": "b.jpg"}]}', "',' or ']' expected"),
        ('[{"filename": "a.jpg"}]', "a JSON object expected"),
        ('{"images": [{"filename": "a.jpg", ]}', "not valid JSON"),
    ):
        bad.write_text(text)
        result = runner.invoke(app, ["data", "import", str(bad), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and words in result.output and "dataset_flickr30k.json" in result.output


def test_a_transparent_picture_is_stored_flat_on_white_and_kept_as_it_was_with_keep_originals(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rgba = np.zeros((40, 40, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red where opaque
    rgba[10:30, 10:30, 3] = 255  # an opaque square on a transparent field (black under the alpha)
    Image.fromarray(rgba, "RGBA").save(src / "sticker.png")
    (src / "sticker.txt").write_text("a red square sticker")
    palette = Image.new("P", (20, 20), 0)
    palette.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    palette.paste(1, (5, 5, 15, 15))
    palette.save(src / "icon.gif", transparency=0)  # a transparent palette colour, and not a kept format
    (src / "icon.txt").write_text("a blue icon")
    picture(1).save(src / "photo.jpg")
    (src / "photo.txt").write_text("a photo")
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(out), "--keep-originals"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    assert report["matted_on_white"] == 2 and schema_errors(report, "stream_import") == []
    stored = {json.loads(m["json"])["source"]: m for m in samples(out).values()}
    originals = {json.loads(m["json"])["source"]: m for m in samples(out, "originals").values()}
    sticker = Image.open(io.BytesIO(stored["sticker.png"]["png"]))
    assert sticker.mode == "RGB" and "transparency" not in sticker.info
    plain = np.asarray(sticker.convert("RGB"))  # what any reader converting to RGB sees
    assert (plain[0, 0] == 255).all() and (plain[39, 39] == 255).all()  # transparent: white, not black
    assert tuple(plain[20, 20]) == (200, 0, 0)
    icon = np.asarray(Image.open(io.BytesIO(stored["icon.gif"]["png"])).convert("RGB"))
    assert tuple(icon[0, 0]) == (255, 255, 255) and tuple(icon[10, 10]) == (0, 0, 255)
    assert originals["sticker.png"]["png"] == (src / "sticker.png").read_bytes()  # the original, unmatted
    assert Image.open(io.BytesIO(originals["sticker.png"]["png"])).mode == "RGBA"
    assert stored["photo.jpg"]["jpg"] == (src / "photo.jpg").read_bytes()  # no transparency: untouched


def solid_png(path: Path, width: int, height: int) -> None:
    """A 1-bit black PNG of ``width`` x ``height`` written row by row (a 231-megapixel one is ~30 KB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte, then the packed bits
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
    )


def test_a_picture_over_the_pixel_limit_is_refused_as_image_pixels_with_its_size(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    solid_png(src / "huge.png", 16_000, 14_450)  # 231.2 megapixels: over Pillow's decompression-bomb limit
    (src / "huge.txt").write_text("a very large black field")
    picture(1, (300, 200)).save(src / "big.jpg")
    (src / "big.txt").write_text("sixty thousand pixels")
    picture(2).save(src / "small.jpg")
    (src / "small.txt").write_text("a small one")
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(out), "--max-pixels", "50000"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    assert report["imported"] == 1 and report["settings"]["max_pixels"] == 50_000
    refused = {r["source"]: r for r in report["refused_files"]}
    assert {s: r["reason"] for s, r in refused.items()} == {
        "huge.png": "image_pixels",
        "big.jpg": "image_pixels",
    }
    assert (
        "300x200 (60,000 pixels" in refused["big.jpg"]["message"]
        and "50,000" in refused["big.jpg"]["message"]
    )
    assert "231,200,000 pixels" in refused["huge.png"]["message"]
    default = tmp_path / "default"
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(default)])
    assert result.exit_code == 0, result.output
    (refusal,) = json.loads((default / REPORT).read_text())["refused_files"]
    assert refusal["reason"] == "image_pixels" and f"{MAX_DECODE_PIXELS:,}" in refusal["message"]


@pytest.mark.parametrize("limit", [MAX_DECODE_PIXELS + 1])
def test_max_pixels_above_pillows_limit_is_refused_before_reading(tmp_path: Path, limit: int) -> None:
    result = runner.invoke(
        app, ["data", "import", str(tmp_path), "--out", str(tmp_path / "o"), "--max-pixels", str(limit)]
    )
    assert result.exit_code == 2 and "--max-pixels must be between 1 and 178,956,970" in result.output


def test_a_device_listed_in_a_table_is_not_a_regular_file(tmp_path: Path) -> None:
    picture(1).save(tmp_path / "a.jpg")
    table = tmp_path / "pairs.csv"
    table.write_text("path,caption\na.jpg,a picture\n/dev/zero,endless zeros\nnone.jpg,nothing here\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(table), "--out", str(out), "--allow-outside", "/dev"])
    assert result.exit_code == 0, result.output
    reasons = {r["source"]: r["reason"] for r in json.loads((out / REPORT).read_text())["refused_files"]}
    assert reasons == {
        "pairs.csv row 2: /dev/zero": "not_a_regular_file",
        "pairs.csv row 3: none.jpg": "image_missing",
    }


def test_a_second_import_into_the_same_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    import fcntl
    import os

    src = tmp_path / "src"
    src.mkdir()
    picture(1).save(src / "a.jpg")
    (src / "a.txt").write_text("a picture")
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".import.lock", "w") as held:  # the first import, still writing
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        result = runner.invoke(app, ["data", "import", str(src), "--out", str(out)])
        assert result.exit_code == 2 and "another import (process 4242) is writing into" in result.output
        assert sorted(os.listdir(out)) == [".import.lock"]  # nothing written beside it
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(out)])  # the first one ended
    assert result.exit_code == 0, result.output
    assert not (out / ".import.lock").exists() and (out / REPORT).is_file()
