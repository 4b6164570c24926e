"""Progress reporting for long steps: a rich progress bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def track(
    items: Iterable[T],
    description: str,
    total: int | None = None,
    logger: logging.Logger | None = None,
    every_s: float = 10.0,
) -> Iterator[T]:
    """Yield ``items`` while showing progress (a bar on a TTY, a log line every ``every_s`` s otherwise)."""
    log = logger or logging.getLogger("compat.progress")
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if sys.stderr.isatty():
        from rich.progress import track as rich_track

        yield from rich_track(items, description=description, total=total, transient=True)
        return
    start = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            of = f"/{total}" if total else ""
            log.info("%s: %d%s (%.1f/s)", description, done, of, done / max(now - start, 1e-9))
    log.info("%s: done, %d items in %.1f s", description, done, time.monotonic() - start)
