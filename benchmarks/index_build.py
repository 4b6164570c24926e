"""What the gallery's HNSW settings cost Milvus to build, against the recall they give, side by side.

On one Milvus standalone server (the PyPI 2.3.5 server, loopback only), for each setting a fresh collection
of the rollout's row schema receives N stand-in vectors (64-d, inserts in batches of 1,024, as a rollout
writes its own collection); the figure is the server's CPU (user + system, from /proc) from the first write
until every row is indexed and the server is idle again (its compactions, which merge the sealed segments
and index the merged ones again, included), less its idle rate. Recall@10 of 200 queries (gallery vectors
with noise) against an exact search, at several search ``ef``, with the search's milliseconds per query.

    .venv/bin/python benchmarks/index_build.py --sizes 1000000 --settings 16/200,16/64

Needs root (a private loopback-only network namespace, :mod:`components.adapters.milvus_server`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gallery_scale import milvus_standalone, report, settle, stand_in_vectors  # noqa: E402
from compat.proc import cpu_seconds  # noqa: E402

DIM = 64
SEARCH_EF = (64, 128, 256)


def _queries(gallery: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """200 noisy gallery vectors and their exact top 10 (the recall's reference, computed once)."""
    rng = np.random.default_rng(1)
    queries = gallery[rng.choice(len(gallery), 200, replace=False)]
    queries = queries + 0.05 * rng.normal(size=queries.shape).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return queries, np.argsort(-(queries @ gallery.T), axis=1)[:, :10]


def _recall(index: Any, name: str, queries: np.ndarray, exact: np.ndarray, ef: int) -> tuple[float, float]:
    """Recall@10 of ``queries`` against their ``exact`` top 10 at search ``ef``; milliseconds a query."""
    t0 = time.monotonic()
    hits = index.client.search(
        name, data=queries.tolist(), limit=10, output_fields=[], search_params={"params": {"ef": ef}}
    )
    ms = 1000 * (time.monotonic() - t0) / len(queries)
    found = [len({int(h["id"][5:]) for h in row} & set(exact[i].tolist())) for i, row in enumerate(hits)]
    return float(np.mean(found)) / 10, ms


def measure(server: Any, size: int, m: int, ef_construction: int) -> dict[str, Any]:
    """One fresh collection of ``size`` rows built with HNSW (``m``, ``ef_construction``)."""
    from pymilvus import connections, utility

    from components.adapters.index import GalleryIndex, make_rows

    pid = server.process.pid
    with GalleryIndex(server.uri, f"build{size}m{m}ef{ef_construction}") as index:
        for name in index.client.list_collections():
            index.client.drop_collection(name)
        idle_rate = settle(pid)
        name = index.create_collection("s", DIM, hnsw_m=m, ef_construction=ef_construction)
        c0, t0 = cpu_seconds(pid), time.monotonic()
        parts = []
        for start in range(0, size, 20_000):
            ids = [f"item-{i:010d}" for i in range(start, min(size, start + 20_000))]
            parts.append(stand_in_vectors(ids, "new", DIM))
            rows = make_rows(ids, parts[-1], "v2", "s", dim=DIM)
            for s in range(0, len(rows), 1024):
                index.client.insert(name, rows[s : s + 1024])
        index.client.flush(name)
        index.wait_indexed(name, timeout_s=3600)
        indexed_s = time.monotonic() - t0
        settle(pid)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(pid) - c0 - idle_rate * wall
        connections.connect("segments", uri=server.uri)
        try:
            segments = [int(s.num_rows) for s in utility.get_query_segment_info(name, using="segments")]
        finally:
            connections.disconnect("segments")
        queries, exact = _queries(np.concatenate(parts))
        search = {ef: _recall(index, name, queries, exact, ef) for ef in SEARCH_EF}
        index.client.drop_collection(name)
    return {
        "size": size,
        "hnsw_m": m,
        "ef_construction": ef_construction,
        "indexed_seconds": round(indexed_s, 1),
        "seconds": round(wall, 1),
        "milvus_cpu_s": round(cpu, 1),
        "milvus_cpu_ms_per_row": round(1000 * cpu / size, 3),
        "segments": sorted(segments),
        **{f"recall10_ef{ef}": round(r, 3) for ef, (r, _) in search.items()},
        **{f"search_ms_ef{ef}": round(ms, 2) for ef, (_, ms) in search.items()},
    }


def table(records: Sequence[dict[str, Any]]) -> str:
    cols = ["items", "M / efConstruction", "to indexed s", "Milvus CPU s", "Milvus CPU ms/row", "segments"]
    cols += [f"recall@10, ef {ef} (ms/query)" for ef in SEARCH_EF]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        cells = [
            f"{r['size']:,}",
            f"{r['hnsw_m']} / {r['ef_construction']}",
            r["indexed_seconds"],
            r["milvus_cpu_s"],
            r["milvus_cpu_ms_per_row"],
            len(r["segments"]),
        ]
        cells += [f"{r[f'recall10_ef{ef}']} ({r[f'search_ms_ef{ef}']})" for ef in SEARCH_EF]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200000,1000000")
    parser.add_argument("--settings", default="16/200,16/64", help="HNSW M/efConstruction pairs")
    parser.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    args = parser.parse_args(argv)
    settings = [tuple(int(x) for x in s.split("/")) for s in args.settings.split(",")]
    records = []
    with tempfile.TemporaryDirectory(prefix="compatflow-build-") as tmp:
        with milvus_standalone(Path(tmp) / "milvus") as server:
            for size in (int(s) for s in args.sizes.split(",")):
                for m, ef in settings:
                    records.append(measure(server, size, m, ef))
                    print(json.dumps(records[-1]), flush=True)
    return report(records, table(records), args)


if __name__ == "__main__":
    sys.exit(main())
