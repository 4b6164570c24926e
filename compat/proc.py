"""A process's own memory and CPU as Linux reports them (``/proc/<pid>/status`` and ``stat``): what the
steps' usage records, the backfill workers and the benchmarks measure. Each reader answers None where there
is no ``/proc``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def status_mib(field: str, pid: int | str = "self") -> float | None:
    """A memory field of ``/proc/<pid>/status`` (``VmHWM``: peak resident, ``VmRSS``: resident) in MiB."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None


def peak_rss_mib(pid: int | str = "self") -> float | None:
    """The process's peak resident memory (``VmHWM``) in MiB, to 0.1 (``ru_maxrss`` would carry a forked
    parent's peak)."""
    peak = status_mib("VmHWM", pid)
    return None if peak is None else round(peak, 1)


def reset_peak(pid: int | str = "self") -> bool:
    """Start the process's ``VmHWM`` again from its current resident size (Linux 4.0+); False when not."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of the process so far (``/proc/<pid>/stat``), to 0.1."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)
