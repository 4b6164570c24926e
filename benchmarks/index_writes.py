"""What re-embedding a gallery costs Milvus, by write path: server CPU per row, side by side in one run.

On one Milvus standalone server (the PyPI 2.3.5 server, loopback only), a gallery of N stand-in vectors
(HNSW, cosine, the rollout's row schema) is built and served; then N re-embedded rows are written by each
path Milvus offers, each one fresh on the same server:

- ``upsert in place``: over the served collection, batches of 1,024 or 4,096 (the design before collections
  per rollout: each upsert deletes the old row, and compaction rewrites the segments it leaves);
- ``insert, new collection``: a collection of its own (today's rollout), batches of 1,024 or 5,000;
- ``insert, new partition``: a second partition of the served collection, batches of 1,024;
- ``bulk insert, new collection``: rows written to a parquet file in the server's storage and imported.

Each path is timed from its first write until its rows are flushed, indexed (no row waits for its HNSW
index) and the server is quiet again (compaction included: CPU over a settling window, less the idle rate
measured before). Figures: wall seconds, Milvus CPU seconds and milliseconds per row.

    .venv/bin/python benchmarks/index_writes.py --sizes 20000,100000

Needs root (a private loopback-only network namespace, :mod:`components.adapters.milvus_server`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gallery_scale import milvus_standalone, report, stand_in_vectors  # noqa: E402
from compat.proc import cpu_seconds  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "index_writes.md"
DIM = 64
CHUNK = 20_000  # rows made (vectors and row dicts) at a time: memory stays flat with N


def _rows(start: int, stop: int, model: str) -> list[dict[str, Any]]:
    from components.adapters.index import make_rows

    ids = [f"item-{i:010d}" for i in range(start, stop)]
    return make_rows(ids, stand_in_vectors(ids, model, DIM), "v2" if model == "new" else "v1", "s", dim=DIM)


def _write(client: Any, name: str, n: int, batch: int, how: str, partition: str | None = None) -> None:
    call = client.upsert if how == "upsert" else client.insert
    for start in range(0, n, CHUNK):
        rows = _rows(start, min(n, start + CHUNK), "new")
        for s in range(0, len(rows), batch):
            if partition:
                call(name, rows[s : s + batch], partition_name=partition)
            else:
                call(name, rows[s : s + batch])


def _bulk(index: Any, name: str, n: int, storage: Path) -> None:
    """Rows as parquet files under the server's local storage, imported by ``do_bulk_insert``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pymilvus import connections, utility

    files = []
    for start in range(0, n, 200_000):
        rows = _rows(start, min(n, start + 200_000), "new")
        kinds = {float: pa.float32(), int: pa.int64(), str: pa.string()}
        schema = pa.schema(
            [(k, pa.list_(pa.float32()) if k == "vector" else kinds[type(v)]) for k, v in rows[0].items()]
        )
        table = pa.Table.from_pylist(
            [{**r, "vector": np.asarray(r["vector"], dtype=np.float32).tolist()} for r in rows], schema=schema
        )
        rel = f"import/{name}-{start}.parquet"
        (storage / "import").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, storage / rel)
        files.append(str(storage / rel))  # the local chunk manager reads the path as given
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # pymilvus: ORM calls (no client call yet)
    connections.connect("bulk", uri=index.uri)
    try:
        tasks = [utility.do_bulk_insert(name, files=[f], using="bulk") for f in files]
        for task in tasks:
            while True:
                state = utility.get_bulk_insert_state(task, using="bulk")
                if state.state_name in ("Completed", "ImportCompleted"):
                    break
                if state.state_name in ("Failed", "ImportFailed", "Failed and cleaned"):
                    raise RuntimeError(f"bulk insert of {files} failed: {state.infos}")
                time.sleep(0.2)
    finally:
        connections.disconnect("bulk")


