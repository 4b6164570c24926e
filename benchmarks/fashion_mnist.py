"""A real-photo stream: Debian's Fashion-MNIST as a class-incremental stream of captioned webdataset shards.

The ``dataset-fashion-mnist`` package (MIT; ``apt-get install -y dataset-fashion-mnist``) installs
``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` under ``/usr/share/datasets/fashion-mnist/``: 60,000 +
10,000 grayscale 28x28 product photos in 10 classes, in the IDX format (big-endian header: magic 2051 and
count, rows, cols for images; magic 2049 and count for labels; then one byte per pixel or label).
:func:`build_stream` writes them as a stream directory in the synthetic stream's layout and manifest
(``stream.json``, ``phase-PP/{train,eval,gallery}/shard-NNNNN.tar``, members ``{key}.jpg/.txt/.json``): phase
``p`` holds ``classes_per_phase`` classes (5 phases of 2 by default), train pairs from the training file,
eval and gallery pairs from the test file (disjoint), each image with five caption templates ("a photo of
a dress", ...). Nothing is downloaded: without the package the builder says how to install it and stops.

    .venv/bin/python benchmarks/fashion_mnist.py --out /tmp/fashion-stream [--train-per-class 600]

:func:`class_accuracy` scores a model as a zero-shot classifier over the class prompts (the metric of
class-incremental CLIP studies; retrieval R@1 is ill-posed when every image of a class shares its captions).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
PACKAGE = "dataset-fashion-mnist"
INSTALL = f"apt-get install -y {PACKAGE}"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "t10k": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# the dataset's class names (T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag,
# Ankle boot) as caption words
LABELS = (
    "t-shirt",
    "pair of trousers",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
TEMPLATES = (
    "a photo of {a} {label}",
    "a product photo of {a} {label}",
    "a black and white photo of {a} {label}",
    "a small photo of {a} {label}",
    "{A} {label}, photographed for a catalogue",
)
JPEG_QUALITY = 90
BUILDER_VERSION = 1
PENDING = ".building.json"


class FashionMNISTMissing(FileNotFoundError):
    """The Fashion-MNIST files are not installed; the message says how to install them."""


def captions(label: str) -> list[str]:
    """The five captions of an image of ``label``, in template order."""
    a = "an" if label[:1] in "aeiou" else "a"
    return [t.format(a=a, A=a.capitalize(), label=label) for t in TEMPLATES]


def _read_idx(path: Path, magic: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    found, count = struct.unpack(">II", data[:8])
    if found != magic:
        raise ValueError(f"{path}: IDX magic {found}, expected {magic}")
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, rows, cols)
    return np.frombuffer(data, dtype=np.uint8, offset=8)[:count]


def load_split(data_dir: str | os.PathLike[str], split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 28, 28]`` uint8 and labels ``[N]`` of ``train`` or ``t10k``; raises
    :class:`FashionMNISTMissing` naming the package when a file is absent."""
    root = Path(data_dir)
    images_name, labels_name = FILES[split]
    missing = [n for n in (images_name, labels_name) if not (root / n).is_file()]
    if missing:
        raise FashionMNISTMissing(
            f"Fashion-MNIST not found: {root / missing[0]} is missing. Install Debian's {PACKAGE} package "
            f"(`{INSTALL}`, as root) or pass --data-dir with its four .gz files; nothing is downloaded."
        )
    images = _read_idx(root / images_name, 2051)
    labels = _read_idx(root / labels_name, 2049)
    if len(images) != len(labels):
        raise ValueError(f"{root}: {len(images)} images but {len(labels)} labels in {split}")
    return images, labels


def _pick(labels: np.ndarray, cls: int, n: int | None, rng: random.Random) -> list[int]:
    """``n`` (``None``: all) indices of class ``cls``, in a seeded random order."""
    idx = [int(i) for i in np.flatnonzero(labels == cls)]
    rng.shuffle(idx)
    return idx if n is None else idx[:n]


