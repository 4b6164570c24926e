"""Batches prepared ahead of the writes, across stage boundaries.

A backfill is bound by its encoder. Each batch is prepared in two steps: ``prepare`` on the calling thread
(the rows it replaces: restore files or an index read, which must stay on the thread that owns the index
client) and ``encode`` on one worker thread (the new vectors). :class:`BatchesAhead` keeps ``depth`` batches
in preparation beyond the one being written, also past the end of a stage, so the encoder re-embeds the next
stage's first batches while the stage is flushed and probed instead of waiting for it. Nothing is written
ahead: a batch prepared for a stage that never runs (a halt, a crash) is dropped with the pipeline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

Batch = tuple[int, int]  # (start, end) positions in the rollout's order
Rows = TypeVar("Rows")


class BatchesAhead(Generic[Rows]):
    """The planned batches, in order, each prepared by ``prepare`` then ``encode``; see the module doc."""

    def __init__(self, prepare: Callable[[Batch], Any], encode: Callable[[Any], Rows], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (batches prepared ahead of the writes), got {depth}")
        self._prepare, self._encode, self.depth = prepare, encode, depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self._queue: deque[tuple[Batch, Future[Rows]]] = deque()
        self._todo: deque[Batch] = deque()

    def plan(self, batches: Sequence[Batch]) -> None:
        """The batches still to run, in order: what is already in preparation is kept when the plan starts
        with it, dropped otherwise."""
        queued = [batch for batch, _ in self._queue]
        if list(batches[: len(queued)]) != queued:
            self._drop()
            queued = []
        self._todo = deque(batches[len(queued) :])

    def next(self) -> tuple[Batch, Rows]:
        """The next planned batch and its encoded rows (waiting for them); the following batches go on
        being prepared meanwhile."""
        self._fill()
        if not self._queue:
            raise IndexError("no batch left in the plan")
        batch, future = self._queue.popleft()
        rows = future.result()
        self._fill()
        return batch, rows

    def close(self) -> None:
        """Drop what is in preparation and stop the worker."""
        self._drop()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BatchesAhead[Rows]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self) -> None:
        while len(self._queue) < self.depth and self._todo:
            batch = self._todo.popleft()
            self._queue.append((batch, self._pool.submit(self._encode, self._prepare(batch))))

    def _drop(self) -> None:
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