def _quiet(pid: int, idle_rate: float, window_s: float = 2.0, limit_s: float = 600.0) -> None:
    """Wait until the server's CPU over ``window_s`` is within 1.5x its idle rate (compaction done)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        c0 = cpu_seconds(pid)
        time.sleep(window_s)
        if (cpu_seconds(pid) - c0) / window_s <= max(1.5 * idle_rate, idle_rate + 0.05):
            return


def measure(server: Any, storage: Path, size: int) -> list[dict[str, Any]]:
    """Each write path over a fresh served gallery of ``size``; one record each."""
    from components.adapters.index import GalleryIndex

    pid = server.process.pid
    records = []
    paths: dict[str, Callable[[Any, str], None]] = {
        "upsert in place, batches of 1,024": lambda ix, served: _write(
            ix.client, served, size, 1024, "upsert"
        ),
        "upsert in place, batches of 4,096": lambda ix, served: _write(
            ix.client, served, size, 4096, "upsert"
        ),
        "insert, new collection, batches of 1,024": lambda ix, served: _write(
            ix.client, ix.create_collection("s", DIM), size, 1024, "insert"
        ),
        "insert, new collection, batches of 5,000": lambda ix, served: _write(
            ix.client, ix.create_collection("s", DIM), size, 5000, "insert"
        ),
        "insert, new partition, batches of 1,024": lambda ix, served: (
            ix.client.create_partition(served, "next"),
            _write(ix.client, served, size, 1024, "insert", partition="next"),
        ),
        "bulk insert (parquet), new collection": lambda ix, served: _bulk(
            ix, ix.create_collection("s", DIM), size, storage
        ),
    }
    for n, (label, write) in enumerate(paths.items()):
        with GalleryIndex(server.uri, f"w{size}p{n}") as index:
            for name in index.client.list_aliases().get("aliases", []):
                index.client.drop_alias(name)
            for name in index.client.list_collections():
                index.client.drop_collection(name)
            served = index.create_collection("s", DIM)
            for start in range(0, size, CHUNK):
                index.client.insert(served, _rows(start, min(size, start + CHUNK), "old"))
            index.client.flush(served)
            index.wait_indexed(served, timeout_s=3600)
            index.switch_alias(served)
            time.sleep(3)
            c0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(5)
            idle_rate = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            c0, t0 = cpu_seconds(pid), time.monotonic()
            write(index, served)
            written = [c for c in index.client.list_collections() if c != served]
            for name in written or [served]:
                index.client.flush(name)
                index.wait_indexed(name, timeout_s=3600)
            _quiet(pid, idle_rate)
            wall = time.monotonic() - t0
            cpu = cpu_seconds(pid) - c0 - idle_rate * wall
        records.append(
            {
                "size": size,
                "path": label,
                "seconds": round(wall, 1),
                "milvus_cpu_s": round(cpu, 1),
                "milvus_cpu_ms_per_row": round(1000 * cpu / size, 3),
                "idle_cpu_rate": round(idle_rate, 3),
            }
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def table(records: Sequence[dict[str, Any]]) -> str:
    sizes = sorted({r["size"] for r in records})
    head = "| write path | " + " | ".join(f"{s:,}: s | {s:,}: Milvus CPU ms/row" for s in sizes)
    lines = [head + " | Milvus CPU s exponent |", "|---|" + "---|---|" * len(sizes) + "---|"]
    for label in dict.fromkeys(r["path"] for r in records):
        rs = {r["size"]: r for r in records if r["path"] == label}
        cells = [
            f"{rs[s]['seconds']} | {rs[s]['milvus_cpu_ms_per_row']}" if s in rs else " | " for s in sizes
        ]
        pts = [
            (math.log(s), math.log(rs[s]["milvus_cpu_s"]))
            for s in sizes
            if s in rs and rs[s]["milvus_cpu_s"] > 0
        ]
        slope = f"{np.polyfit(*np.asarray(pts).T, 1)[0]:.2f}" if len(pts) > 1 else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {slope} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20000,100000")
    parser.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    args = parser.parse_args(argv)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compatflow-writes-") as tmp:
        data = Path(tmp) / "milvus"
        with milvus_standalone(data) as server:
            storage = next(p for p in [data / "data", data] if p.is_dir())
            for size in (int(s) for s in args.sizes.split(",")):
                records += measure(server, storage, size)
    return report(records, table(records), args)


if __name__ == "__main__":
    sys.exit(main())
