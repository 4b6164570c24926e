"""The Fashion-MNIST stream builder (benchmarks/fashion_mnist.py) on a tiny fake dataset in the package's IDX
format: manifest and layout, classes per phase, captions, disjoint splits, determinism, the missing-package
message."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks import fashion_mnist as fm
from compat.data.loader import load_captioned_set
from compat.data.manifest import load_manifest, phase_urls
from compat.data.shards import iter_raw_samples
from schemas import schema_errors


def write_idx(root: Path, split: str, per_class: int, seed: int) -> np.ndarray:
    """A fake ``split`` of ``per_class`` random 28x28 images per class, in the package's gzipped IDX files."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(10, dtype=np.uint8), per_class)
    rng.shuffle(labels)
    images = rng.integers(0, 256, size=(len(labels), 28, 28), dtype=np.uint8)
    image_name, label_name = fm.FILES[split]
    with gzip.open(root / image_name, "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), 28, 28) + images.tobytes())
    with gzip.open(root / label_name, "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.tobytes())
    return images


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fashion-mnist")
    write_idx(root, "train", 8, 0)
    write_idx(root, "t10k", 6, 1)
    return root


ARGS = dict(train_per_class=5, eval_per_class=2, gallery_per_class=3, samples_per_shard=4)


def samples(stream: Path, phase: int, split: str) -> list[tuple[dict, bytes]]:
    return [
        (json.loads(s.members["json"]), s.members["jpg"])
        for url in phase_urls(stream, phase, split)
        for s in iter_raw_samples(url)
    ]


def test_class_incremental_stream_in_the_synthetic_layout(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stream"
    manifest = fm.build_stream(out, data_dir, image_size=28, **ARGS)
    assert load_manifest(out) == manifest and len(manifest["phases"]) == 5
    seen_test: set[int] = set()
    for entry in manifest["phases"]:
        p = entry["phase"]
        classes = [fm.LABELS[2 * p], fm.LABELS[2 * p + 1]]
        assert entry["classes"] == classes
        assert entry["counts"] == {"train": 10, "eval": 4, "gallery": 6}
        assert entry["train"] == [f"phase-{p:02d}/train/shard-{n:05d}.tar" for n in range(3)]
        split_sources = {}
        for split in ("train", "eval", "gallery"):
            rows = samples(out, p, split)
            assert [m["key"] for m, _ in rows] == [f"p{p:02d}-{split}-{i:06d}" for i in range(len(rows))]
            for meta, jpg in rows:
                assert schema_errors(meta, "sample") == []
                assert meta["label"] in classes and meta["class_id"] == fm.LABELS.index(meta["label"])
                assert sorted(meta["captions"]) == sorted(fm.captions(meta["label"]))
                assert meta["sha256"] == hashlib.sha256(jpg).hexdigest()
                pixels = np.asarray(Image.open(io.BytesIO(jpg)).convert("L"), dtype=np.int16)
                assert pixels.shape == (28, 28)
                assert meta["source"] == ("fashion-mnist/train" if split == "train" else "fashion-mnist/t10k")
            assert sorted({m["label"] for m, _ in rows}) == sorted(classes)
            split_sources[split] = {m["source_index"] for m, _ in rows}
        assert not split_sources["eval"] & split_sources["gallery"]
        assert not (split_sources["eval"] | split_sources["gallery"]) & seen_test
        seen_test |= split_sources["eval"] | split_sources["gallery"]
    evalset = load_captioned_set(phase_urls(out, 4, "eval"))
    assert len(evalset.images) == 4 and evalset.captions[0][0] in fm.captions(evalset.metas[0]["label"])
    assert fm.captions("ankle boot")[0] == "a photo of an ankle boot"


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_resumable_and_settings_kept(data_dir: Path, tmp_path: Path) -> None:
    from compat.data.manifest import StreamError

    a, b = tmp_path / "a", tmp_path / "b"
    fm.build_stream(a, data_dir, class_order=[9, 8, 7, 6], classes_per_phase=2, image_size=32, **ARGS)
    fm.build_stream(b, data_dir, class_order=[9, 8, 7, 6], classes_per_phase=2, image_size=32, **ARGS)
    assert tree_bytes(a) == tree_bytes(b)
    assert [e["classes"] for e in load_manifest(a)["phases"]] == [["ankle boot", "bag"], ["sneaker", "shirt"]]
    (b / "phase-01/eval/shard-00000.tar").unlink()
    fm.build_stream(b, data_dir, class_order=[9, 8, 7, 6], classes_per_phase=2, image_size=32, **ARGS)
    assert tree_bytes(a) == tree_bytes(b)
    with pytest.raises(StreamError, match="other settings"):
        fm.build_stream(a, data_dir, class_order=[9, 8, 7, 6], image_size=32, **{**ARGS, "eval_per_class": 1})
    with pytest.raises(ValueError, match="do not split"):
        fm.build_stream(tmp_path / "c", data_dir, classes_per_phase=3)


def test_missing_package_says_how_to_install_and_exits_non_zero(tmp_path: Path, capsys) -> None:
    assert fm.main(["--out", str(tmp_path / "s"), "--data-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "apt-get install -y dataset-fashion-mnist" in err and "nothing is downloaded" in err
    assert not (tmp_path / "s").exists()
