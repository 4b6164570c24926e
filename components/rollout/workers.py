"""A stage's slices, re-embedded and written by the rollout's process or by workers that live across stages.

:func:`run_range` runs the slices ``[start, end)`` of the stage its spec file names, re-embedding a page on a
second thread while the page before it is written; the range's cursor file names the slices done, so a range
is resumable and idempotent. ``workers > 1`` needs a Milvus server (milvus-lite opens in one process only).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compat.io import read_json, write_json_atomic
from compat.proc import peak_rss_mib
from components.rollout.types import RolloutError

if TYPE_CHECKING:
    from components.state.rollout_document import RolloutState

log = logging.getLogger(__name__)

SPEC_FILE = "workers.json"
RANGES_DIR = "ranges"
Range = tuple[int, int]  # (start, end) slice indices of a stage


def split_ranges(n_slices: int, workers: int) -> list[Range]:
    """Slices ``[0, n_slices)`` as up to ``workers`` contiguous ranges, as even as they divide."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    k = min(workers, n_slices)
    edges = [n_slices * i // k for i in range(k + 1)] if k else [0]
    return list(zip(edges, edges[1:], strict=False))


def n_slices(items: float, batch_size: int) -> int:
    """Slices of about ``batch_size`` items for a stage of about ``items``."""
    return max(1, math.ceil(items / batch_size))


def range_cursor(work: Path, stage: int, start: int, end: int) -> Path:
    """The cursor file of the slices ``[start, end)`` of ``stage``."""
    return Path(work) / RANGES_DIR / f"stage{stage}-{start:07d}-{end:07d}.json"


def read_cursor(path: Path, start: int) -> dict[str, Any]:
    doc = read_json(path, lambda why: RolloutError(f"{why}: delete it to run its range again from the start"))
    return doc if doc is not None else {"position": start, "written": 0, "seconds": 0.0}


def range_done(work: Path, stage: int, start: int, end: int) -> bool:
    """True when the range's cursor reached its end."""
    return read_cursor(range_cursor(work, stage, start, end), start)["position"] >= end


def pending_ranges(state: RolloutState, work: Path) -> list[Range]:
    """The slice ranges of ``state``'s running stage whose workers have not finished."""
    if state.status != "running":
        return []
    return [(s, e) for s, e in state.cursor.ranges or () if not range_done(work, state.stage, s, e)]


def write_spec(work: Path, spec: Mapping[str, Any]) -> Path:
    """What every worker of the running stage reads (index, collections, order, encoders, pace, lineage)."""
    path = Path(work) / SPEC_FILE
    write_json_atomic(path, dict(spec))
    return path


def stage_filters(spec: Mapping[str, Any]) -> list[str]:
    """The slice filters of the spec's stage: the order's stage, or (``whole``) every item of the source."""
    from components.adapters.index import key_slices
    from components.rollout.keys import Selection

    n = int(spec["n_slices"])
    if spec["whole"]:
        return key_slices(n) if spec["keyed"] else [""]
    return Selection.of(spec["order"], spec["fractions"]).slices(int(spec["stage"]), n)


def run_range(
    spec_path: Path,
    start: int,
    end: int,
    parent: int | None = None,
    *,
    encoders: Any = None,
    index: Any = None,
    pace: Any = None,
) -> dict[str, Any]:
    """Write the slices ``[start, end)`` of the stage described by ``spec_path``, from its cursor on; returns
    the cursor document (position, items written, seconds, peak RSS). A worker of the rollout process
    ``parent`` stops when that process is gone (its next run resumes the range). The rollout's own process
    passes its ``encoders``, ``index`` and ``pace``; a worker builds them from the spec."""
    import contextlib

    from components.adapters.index import GalleryIndex

    spec = json.loads(Path(spec_path).read_text())
    work, stage = Path(spec_path).parent, int(spec["stage"])
    cursor_path = range_cursor(work, stage, start, end)
    cursor = read_cursor(cursor_path, start)
    if cursor["position"] >= end:
        return cursor
    t0, written0 = time.perf_counter(), int(cursor["written"])
    with (
        contextlib.nullcontext(index)
        if index is not None
        else GalleryIndex(spec["uri"], spec["alias"]) as index
    ):
        slicer = _SliceWriter(spec, index, encoders, pace)
        resumed = cursor["position"]
        filters = stage_filters(spec)
        for i, rows in slicer.encoded(filters, range(cursor["position"], end)):
            if parent is not None and os.getppid() != parent:
                raise RolloutError("the rollout process is gone; stopping (its next run resumes this range)")
            if rows is None:  # slice i is written
                cursor = {
                    "position": i + 1,
                    "written": int(cursor["written"]),
                    "seconds": round(time.perf_counter() - t0, 3),
                }
                write_json_atomic(cursor_path, cursor)
                continue
            slicer.write(rows, upsert=spec["upsert"] or i == resumed)
            cursor["written"] = int(cursor["written"]) + len(rows)
        slicer.flush()
    seconds = time.perf_counter() - t0
    cursor.update(
        seconds=round(seconds, 3),
        items_per_s=round((int(cursor["written"]) - written0) / max(seconds, 1e-9), 1),
        cpu_seconds=round(time.process_time(), 2),
        peak_rss_mib=peak_rss_mib(),
        pace=slicer.pace.to_dict(),
    )
    write_json_atomic(cursor_path, cursor)
    return cursor


class _SliceWriter:
    """Reads, encodes and writes a stage's slices for :func:`run_range`."""

    def __init__(self, spec: Mapping[str, Any], index: Any, encoders: Any = None, pace: Any = None) -> None:
        from components.adapters.services import live_services
        from components.rollout.keys import load_centres
        from components.rollout.pacing import Pace, latency_sources
        from components.rollout.writes import GalleryWriter
        from components.serving.record import import_factory

        self.spec, self.index = spec, index
        recipe = spec["encoders"]
        self.encoders = encoders or import_factory(recipe["factory"])(recipe["args"])
        self.centres = load_centres(spec.get("centres"))
        pace_doc = spec.get("pace") or {}
        cap = pace_doc.get("max_items_per_s")
        self.pace = pace or Pace.resumed(
            pace_doc, pace_doc.get("p99_factor"), cap / spec["workers"] if cap else None
        )
        if self.pace.p99_factor is not None and self.pace.latency is None and spec.get("serving"):
            probe = np.asarray(spec["latency_query"], dtype=np.float32)
            self.pace.watch(
                latency_sources(index, spec["serving"], probe, live_services(Path(spec["services_dir"])))
            )
        self.writer = GalleryWriter.for_pace(index, spec["target"], self.pace, int(spec["flush_rows"]))
        self.lineage = lineage_store(spec.get("lineage"))
        self.pace.begin()

    def encoded(
        self, filters: Sequence[str], slices: range
    ) -> Iterator[tuple[int, list[dict[str, Any]] | None]]:
        """``(i, rows)`` for each page of each slice ``i`` re-embedded, then ``(i, None)`` when slice ``i`` is
        done; the next page is encoded on a second thread while the caller writes this one."""
        from components.adapters.index import ROW_FIELDS

        # a re-embedding needs the rows' fields, not their old vectors (a transform maps those)
        transform = self.spec["action"] == "transform"
        fields = ROW_FIELDS if transform else [f for f in ROW_FIELDS if f != "vector"]

        def pages() -> Iterator[tuple[int, list[dict[str, Any]] | None]]:
            for i in slices:
                for page in self.index.iter_rows(
                    fields, self.spec["source"], filter=filters[i], batch_size=int(self.spec["batch_size"])
                ):
                    yield i, page
                yield i, None

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
            previous: tuple[int, Future[Any] | None] | None = None
            for i, page in pages():
                current = (i, pool.submit(self._rows, page) if page is not None else None)
                if previous is not None:
                    yield previous[0], previous[1].result() if previous[1] is not None else None
                previous = current
            if previous is not None:
                yield previous[0], previous[1].result() if previous[1] is not None else None

    def _rows(self, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from components.rollout.writes import new_rows

        return new_rows(self.encoders, previous, self.spec, self.centres)

    def write(self, rows: list[dict[str, Any]], *, upsert: bool) -> None:
        self.writer.write(rows, insert=not upsert)
        if self.lineage is not None:
            self.lineage.sync_with_index(rows)

    def flush(self) -> None:
        if self.writer.written:
            self.writer.flush()


def lineage_store(spec: Mapping[str, Any] | None) -> Any:
    """The lineage store a worker records its items in (None: the rollout records none)."""
    if not spec or not (Path(spec["repo"]) / "feature_store.yaml").is_file():
        return None
    from components.adapters.lineage import LineageStore

    return LineageStore(spec["repo"], definition=spec.get("definition"))


class WorkerPool:
    """``workers`` processes (spawned once per rollout, they live across its stages) that run slice ranges."""

    def __init__(self, workers: int) -> None:
        import multiprocessing

        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))

    def run(self, spec_path: Path, ranges: Sequence[Range]) -> list[dict[str, Any]]:
        """Run ``ranges`` at once and wait for them; a failed range fails the stage, naming it (the others
        resume where they were on the next run)."""
        futures = {r: self.pool.submit(run_range, spec_path, *r, os.getpid()) for r in ranges}
        done = []
        for (start, end), future in futures.items():
            try:
                done.append(future.result())
            except Exception as exc:
                raise RolloutError(
                    f"backfill worker for slices {start}-{end} failed: {exc}; run the rollout again: every "
                    "range resumes from its cursor"
                ) from exc
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
