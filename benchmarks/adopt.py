"""Adopting a team's collection (``compatflow adopt``) against its size: the proof and the copy with lineage.

For each size N: a collection of N rows with its own field names (``pk`` INT64, ``emb``, ``url``) whose
vectors a tiny open_clip checkpoint made from 64 images (row i shows image i mod 64, so every sample proves),
then :func:`components.adoption.adopt` into a fresh workspace, in a process of its own; "peak" is that
process's VmHWM (the Milvus server's own memory is not counted). Seconds per item are given for the proof
(per sampled item) and for the copy (rows, order keys and Feast lineage, per item), with the copy projected
to 1B items in one process.

    .venv/bin/python benchmarks/adopt.py --sizes 10000,100000 [--backend lite] --json /tmp/adopt.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repo's benchmarks package is importable
    sys.path.insert(0, str(ROOT))
TINY = {  # the shape of cf-tiny
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
N_IMAGES = 64
CHUNK = 10_000


def team_model(root: Path) -> tuple[Path, np.ndarray]:
    """A checkpoint open_clip writes and the vectors it makes of :data:`N_IMAGES` images under ``root``."""
    import open_clip
    import torch
    from PIL import Image

    torch.manual_seed(0)
    model = open_clip.CLIP(**TINY).eval()
    weights = root / "team_clip.pt"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, weights)
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    images = []
    for i in range(N_IMAGES):
        images.append(Image.fromarray(rng.integers(0, 255, size=(64, 64, 3), dtype=np.uint8)))
        images[-1].save(root / "images" / f"{i}.png")
    preprocess = open_clip.image_transform(64, is_train=False)
    with torch.no_grad():
        pixels = torch.stack([preprocess(image) for image in images])
        vectors = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1).numpy()
    return weights, vectors


def build(uri: str, name: str, size: int, root: Path, vectors: np.ndarray) -> None:
    """The team's collection of ``size`` rows at ``uri``, loaded."""
    from pymilvus import DataType, MilvusClient

    from components.adapters.index import GalleryIndex

    with GalleryIndex(uri) as index:
        client = index.client
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("pk", DataType.INT64, is_primary=True)
        schema.add_field("emb", DataType.FLOAT_VECTOR, dim=vectors.shape[1])
        schema.add_field("url", DataType.VARCHAR, max_length=512)
        params = client.prepare_index_params()
        params.add_index(
            field_name="emb", index_type="HNSW", metric_type="COSINE", params={"M": 8, "efConstruction": 64}
        )
        client.create_collection(name, schema=schema, index_params=params)
        for start in range(0, size, CHUNK):
            client.insert(
                name,
                [
                    {
                        "pk": i,
                        "emb": vectors[i % N_IMAGES].tolist(),
                        "url": str(root / "images" / f"{i % N_IMAGES}.png"),
                    }
                    for i in range(start, min(size, start + CHUNK))
                ],
            )
        client.flush(name)


def child(uri: str, name: str, workspace: Path, weights: str, index_uri: str) -> dict[str, Any]:
    """One adoption in this process (the team's collection loaded first, as its service keeps it)."""
    from compat.proc import peak_rss_mib
    from components.adapters.index import GalleryIndex
    from components.adoption import Source, adopt
    from components.state.workspace import DEFAULT_MODEL_NAME, Workspace

    with GalleryIndex(uri) as team:  # held open: milvus-lite keeps the load while a client is open
        team.client.load_collection(name)
        t0 = time.perf_counter()
        summary = adopt(
            Workspace(workspace, index_uri=index_uri, index_alias=f"{name}_gallery"),
            Source(uri, name, "pk", "emb", image_field="url"),
            arch="cf-tiny",
            weights=weights,
            model_name=DEFAULT_MODEL_NAME,
        )
        wall = time.perf_counter() - t0
    return {
        "wall_seconds": round(wall, 2),
        "n_items": summary["n_items"],
        "n_sample": summary["proof"]["n_sample"],
        "proof_seconds": round(summary["seconds"]["proof"], 2),
        "copy_seconds": round(summary["seconds"]["copy"], 2),
        "cosine_median": summary["proof"]["cosine_median"],
        "peak_rss_mib": peak_rss_mib(),
    }


def measure(size: int, root: Path, backend: str, uri: str, weights: Path, vectors: np.ndarray) -> dict:
    name = f"team_n{size}"
    team_uri = uri if backend == "standalone" else str(root / f"{name}.db")
    build(team_uri, name, size, root, vectors)
    index_uri = uri if backend == "standalone" else str(root / f"ws_n{size}" / "gallery.db")
    argv = [
        sys.executable,
        __file__,
        "--child",
        team_uri,
        "--name",
        name,
        "--workspace",
        str(root / f"ws_n{size}"),
    ]
    argv += ["--weights", str(weights), "--index-uri", index_uri]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"adoption of {size} failed:\n{done.stderr[-3000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    record = {"backend": backend, "size": size, **doc}
    print(json.dumps(record), flush=True)
    return record


def table(records: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| backend | items | wall s | proof s (sample) | proof s/sampled item | copy s | copy us/item | "
        "copy at 1B, one process | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        per_item = r["copy_seconds"] / r["n_items"]
        lines.append(
            f"| {r['backend']} | {r['size']:,} | {r['wall_seconds']} | {r['proof_seconds']} "
            f"({r['n_sample']}) | {r['proof_seconds'] / r['n_sample']:.3f} | {r['copy_seconds']} | "
            f"{1e6 * per_item:.0f} | {per_item * 1e9 / 86400:.1f} days | {r['peak_rss_mib']} |"
        )
    if len(records) >= 2:  # the copy's cost per added item, between the two largest sizes: what 1B pays
        a, b = sorted(records, key=lambda r: r["size"])[-2:]
        marginal = (b["copy_seconds"] - a["copy_seconds"]) / (b["size"] - a["size"])
        lines.append(
            f"\nMarginal copy cost {1e6 * marginal:.0f} us/item ({a['size']:,} -> {b['size']:,}): "
            f"{marginal * 1e9 / 86400:.1f} days for 1B items in one process; peak RSS "
            f"{a['peak_rss_mib']} -> {b['peak_rss_mib']} MB."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.sections import print_records, sizes_parser

    parser = sizes_parser(__doc__)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--index-uri", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.name, args.workspace, args.weights, args.index_uri)))
        return 0
    records = []
    with tempfile.TemporaryDirectory(prefix="adopt-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        uri = ""
        if args.backend == "standalone":
            from benchmarks.gallery_scale import milvus_standalone

            uri = stack.enter_context(milvus_standalone(root / "milvus")).uri
        weights, vectors = team_model(root)
        for size in (int(s) for s in args.sizes.split(",")):
            records.append(measure(size, root, args.backend, uri, weights, vectors))
    print_records(table(records), records, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
