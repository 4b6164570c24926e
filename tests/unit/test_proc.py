"""This process's memory and CPU read from /proc: the peak covers an allocation made and freed, a reset
starts it again, and a process that is gone answers None."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from compat import proc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_peak_covers_what_was_freed_and_a_reset_starts_it_again() -> None:
    assert proc.reset_peak()
    before = proc.peak_rss_mib()
    # 64 MiB of fresh pages, touched, then unmapped: an anonymous map, not the allocator, whose freed but
    # still resident heap a long-lived process (a pytest-xdist worker) may reuse without growing at all
    block = mmap.mmap(-1, 64 << 20)
    block.write(b"\1" * (64 << 20))
    block.close()
    after = proc.peak_rss_mib()
    assert after - before >= 60
    assert proc.status_mib("VmRSS") < after  # freed: resident now is below the peak
    assert proc.reset_peak() and proc.peak_rss_mib() < after


def test_cpu_seconds_grow_with_work_and_a_gone_process_answers_none() -> None:
    start = proc.cpu_seconds()
    np.linalg.svd(np.random.default_rng(0).normal(size=(600, 600)))
    assert proc.cpu_seconds() >= start
    assert proc.peak_rss_mib(2**22 + 7) is None and proc.cpu_seconds(2**22 + 7) is None
