"""What a step cost: wall and CPU seconds and peak resident memory (kept by the ``step`` decorator in
``<run_dir>/usage/step-<step>.json``, :func:`components.runs.record_usage`).

A pod's memory limit is what ends a step that reads one picture too large, so each step says how much it
took: the report's "Resources" table and the benchmarks read these files. On a cluster (and under
``kfp.local``) every step is its own process, whose peak (``VmHWM``) covers its imports and its work; a step
called inside a longer-lived process (a test, ``compatflow`` commands) resets the peak first where Linux
allows it (``/proc/self/clear_refs``), so the figure is the step's own. Worker processes a step started
and waited for (the training loader's) are counted apart: the largest one's peak and all of their CPU time.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

from compat.proc import peak_rss_mib, reset_peak, status_mib


@contextlib.contextmanager
def measured(usage: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Fill ``usage`` with what the ``with`` body cost: ``wall_s``, ``cpu_s`` (this process, every thread),
    ``peak_rss_mib`` (this process), ``workers_cpu_s`` (child processes waited for meanwhile) and
    ``workers_peak_rss_mib`` (the largest child this process ever waited for: in a step's own process, its
    workers'), ``rss_at_start_mib`` (resident before the body: a warm task host's preloaded modules, shared
    copy-on-write, or a longer-lived caller's), ``peak_is_step_only`` (False where the peak could not be
    reset: it may be an earlier step's). Filled also when the body raises."""
    own_peak = reset_peak()
    rss_at_start = status_mib("VmRSS")
    rss_at_start = None if rss_at_start is None else round(rss_at_start, 1)
    start_wall, start_cpu = time.monotonic(), time.process_time()
    start = os.times()
    start_workers_cpu = start.children_user + start.children_system
    try:
        yield usage
    finally:
        now = os.times()
        workers_peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        usage.update(
            wall_s=round(time.monotonic() - start_wall, 3),
            cpu_s=round(time.process_time() - start_cpu, 3),
            peak_rss_mib=peak_rss_mib(),
            peak_is_step_only=own_peak,
            rss_at_start_mib=rss_at_start,
            workers_cpu_s=round(now.children_user + now.children_system - start_workers_cpu, 3),
            workers_peak_rss_mib=round(workers_peak_kib / 1024, 1) if workers_peak_kib else None,
        )
