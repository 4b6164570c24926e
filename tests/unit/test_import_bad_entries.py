"""Bad entries are refused one by one, each with its reason, and never stop an import (`compatflow data
import`): Karpathy entries a hostile file may hold, metadata a sidecar may hold, and the bound on captions
per picture enforced at import rather than at validation."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from PIL import Image

from compat.data.importer import MAX_CAPTIONS, MAX_SIDECAR_BYTES, REPORT, ImportSettings, import_images
from schemas import schema_errors


def picture(root: Path, name: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(root / name)


def refused(out: Path) -> dict[str, tuple[str, str]]:
    report = json.loads((out / REPORT).read_text())
    assert schema_errors(report, "stream_import") == []
    return {r["source"].split(":")[0]: (r["reason"], r["message"]) for r in report["refused_files"]}


def test_bad_karpathy_entries_are_refused_one_by_one_as_entry_invalid(tmp_path: Path) -> None:
    for i in range(6):
        picture(tmp_path, f"{i}.jpg", i)
    entry = '{"filename": "%d.jpg", "split": %s, "sentences": [{"raw": %s}]%s}'
    entries = [
        entry % (0, '"train"', '"a good one"', ""),
        entry % (1, '["train"]', '"split a list"', ""),
        entry % (2, '{"train": 1}', '"split an object"', ""),
        entry % (3, '"train"', '"a long imgid"', ', "imgid": ' + "9" * 5000),
        entry % (4, '"train"', '"a lone \\ud800 surrogate"', ""),
        json.dumps(
            {"filename": "5.jpg", "split": "val", "sentences": [{"raw": f"s {n}"} for n in range(200_000)]}
        ),
    ]
    (tmp_path / "dataset_coco.json").write_text('{"images": [' + ", ".join(entries) + "]}")
    out = tmp_path / "out"
    result = import_images(tmp_path / "dataset_coco.json", out, ImportSettings(source_format="karpathy"))
    assert result.imported == 1
    found = refused(out)
    assert {k: v[0] for k, v in found.items()} == {
        "dataset_coco.json image 2": "entry_invalid",
        "dataset_coco.json image 3": "entry_invalid",
        "dataset_coco.json image 4": "entry_invalid",
        "dataset_coco.json image 5": "entry_invalid",
        "dataset_coco.json image 6": "too_many_captions",
    }
    assert 'split ["train"] is not one of' in found["dataset_coco.json image 2"][1]
    assert "an integer of 5,000 digits (at most 19)" in found["dataset_coco.json image 4"][1]
    assert "lone surrogate" in found["dataset_coco.json image 5"][1]
    assert f"200,000 sentences, at most {MAX_CAPTIONS:,} per picture" in found["dataset_coco.json image 6"][1]


def test_a_sidecar_with_a_huge_integer_or_a_lone_surrogate_is_metadata_not_json(tmp_path: Path) -> None:
    for i, doc in enumerate(('{"id": %s}' % ("1" * 5000), '{"name": "\\udc00"}', '{"id": 7}')):
        picture(tmp_path, f"{i}.jpg", i)
        (tmp_path / f"{i}.txt").write_text(f"picture {i}")
        (tmp_path / f"{i}.json").write_text(doc)
    out = tmp_path / "out"
    assert import_images(tmp_path, out, ImportSettings()).imported == 1
    found = refused(out)
    assert {k: v[0] for k, v in found.items()} == {"0.jpg": "metadata_not_json", "1.jpg": "metadata_not_json"}
    assert "5,000 digits" in found["0.jpg"][1] and "lone surrogate" in found["1.jpg"][1]


def test_captions_per_picture_are_bounded_at_import(tmp_path: Path) -> None:
    """Rows past the bound are refused (one line each); a picture whose {key}.json would be over the
    validation policy's max_metadata_bytes is refused whole, at import, not quarantined at validation."""
    picture(tmp_path, "many.jpg", 0)
    picture(tmp_path, "big.jpg", 1)
    rows = [("many.jpg", f"caption {n}") for n in range(MAX_CAPTIONS + 2)]
    rows += [("big.jpg", f"{n} " + "x" * 60_000) for n in range(MAX_SIDECAR_BYTES // 60_000 + 1)]
    with open(tmp_path / "pairs.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "caption"), *rows])
    out = tmp_path / "out"
    result = import_images(tmp_path / "pairs.csv", out, ImportSettings(source_format="table"))
    assert result.imported == 1 and result.report["captions"] == MAX_CAPTIONS
    reasons = [(r["reason"], r["source"]) for r in result.report["refused_files"]]
    assert reasons[:2] == [
        ("too_many_captions", f"pairs.csv row {MAX_CAPTIONS + 1}: many.jpg"),
        ("too_many_captions", f"pairs.csv row {MAX_CAPTIONS + 2}: many.jpg"),
    ]
    assert reasons[2:] == [("sample_too_large", "big.jpg")]
    assert schema_errors(result.report, "stream_import") == []