def _sample(
    image: np.ndarray,
    label_id: int,
    key: str,
    split: str,
    phase: int,
    domain: str,
    source: str,
    index: int,
    image_size: int,
    rng: random.Random,
) -> tuple[str, dict[str, bytes]]:
    from PIL import Image

    img = Image.fromarray(image, "L")
    if image_size != img.width:
        img = img.resize((image_size, image_size), Image.BICUBIC)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    jpg = buf.getvalue()
    caps = captions(LABELS[label_id])
    if split == "train":
        rng.shuffle(caps)
    meta = {
        "key": key,
        "caption": caps[0],
        "captions": caps,
        "width": image_size,
        "height": image_size,
        "original_width": int(image.shape[1]),
        "original_height": int(image.shape[0]),
        "sha256": hashlib.sha256(jpg).hexdigest(),
        "status": "success",
        "phase": phase,
        "domain": domain,
        "split": split,
        "label": LABELS[label_id],
        "class_id": label_id,
        "source": source,
        "source_index": index,
    }
    members = {
        "jpg": jpg,
        "txt": caps[0].encode("utf-8"),
        "json": json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
    }
    return key, members


def build_stream(
    out_dir: str | os.PathLike[str],
    data_dir: str | os.PathLike[str] = DEFAULT_DIR,
    *,
    classes_per_phase: int = 2,
    class_order: list[int] | None = None,
    train_per_class: int | None = 1000,
    eval_per_class: int = 100,
    gallery_per_class: int = 200,
    image_size: int = 64,
    samples_per_shard: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the class-incremental Fashion-MNIST stream into ``out_dir``; return its manifest.

    ``class_order`` (default 0..9) is cut into phases of ``classes_per_phase`` classes; each class gives
    ``train_per_class`` training pairs (``None``: all 6,000) and ``eval_per_class`` + ``gallery_per_class``
    test-file pairs, chosen by a seeded shuffle and interleaved across the phase's classes. Deterministic
    (same files and settings, same bytes); a complete stream with the same settings is left untouched, an
    interrupted one is completed (shards are written atomically), other settings raise ``StreamError``.
    """
    from compat.data.manifest import FORMAT, MANIFEST, VERSION, StreamError, check_manifest
    from compat.data.shards import write_shard
    from compat.io import write_json_atomic

    order = list(range(len(LABELS))) if class_order is None else [int(c) for c in class_order]
    if sorted(set(order)) != sorted(order) or not all(0 <= c < len(LABELS) for c in order):
        raise ValueError(f"class_order must list distinct classes 0..{len(LABELS) - 1}, got {order}")
    if classes_per_phase < 1 or len(order) % classes_per_phase:
        raise ValueError(f"{len(order)} classes do not split into phases of {classes_per_phase}")
    for name, value in (("eval_per_class", eval_per_class), ("gallery_per_class", gallery_per_class)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    settings = {
        "builder": "benchmarks/fashion_mnist.py",
        "builder_version": BUILDER_VERSION,
        "classes_per_phase": classes_per_phase,
        "class_order": order,
        "train_per_class": train_per_class,
        "eval_per_class": eval_per_class,
        "gallery_per_class": gallery_per_class,
        "image_size": image_size,
        "samples_per_shard": samples_per_shard,
        "seed": seed,
    }
    out = Path(out_dir)
    for marker in (out / MANIFEST, out / PENDING):
        if marker.is_file():
            found = json.loads(marker.read_text())
            found = found.get("fashion_mnist", found) if marker.name == MANIFEST else found
            if found != settings:
                raise StreamError(
                    f"{marker} was built with other settings; use another directory or delete it"
                )
    train_images, train_labels = load_split(data_dir, "train")
    test_images, test_labels = load_split(data_dir, "t10k")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / PENDING, settings)
    phases = []
    for phase, start in enumerate(range(0, len(order), classes_per_phase)):
        classes = order[start : start + classes_per_phase]
        names = [LABELS[c] for c in classes]
        domain = "fashion-" + "-".join(n.replace(" ", "-") for n in names)
        rng = random.Random(f"compatflow-fashion/{seed}/{phase}")
        test_idx = {c: _pick(test_labels, c, None, rng) for c in classes}  # eval, then gallery: disjoint
        picks = {
            "train": [("train", i) for c in classes for i in _pick(train_labels, c, train_per_class, rng)],
            "eval": [("t10k", i) for c in classes for i in test_idx[c][:eval_per_class]],
            "gallery": [
                ("t10k", i)
                for c in classes
                for i in test_idx[c][eval_per_class : eval_per_class + gallery_per_class]
            ],
        }
        entry: dict[str, Any] = {
            "phase": phase,
            "domain": domain,
            "description": f"Fashion-MNIST classes {', '.join(names)}: real 28x28 product photos "
            f"(upscaled to {image_size}), captions from {len(TEMPLATES)} templates",
            "classes": names,
        }
        for split, items in picks.items():
            rng.shuffle(items)
            shards = []
            for s, first in enumerate(range(0, len(items), samples_per_shard)):
                rel = f"phase-{phase:02d}/{split}/shard-{s:05d}.tar"
                shards.append(rel)
                if (out / rel).is_file():
                    continue
                chunk = items[first : first + samples_per_shard]
                srng = random.Random(f"compatflow-fashion/{seed}/{phase}/{split}/{s}")
                samples = (
                    _sample(
                        (train_images if src == "train" else test_images)[i],
                        int((train_labels if src == "train" else test_labels)[i]),
                        f"p{phase:02d}-{split}-{first + n:06d}",
                        split,
                        phase,
                        domain,
                        f"fashion-mnist/{src}",
                        i,
                        image_size,
                        srng,
                    )
                    for n, (src, i) in enumerate(chunk)
                )
                write_shard(out / rel, samples)
            entry[split] = shards
        entry["counts"] = {split: len(items) for split, items in picks.items()}
        phases.append(entry)
    manifest = {"format": FORMAT, "version": VERSION, "fashion_mnist": settings, "phases": phases}
    check_manifest(manifest, out / MANIFEST)
    write_json_atomic(out / MANIFEST, manifest)
    (out / PENDING).unlink()
    return manifest


def class_accuracy(
    bundle: Any, images: list[Any], labels: list[str], class_names: list[str], device: str = "cpu"
) -> float:
    """Top-1 accuracy (%) of ``bundle`` (a :class:`compat.models.ClipBundle`) as a zero-shot classifier of
    ``images`` over ``class_names``: each class is the normalised mean of its template captions' embeddings;
    ``labels`` are the images' true class names."""
    import torch.nn.functional as F

    texts = bundle.encode_texts([c for name in class_names for c in captions(name)], device=device)
    protos = F.normalize(texts.view(len(class_names), len(TEMPLATES), -1).mean(1), dim=-1)
    pred = (bundle.encode_images(images, device=device) @ protos.T).argmax(1).tolist()
    correct = sum(class_names[p] == y for p, y in zip(pred, labels, strict=True))
    return 100.0 * correct / max(len(images), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="stream directory to write")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DIR, help=f"the {PACKAGE} files")
    p.add_argument("--classes-per-phase", type=int, default=2)
    p.add_argument("--class-order", default="", help="comma-separated class ids (default 0..9)")
    p.add_argument("--train-per-class", type=int, default=1000, help="0: all 6000")
    p.add_argument("--eval-per-class", type=int, default=100)
    p.add_argument("--gallery-per-class", type=int, default=200)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from compat.data.manifest import StreamError

    try:
        manifest = build_stream(
            args.out,
            args.data_dir,
            classes_per_phase=args.classes_per_phase,
            class_order=[int(c) for c in args.class_order.split(",")] if args.class_order else None,
            train_per_class=args.train_per_class or None,
            eval_per_class=args.eval_per_class,
            gallery_per_class=args.gallery_per_class,
            image_size=args.image_size,
            samples_per_shard=args.samples_per_shard,
            seed=args.seed,
        )
    except FashionMNISTMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StreamError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = [
        {"phase": e["phase"], "domain": e["domain"], "counts": e["counts"]} for e in manifest["phases"]
    ]
    print(json.dumps({"out": str(args.out), "phases": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
