"""A backfill stage fanned out: its rank ranges re-embedded and written by worker processes.

A stage ``[lo, hi)`` of the order splits into ``workers`` contiguous rank ranges on the stage's batch grid
(:func:`split_ranges`), so a range's batches are the stage's batches and their restore files are the ones a
rollback replays. Every range is run by :func:`run_range`, the one worker entry point: K processes here
(:func:`run_ranges`, ``python -m components.rollout.workers``), K parallel pipeline tasks on a cluster
(:func:`components.kfp_ops.rollout_range_op` in a ``dsl.ParallelFor``). A range is resumable and idempotent:
its cursor file records the batches written; a batch saves the rows it replaces before its upsert (the
restore file is kept on a retry), and upserts are keyed by item id, so a worker killed mid-range and run
again writes no duplicate and misses no item. The stage's probe gate runs in the rollout once every range
is written.

Pace: one budget. Each of K workers paces at 1/K of the rollout's rate cap, and its SLO throttle starts
from the idle p99 the rollout measured before its first write (recorded in the state) and reacts to the
same query latency, so the total write rate follows the same additive-increase / multiplicative-decrease
as one process.

Workers share the index through a server: an embedded milvus-lite directory opens in one process only,
so ``workers > 1`` needs ``index.uri`` on a Milvus server (or ``milvus-lite server``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compat.io import read_json, write_json_atomic
from compat.proc import peak_rss_mib
from components.rollout.state import Batch, batch_grid, restore_path
from components.rollout.types import RolloutError

log = logging.getLogger(__name__)

SPEC_FILE = "workers.json"
RANGES_DIR = "ranges"


def split_ranges(lo: int, hi: int, batch_size: int, workers: int) -> list[Batch]:
    """``[lo, hi)`` as up to ``workers`` contiguous ranges of whole batches of the grid starting at ``lo``
    (the last batch may be shorter), as even as the batches allow."""
    if workers < 1 or batch_size < 1:
        raise ValueError(f"workers ({workers}) and batch_size ({batch_size}) must be >= 1")
    n_batches = math.ceil(max(hi - lo, 0) / batch_size)
    if n_batches == 0:
        return []
    per, extra = divmod(n_batches, min(workers, n_batches))
    ranges, start = [], lo
    for i in range(min(workers, n_batches)):
        end = min(hi, start + (per + (i < extra)) * batch_size)
        ranges.append((start, end))
        start = end
    return ranges


def range_cursor(work: Path, start: int, end: int) -> Path:
    """The cursor file of the range ``[start, end)`` of a rollout's work folder."""
    return Path(work) / RANGES_DIR / f"{start:09d}-{end:09d}.json"


def read_cursor(path: Path, start: int) -> dict[str, Any]:
    doc = read_json(path, lambda why: RolloutError(f"{why}: delete it to run its range again from the start"))
    return doc if doc is not None else {"position": start, "written": 0, "seconds": 0.0}


def range_done(spec_path: Path, start: int, end: int) -> bool:
    """True when the range's cursor reached its end."""
    return read_cursor(range_cursor(Path(spec_path).parent, start, end), start)["position"] >= end


def pending_ranges(state: Mapping[str, Any], work: Path) -> list[Batch]:
    """The rank ranges of ``state``'s running stage whose workers have not finished (none outside a stage
    fanned out to pipeline tasks)."""
    if state["status"] != "running":
        return []
    spec = Path(work) / SPEC_FILE
    return [(s, e) for s, e in state["cursor"].get("ranges") or () if not range_done(spec, s, e)]


def write_spec(work: Path, spec: Mapping[str, Any]) -> Path:
    """The rollout-wide settings every worker reads (index, collections, order, encoders, pace)."""
    path = Path(work) / SPEC_FILE
    write_json_atomic(path, dict(spec))
    return path


