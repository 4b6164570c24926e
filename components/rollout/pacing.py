"""Pacing of a backfill: query latency held within its SLO while items are re-embedded, and a rate cap.

Before the first backfill batch the rollout times ``IDLE_QUERIES`` searches of the serving collection: the
idle p99. After every batch it times one more search (a query the serving collection answers, as users'
queries are); the p99 of the last ``window`` of these is the latency under the backfill. The rate of
re-embedded items per second follows additive-increase / multiplicative-decrease on it:

* p99 above ``p99_factor`` x idle p99: the rate halves (first from the rate measured so far), never below
  ``FLOOR_SHARE`` of that first measured rate (the backfill always finishes); the window starts over so
  the next decision sees the new pace;
* p99 below ``QUIET`` x that limit: the rate grows by ``GROWTH`` until it reaches ``max_items_per_s`` (or,
  without a cap, until the backfill runs unpaced again);

and ``max_items_per_s`` caps it at all times. The pace is enforced by sleeping after a batch until
``items / rate`` seconds have passed since the previous one. What it ran at goes into the rollout state
(``pace``): the idle and last p99, the rate, how often it slowed down and how long it slept. A rollback
replays its saved rows at the pace its rollout recorded (:func:`components.rollout.rollback.replay_rows`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

IDLE_QUERIES = 30
MIN_SAMPLES = 8  # latency samples before the first decision
QUIET = 0.7  # p99 below this share of the limit lets the rate grow
GROWTH = 1.25
MIN_ITEMS_PER_S = 1.0
FLOOR_SHARE = 0.1  # the slowest pace, as a share of the unpaced rate measured before the first slowdown


def search_timer(index: Any, collection: str, query: np.ndarray) -> Callable[[], float]:
    """A timed top-10 search of ``query`` (one vector of the collection's space) in ``collection``: each
    call returns its latency in milliseconds."""
    query = np.asarray(query, dtype=np.float32).reshape(1, -1)

    def timed() -> float:
        t0 = time.perf_counter()
        index.search(query, k=10, collection=collection)
        return 1000 * (time.perf_counter() - t0)

    return timed


def p99_ms(samples: Any) -> float:
    """The 99th percentile of latency samples in milliseconds."""
    return float(np.percentile(np.asarray(list(samples), dtype=np.float64), 99))


@dataclass
class Pace:
    """The backfill's pace; ``p99_factor`` None turns the latency throttle off (the cap still applies)."""

    p99_factor: float | None = None
    max_items_per_s: float | None = None
    idle_p99_ms: float | None = None
    window: int = 32
    rate: float | None = None  # items/s allowed by the throttle; None: unthrottled
    slowdowns: int = 0
    slept_s: float = 0.0
    last_p99_ms: float | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    _samples: deque = field(default_factory=deque, repr=False)
    _last: float | None = field(default=None, repr=False)
    _done: int = field(default=0, repr=False)
    _started: float | None = field(default=None, repr=False)
    _floor: float = field(default=MIN_ITEMS_PER_S, repr=False)

    def __post_init__(self) -> None:
        if self.p99_factor is not None and self.p99_factor <= 1.0:
            raise ValueError(
                f"p99_factor must be above 1 (a multiple of the idle p99), got {self.p99_factor}"
            )
        if self.max_items_per_s is not None and self.max_items_per_s <= 0:
            raise ValueError(f"max_items_per_s must be positive, got {self.max_items_per_s}")
        self._samples = deque(maxlen=self.window)

    @property
    def throttled(self) -> bool:
        return self.p99_factor is not None and self.idle_p99_ms is not None

    def limit_ms(self) -> float | None:
        """The p99 the backfill may push queries to, or None without a throttle."""
        return self.p99_factor * self.idle_p99_ms if self.throttled else None

    def allowed(self) -> float:
        """Items per second the next batch may run at (``inf``: as fast as it goes)."""
        return min(self.rate or np.inf, self.max_items_per_s or np.inf)

    def measure_idle(self, timed: Callable[[], float]) -> float:
        """Time ``IDLE_QUERIES`` searches with ``timed`` (before any write) unless the idle p99 is known."""
        if self.idle_p99_ms is None:
            self.idle_p99_ms = p99_ms([timed() for _ in range(IDLE_QUERIES)])
        return self.idle_p99_ms

    def begin(self) -> None:
        """Mark the start of a run of batches (the first batch is paced from here)."""
        self._last = self.clock()
        if self._started is None:
            self._started = self._last

    def after_batch(self, n_items: int, latency_ms: float | None = None) -> float:
        """Record a batch of ``n_items`` (and the latency of a query timed after it); sleep to the allowed
        rate. Returns the seconds slept."""
        now = self.clock()
        if self._started is None:
            self._started = now
        self._done += n_items
        if latency_ms is not None and self.throttled:
            self._samples.append(float(latency_ms))
            self._decide(now)
        wait = 0.0
        rate = self.allowed()
        if np.isfinite(rate) and self._last is not None:
            wait = max(0.0, n_items / rate - (now - self._last))
        if wait > 0:
            self.sleep(wait)
            self.slept_s += wait
        self._last = self.clock()
        return wait

    def _decide(self, now: float) -> None:
        if len(self._samples) < MIN_SAMPLES:
            return
        self.last_p99_ms = p99_ms(self._samples)
        limit = self.limit_ms()
        if self.last_p99_ms > limit:
            if self.rate is None:
                measured = self._done / max(now - self._started, 1e-9)
                self._floor = max(MIN_ITEMS_PER_S, FLOOR_SHARE * measured)
                self.rate = measured
            self.rate = max(self._floor, self.rate / 2)
            self.slowdowns += 1
            self._samples.clear()
        elif self.rate is not None and self.last_p99_ms < QUIET * limit:
            self.rate *= GROWTH
            if self.max_items_per_s is not None and self.rate >= self.max_items_per_s:
                self.rate = None  # the cap takes over

    def to_dict(self) -> dict[str, Any]:
        """What the state file records (``pace``)."""
        rate = self.allowed()
        return {
            "p99_factor": self.p99_factor,
            "max_items_per_s": self.max_items_per_s,
            "idle_p99_ms": self.idle_p99_ms,
            "last_p99_ms": self.last_p99_ms,
            "items_per_s_allowed": None if not np.isfinite(rate) else round(float(rate), 3),
            "slowdowns": self.slowdowns,
            "slept_s": round(self.slept_s, 3),
        }

    @classmethod
    def resumed(cls, recorded: Mapping[str, Any] | None, p99_factor: float | None, cap: float | None) -> Pace:
        """The pace of a rollout that resumes: the idle p99 it measured before it was interrupted."""
        idle = (recorded or {}).get("idle_p99_ms")
        return cls(p99_factor=p99_factor, max_items_per_s=cap, idle_p99_ms=idle)
