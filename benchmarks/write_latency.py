"""What index writes cost users' queries: query latency on a milvus-lite server while rows are written at a
fixed rate, through the rollout's own write path (:class:`components.rollout.writes.GalleryWriter` capped by
:class:`components.rollout.pacing.Pace`).

A query process searches the gallery (one vector, k=10) at a fixed open-loop rate, latency counted from
when each query was due; meanwhile this process rewrites rows at each rate of ``RATES`` in two write shapes:
the unpaced one (whole batches of 256 rows, a flush every 1,024) and the paced one (32 rows per upsert, a
flush every 256). A table of single operations (how long one call holds the server) comes first: Milvus
answers one call at a time, so a query that arrives during a call waits for it.

Run: ``.venv/bin/python benchmarks/write_latency.py`` (about 3 minutes; writes
benchmarks/results/write_latency.md). Measure on a quiet machine: other work on the cores is in the figures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "write_latency.md"
RATES = (50.0, 100.0, 200.0, 400.0, None)  # rows/s written; None: as fast as it goes
SHAPES = {"unpaced shape (256 / 1,024)": (256, 1024), "paced shape (32 / 256)": (32, 256)}


def _queries(uri: str, alias: str, vectors: np.ndarray, rate: float, stop: Any, out: Any) -> None:
    """Open-loop searches: query i is due at t0 + i/rate; records (due wall time, latency from due in ms)."""
    from components.adapters.index import GalleryIndex

    index = GalleryIndex(uri, alias)
    records = []
    t0, i = time.monotonic(), 0
    while not stop.is_set():
        due = t0 + i / rate
        time.sleep(max(0.0, due - time.monotonic()))
        index.search(vectors[i % len(vectors)][None], k=10)
        records.append((time.time() - (time.monotonic() - due), 1000 * (time.monotonic() - due)))
        i += 1
    index.close()
    out.put(records)


def _timed(fn: Any, repeat: int = 8) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def single_operations(index: Any, collection: str, rows: list[dict], queries: np.ndarray) -> list[tuple]:
    """Median wall time of one call of each kind (no other load)."""
    out = []
    for n in (32, 256):
        out.append((f"upsert of {n} rows", _timed(lambda n=n: index.upsert(rows[:n], collection))))
    for n in (256, 1024):

        def upsert_then_flush(n: int = n) -> float:
            index.upsert(rows[:n], collection)
            t0 = time.perf_counter()
            index.flush(collection)
            return 1000 * (time.perf_counter() - t0)

        out.append(
            (f"flush of {n} unflushed rows", float(np.median([upsert_then_flush() for _ in range(4)])))
        )
    for n in (1, 32, 256):
        out.append((f"search of {n} queries", _timed(lambda n=n: index.search(queries[:n], k=10))))
    return out


def run(n_items: int, query_rate: float, window_s: float) -> dict[str, Any]:
    from benchmarks.backfill import MilvusServer
    from benchmarks.synthetic_upgrade import synthetic_upgrade
    from components.adapters.index import ROW_FIELDS, GalleryIndex
    from components.rollout.pacing import Pace
    from components.rollout.writes import GalleryWriter

    work = Path(tempfile.mkdtemp(prefix="bench-writes-"))
    server = MilvusServer(work)
    try:
        u = synthetic_upgrade(n_items=n_items, n_queries=600, seed=2)
        index = GalleryIndex(server.uri, "writes")
        collection = index.create_collection("syn", u.old_gallery.shape[1])
        index.switch_alias(collection)
        index.index_items(u.item_ids, u.old_gallery, "v1", "syn")
        index.flush(collection)
        rows = [r for batch in index.iter_rows(ROW_FIELDS, collection) for r in batch]
        singles = single_operations(index, collection, rows, u.old_queries)
        index.flush(collection)
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        querier = ctx.Process(
            target=_queries, args=(server.uri, "writes", u.old_queries, query_rate, stop, out)
        )
        querier.start()
        time.sleep(6.0)  # imports, connection
        load_before = os.getloadavg()[0]
        windows: list[tuple[str, float, float, float | None]] = []  # label, start, end, rows/s achieved
        t = time.time()
        time.sleep(window_s)
        windows.append(("idle", t, time.time(), None))
        position = 0
        for shape, (upsert_rows, flush_rows) in SHAPES.items():
            for rate in RATES:
                pace = Pace(max_items_per_s=rate)
                writer = GalleryWriter(index, collection, upsert_rows, flush_rows, pace)
                t, written = time.time(), 0
                pace.begin()
                while time.time() - t < window_s:
                    batch = [rows[(position + j) % len(rows)] for j in range(256)]
                    position += 256
                    written += writer.write(batch)
                end = time.time()
                writer.flush()
                windows.append(
                    (
                        f"{shape}, {'no cap' if rate is None else f'{rate:.0f} rows/s'}",
                        t,
                        end,
                        written / (end - t),
                    )
                )
                time.sleep(3.0)  # settle (index build of the sealed segments)
        stop.set()
        records = out.get(timeout=120)
        querier.join(timeout=30)
        index.close()
    finally:
        server.stop()
    table = []
    for label, t0, t1, achieved in windows:
        lat = np.array([r[1] for r in records if t0 <= r[0] < t1])
        table.append(
            {
                "window": label,
                "queries": int(lat.size),
                "p50": float(np.percentile(lat, 50)) if lat.size else None,
                "p99": float(np.percentile(lat, 99)) if lat.size else None,
                "max": float(lat.max()) if lat.size else None,
                "rows_per_s": achieved,
            }
        )
    return {
        "singles": singles,
        "table": table,
        "n_items": n_items,
        "query_rate": query_rate,
        "load": (load_before, os.getloadavg()[0]),
    }


def render(r: dict[str, Any], command: str, seconds: float) -> str:
    idle = r["table"][0]["p99"]
    lines = [
        "# What index writes cost users' queries (milvus-lite)",
        "",
        f"Command: `{command}` ({seconds:.0f} s). Gallery of {r['n_items']} items (32-d, HNSW, cosine) on a "
        f"milvus-lite server on loopback; a query process searches it at {r['query_rate']:.0f} queries/s "
        "open loop (one vector, k=10; latency from when each query was due) while rows are rewritten "
        "through the rollout's write path (`GalleryWriter` capped by `Pace`). Machine load average (1 min) "
        f"{r['load'][0]:.1f} before and {r['load'][1]:.1f} after, 2 cores.",
        "",
        "One call, no other load (median wall ms): Milvus answers one call at a time, so a query arriving "
        "during a call waits for it.",
        "",
        "| call | ms |",
        "|---|---|",
        *[f"| {name} | {ms:.1f} |" for name, ms in r["singles"]],
        "",
        "Query latency while rows are written:",
        "",
        "| writes | rows/s achieved | queries | p50 ms | p99 ms | max ms | p99 / idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["table"]:
        ratio = row["p99"] / idle if idle and row["p99"] else None
        achieved = "" if row["rows_per_s"] is None else f"{row['rows_per_s']:.0f}"
        lines.append(
            f"| {row['window']} | {achieved} | {row['queries']} | {row['p50']:.1f} | {row['p99']:.1f} | "
            f"{row['max']:.1f} | {'' if ratio is None else f'{ratio:.2f}'} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=6000)
    parser.add_argument("--query-rate", type=float, default=40.0)
    parser.add_argument("--window", type=float, default=8.0, help="seconds per write rate")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = run(args.items, args.query_rate, args.window)
    text = render(result, ".venv/bin/python benchmarks/write_latency.py", time.perf_counter() - t0)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