def run_range(spec_path: Path, start: int, end: int) -> dict[str, Any]:
    """Re-embed and write the ranks ``[start, end)`` of the rollout described by ``spec_path``, from its
    cursor on; returns the cursor document (position, items written, seconds, peak RSS)."""
    import numpy as np

    from components.adapters.index import GalleryIndex
    from components.adapters.services import live_services
    from components.rollout.order import RankedOrder
    from components.rollout.pacing import Pace, latency_sources
    from components.rollout.writes import GalleryWriter, previous_rows, reembedded_rows
    from components.serving.record import import_factory

    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec_path).parent
    cursor_path = range_cursor(work, start, end)
    cursor = read_cursor(cursor_path, start)
    if cursor["position"] >= end:
        return cursor
    encoders = import_factory(spec["encoders"]["factory"])(spec["encoders"]["args"])
    order = RankedOrder(spec["order"]["path"], expected_digest=spec["order"]["digest"])
    pace_doc = spec.get("pace") or {}
    workers = int(spec["workers"])
    cap = pace_doc.get("max_items_per_s")
    pace = Pace.resumed(pace_doc, pace_doc.get("p99_factor"), cap / workers if cap else None)
    restore_dir = Path(spec["restore_dir"]) if spec["keep"] else None
    t0, written0 = time.perf_counter(), int(cursor["written"])
    with GalleryIndex(spec["uri"], spec["alias"]) as index:
        if pace.p99_factor is not None:
            (first,) = index.fetch(order[cursor["position"] : cursor["position"] + 1], spec["source"])
            pace.watch(
                latency_sources(
                    index,
                    spec["serving"],
                    np.asarray(first["vector"]),
                    live_services(Path(spec["services_dir"])),
                )
            )
        writer = GalleryWriter.for_pace(index, spec["target"], pace, int(spec["flush_rows"]))
        pace.begin()
        for b_start, b_end in batch_grid(cursor["position"], end, int(spec["batch_size"])):
            ids = order[b_start:b_end]
            restore = restore_path(restore_dir, b_start, b_end) if restore_dir else None
            previous = previous_rows(index, ids, spec["source"], restore)
            rows = reembedded_rows(
                encoders,
                previous,
                version=spec["new_version"],
                space=spec["space"],
                dim=int(spec["dim"]),
                rollout_id=spec["rollout_id"],
            )
            writer.write(rows)
            cursor = {
                "position": b_end,
                "written": int(cursor["written"]) + len(rows),
                "seconds": round(time.perf_counter() - t0, 3),
            }
            write_json_atomic(cursor_path, cursor)
        writer.flush()
    seconds = time.perf_counter() - t0
    cursor.update(
        seconds=round(seconds, 3),
        items_per_s=round((int(cursor["written"]) - written0) / max(seconds, 1e-9), 1),
        cpu_seconds=round(time.process_time(), 2),
        peak_rss_mib=peak_rss_mib(),
        pace=pace.to_dict(),
    )
    write_json_atomic(cursor_path, cursor)
    return cursor


PARENT_ENV = "COMPATFLOW_ROLLOUT_PID"


def _die_with_parent() -> None:
    """In a worker: SIGKILL it when the rollout that started it dies, so a resumed rollout never meets a
    worker of the one before it writing the same range. Set by the worker itself (the rollout holds gRPC
    threads: code run between its fork and exec could abort), then checked against a parent already gone."""
    import ctypes
    import os

    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return  # run by hand or by a pipeline task: no rollout process to follow
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)


def run_ranges(spec_path: Path, ranges: Sequence[Batch], poll_s: float = 0.2) -> list[dict[str, Any]]:
    """Run every range in its own worker process (:func:`run_range`), all at once, and wait for them; returns
    their cursor documents. A worker that fails fails the stage, naming its range and its last output; the
    others are stopped (their ranges resume where they were on the next run)."""
    import os

    work = Path(spec_path).parent
    root = str(Path(__file__).resolve().parents[2])  # the project: modules a recipe names outside the package
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        PARENT_ENV: str(os.getpid()),
    }
    procs: dict[Batch, subprocess.Popen[bytes]] = {}
    logs: dict[Batch, Path] = {}
    try:
        for start, end in ranges:
            logs[(start, end)] = range_cursor(work, start, end).with_suffix(".log")
            logs[(start, end)].parent.mkdir(parents=True, exist_ok=True)
            with open(logs[(start, end)], "ab") as out:
                procs[(start, end)] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "components.rollout.workers",
                        str(spec_path),
                        str(start),
                        str(end),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
        while procs:
            for key, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[key]
                if code != 0:
                    tail = logs[key].read_text(errors="replace").strip().splitlines()[-5:]
                    raise RolloutError(
                        f"backfill worker for ranks {key[0]}-{key[1]} exited with status {code}: "
                        + " | ".join(tail)
                        + f" (log {logs[key]}); run the rollout again: every range resumes from its cursor"
                    )
            time.sleep(poll_s)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return [read_cursor(range_cursor(work, s, e), s) for s, e in ranges]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Re-embed and write one rank range of a rollout's backfill.")
    parser.add_argument("spec", type=Path, help="the rollout's workers.json")
    parser.add_argument("start", type=int)
    parser.add_argument("end", type=int)
    args = parser.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cursor = run_range(args.spec, args.start, args.end)
    print(json.dumps(cursor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
