"""Lineage sync after a rollout, against the gallery's size: the streamed sync beside the whole-gallery read
it replaced.

For each size N: a gallery of N items (Milvus standalone on loopback, or milvus-lite) indexed by v1 and
then by v2 (the alias on v2's collection, as after a rollout), the lineage recording v1 for every item.
Each sync runs in a process of its own on its own copy of the lineage repo; "peak" is that process's VmHWM.

- ``streamed``: :func:`components.adapters.lineage.sync_from_index` (2,000 index rows a batch, each compared
with Feast's online store by key, the changed ones written);
- ``whole read`` (the baseline, as the sync was built before): every index row into a list of dicts, the
  newest offline lineage row per item into pandas, one comparison loop, one write.

Then each syncs again with nothing changed (what a rollback that restored nothing leaves to do).

    .venv/bin/python benchmarks/lineage_sync.py --sizes 10000,100000,300000 --json /tmp/lineage_sync.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compat.proc import peak_rss_mib

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repo's benchmarks package is importable
    sys.path.insert(0, str(ROOT))
MODES = ("streamed", "whole read")
CHUNK = 20_000


def build(workspace: Path, size: int, uri: str, alias: str) -> None:
    """A gallery of ``size`` items at ``uri`` whose ``alias`` serves v2's collection, and a lineage repo
    that records v1 for each."""
    from components.adapters.index import GalleryIndex
    from components.adapters.lineage import LineageStore

    lineage = LineageStore(workspace / "feast")
    lineage.apply()
    with GalleryIndex(uri, alias) as index:
        for version in ("1", "2"):
            collection = index.create_collection("space", 8)
            for start in range(0, size, CHUNK):
                ids = [f"item-{i:010d}" for i in range(start, min(size, start + CHUNK))]
                vectors = np.random.default_rng(start).standard_normal((len(ids), 8)).astype(np.float32)
                index.index_items(ids, vectors, version, "space", collection=collection)
                if version == "1":
                    lineage.write_items(
                        {"item_id": i, "model_version": "1", "space_id": "space", "caption": f"c {i}"}
                        for i in ids
                    )
        index.switch_alias(collection)


def whole_read_sync(repo: Path, uri: str, alias: str) -> int:
    """The baseline: the sync as built before it streamed (every row of the gallery and of the lineage held
    at once)."""
    import pandas as pd
    import pyarrow.dataset as ds

    from components.adapters.index import GalleryIndex
    from components.adapters.lineage import LineageStore, _arrow_schema

    with GalleryIndex(uri, alias) as index:
        fields = ("model_version", "space_id", "embedded_at", "phase", "source_uri")
        rows = [row for batch in index.iter_rows(fields) for row in batch]
    store = LineageStore(repo)
    store.apply()
    parts = [str(p) for p in sorted(store.items_dir.glob("*.parquet"))]
    frame = ds.dataset(parts, format="parquet", schema=_arrow_schema()).to_table().to_pandas()
    frame = frame.sort_values(["written_at", "embedded_at"], kind="stable")
    latest = frame.drop_duplicates("item_id", keep="last").set_index("item_id")
    changed = []
    for row in rows:
        item = str(row["item_id"])
        known = latest.loc[item] if item in latest.index else None
        version, space = str(row["model_version"]), str(row["space_id"])
        if known is not None and (known["model_version"], known["space_id"]) == (version, space):
            continue
        changed.append(
            {
                "item_id": item,
                "model_version": version,
                "space_id": space,
                "embedded_at": pd.to_datetime(int(row["embedded_at"]), unit="ms", utc=True),
                "phase": row.get("phase"),
                "caption": None if known is None else known["caption"],
                "image_uri": row.get("source_uri") if known is None else known["image_uri"],
                "domain": None if known is None else known["domain"],
            }
        )
    return store.write_items(changed)


def child(mode: str, repo: Path, uri: str, alias: str) -> dict[str, Any]:
    """Two syncs in this process (the first writes every item, the second nothing); seconds and peak."""
    from components.adapters.lineage import sync_from_index

    def sync() -> int:
        if mode == "streamed":
            return sync_from_index(repo, uri, alias)
        return whole_read_sync(repo, uri, alias)

    t0 = time.perf_counter()
    written = sync()
    first = time.perf_counter() - t0
    peak = peak_rss_mib()
    t0 = time.perf_counter()
    again = sync()
    return {
        "seconds": round(first, 2),
        "written": written,
        "peak_rss_mib": peak,
        "again_seconds": round(time.perf_counter() - t0, 2),
        "again_written": again,
        "again_peak_rss_mib": peak_rss_mib(),
    }


def measure(size: int, root: Path, backend: str, server_uri: str | None) -> list[dict[str, Any]]:
    workspace = root / f"n{size}"
    uri, alias = server_uri or str(workspace / "milvus.db"), f"gallery_n{size}"
    t0 = time.perf_counter()
    build(workspace, size, uri, alias)
    built = time.perf_counter() - t0
    records = []
    for mode in MODES:
        repo = workspace / f"feast-{mode.replace(' ', '-')}"
        shutil.copytree(workspace / "feast", repo)
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--repo", str(repo), "--uri", uri, "--alias", alias],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{mode} at {size} failed:\n{done.stderr[-3000:]}")
        doc = json.loads(done.stdout.strip().splitlines()[-1])
        records.append(
            {"size": size, "backend": backend, "mode": mode, "build_seconds": round(built, 1), **doc}
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def table(records: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| backend | items | sync | s | us/item | peak RSS MB | rows written | again: s | again: peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['backend']} | {r['size']:,} | {r['mode']} | {r['seconds']} | "
            f"{1e6 * r['seconds'] / r['size']:.0f} | "
            f"{r['peak_rss_mib']} | {r['written']:,} | {r['again_seconds']} | {r['again_peak_rss_mib']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.sections import print_records, sizes_parser

    parser = sizes_parser(__doc__)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--repo", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--alias", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repo, args.uri, args.alias)))
        return 0
    records = []
    with tempfile.TemporaryDirectory(prefix="lineage-sync-") as root, contextlib.ExitStack() as stack:
        server_uri = None
        if args.backend == "standalone":
            from benchmarks.gallery_scale import milvus_standalone

            server_uri = stack.enter_context(milvus_standalone(Path(root) / "milvus")).uri
        for size in (int(s) for s in args.sizes.split(",")):
            records += measure(size, Path(root), args.backend, server_uri)
    print_records(table(records), records, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
