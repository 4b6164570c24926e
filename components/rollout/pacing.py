"""Pacing of a backfill: query latency held within its SLO while items are re-embedded, and a rate cap.

Latency is read from the workspace's search services (:class:`ServiceLatency`) or, with no traffic, timed on
searches of the serving collection (:class:`SearchLatency`); the rate follows additive-increase /
multiplicative-decrease on the p99 of the last ``window`` samples (README.md, the rollout's latency SLO).
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

IDLE_QUERIES = 30
IDLE_WAIT_S = 5.0  # users' queries observed for the idle p99 (at least IDLE_QUERIES, else timed searches)
LATENCY_METRIC = "compatflow_query_latency_seconds"  # the service's histogram (components.serving.app)
MIN_SAMPLES = 8  # latency samples before the first decision
SAMPLE_INTERVAL_S = 0.25  # at most one latency sample per interval: a sample is itself a search or a scrape
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
        index.search(query, k=10, collection=collection, consistency="Bounded")  # timed like a user's query
        return 1000 * (time.perf_counter() - t0)

    return timed


def p99_ms(samples: Any) -> float:
    """The 99th percentile of latency samples in milliseconds."""
    return float(np.percentile(np.asarray(list(samples), dtype=np.float64), 99))


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float | None:
    """The ``q`` quantile of a Prometheus histogram (upper ``bounds`` ascending, the last ``inf``; cumulative
    counts), interpolated linearly within its bucket as Prometheus does; None without observations. A
    quantile in the ``+Inf`` bucket is the highest finite bound."""
    total = float(cumulative[-1]) if len(cumulative) else 0.0
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank:
            if not np.isfinite(bound):
                return float(previous_bound)
            share = (rank - previous_count) / max(count - previous_count, 1e-12)
            return float(previous_bound + (bound - previous_bound) * share)
        previous_bound, previous_count = bound, float(count)
    return float(previous_bound)


class LatencySource(Protocol):
    """Where the pace reads query latency (milliseconds)."""

    kind: str

    def idle_p99(self) -> float | None: ...

    def sample(self) -> None: ...

    def p99(self) -> float | None: ...

    def clear(self) -> None: ...


class SearchLatency:
    """Searches the rollout times itself: one after every batch (``timed`` returns milliseconds)."""

    kind = "searches"

    def __init__(self, timed: Callable[[], float], window: int = 32) -> None:
        self.timed = timed
        self._samples: deque[float] = deque(maxlen=window)

    def idle_p99(self) -> float | None:
        return p99_ms([self.timed() for _ in range(IDLE_QUERIES)])

    def sample(self) -> None:
        self._samples.append(float(self.timed()))

    def p99(self) -> float | None:
        return p99_ms(self._samples) if len(self._samples) >= MIN_SAMPLES else None

    def clear(self) -> None:
        self._samples.clear()


def _latency_buckets(text: str) -> dict[float, float]:
    """The query-latency histogram's cumulative counts by upper bound in ms, from Prometheus text (read by
    prometheus_client's own parser; labels besides ``le`` are summed over)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: Counter[float] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{LATENCY_METRIC}_bucket":
                bound = sample.labels["le"]
                buckets[float("inf") if bound == "+Inf" else 1000 * float(bound)] += float(sample.value)
    return dict(buckets)


class ServiceLatency:
    """Users' queries: the latency histograms of the search services at ``urls``, summed, as deltas between
    scrapes of their ``/metrics``; the window holds the deltas of the last ``window`` scrapes. A service that
    does not answer a scrape is left out of that scrape (and a restarted one starts over)."""

    kind = "service"

    def __init__(
        self,
        urls: Sequence[str],
        window: int = 32,
        timeout_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.urls, self.timeout_s, self.sleep = list(urls), timeout_s, sleep
        self._previous: dict[str, dict[float, float]] = {}
        self._deltas: deque[dict[float, float]] = deque(maxlen=window)

    def _scrape(self, url: str) -> dict[float, float] | None:
        """Cumulative bucket counts by upper bound, or None when the service does not answer."""
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", "replace")
            return _latency_buckets(text) or None
        except (OSError, ValueError) as exc:  # URLError is an OSError; the parser raises ValueError
            log.debug("service %s did not answer its metrics: %s", url, exc)
            return None

    def _delta(self) -> dict[float, float]:
        """Observations since the previous scrape, summed over the services that answered both."""
        total: Counter[float] = Counter()
        for url in self.urls:
            now = self._scrape(url)
            if now is None:
                continue
            before = self._previous.get(url)
            self._previous[url] = now
            if before is None:
                continue
            if any(now.get(b, 0.0) < c for b, c in before.items()):  # the service restarted
                before = {}
            for bound, count in now.items():
                total[bound] += count - before.get(bound, 0.0)
        return dict(total)

    @staticmethod
    def _p99(deltas: Sequence[dict[float, float]]) -> float | None:
        summed: Counter[float] = Counter()
        for delta in deltas:
            summed.update(delta)
        if not summed or summed.get(float("inf"), 0.0) < MIN_SAMPLES:
            return None
        bounds = sorted(summed)
        return histogram_quantile(0.99, bounds, [summed[b] for b in bounds])

    def idle_p99(self) -> float | None:
        """p99 of the users' queries answered in the ``IDLE_WAIT_S`` before the backfill (None when fewer
        than ``IDLE_QUERIES`` arrive, or no service answers). The whole wait counts: the p99 of a few dozen
        queries is their maximum, one slow answer."""
        self._delta()
        if not self._previous:
            return None
        self.sleep(IDLE_WAIT_S)
        seen = self._delta()
        return self._p99([seen]) if seen.get(float("inf"), 0.0) >= IDLE_QUERIES else None

    def sample(self) -> None:
        self._deltas.append(self._delta())

    def p99(self) -> float | None:
        return self._p99(self._deltas)

    def clear(self) -> None:
        self._deltas.clear()


@dataclass
class Pace:
    """The backfill's pace; ``p99_factor`` None turns the latency throttle off (the cap still applies)."""

    p99_factor: float | None = None
    max_items_per_s: float | None = None
    idle_p99_ms: float | None = None
    idle_from: str | None = None  # the kind of latency source the idle p99 was measured with
    rate: float | None = None  # items/s allowed by the throttle; None: unthrottled
    slowdowns: int = 0
    slept_s: float = 0.0
    last_p99_ms: float | None = None
    latency: LatencySource | None = field(default=None, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    _last: float | None = field(default=None, repr=False)
    _sampled: float = field(default=-np.inf, repr=False)
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

    @property
    def throttled(self) -> bool:
        return self.p99_factor is not None and self.idle_p99_ms is not None and self.latency is not None

    def limit_ms(self) -> float | None:
        """The p99 the backfill may push queries to, or None without a throttle."""
        return self.p99_factor * self.idle_p99_ms if self.throttled else None

    def allowed(self) -> float:
        """Items per second the next batch may run at (``inf``: as fast as it goes)."""
        return min(self.rate or np.inf, self.max_items_per_s or np.inf)

    def watch(self, sources: Sequence[LatencySource]) -> LatencySource | None:
        """Read latency from the first of ``sources`` that gives an idle p99 (or whose kind measured the one
        recorded before a resume): call before any write. None without a throttle or a usable source."""
        if self.p99_factor is None:
            return None
        for source in sources:
            if self.idle_p99_ms is not None and self.idle_from == source.kind:
                self.latency = source
                return source
            idle = source.idle_p99()
            if idle is not None:
                self.latency, self.idle_p99_ms, self.idle_from = source, idle, source.kind
                return source
        return None

    def begin(self) -> None:
        """Mark the start of a run of batches (the first batch is paced from here)."""
        self._last = self.clock()
        if self._started is None:
            self._started = self._last

    def after_batch(self, n_items: int) -> float:
        """Record a batch of ``n_items``, sample the query latency it left behind (at most once per
        ``SAMPLE_INTERVAL_S``) and sleep to the allowed rate. Returns the seconds slept."""
        now = self.clock()
        if self._started is None:
            self._started = now
        self._done += n_items
        if self.throttled and now - self._sampled >= SAMPLE_INTERVAL_S:
            self._sampled = now
            self.latency.sample()
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
        p99 = self.latency.p99()
        if p99 is None:
            return
        self.last_p99_ms = p99
        limit = self.limit_ms()
        if p99 > limit:
            if self.rate is None:
                measured = self._done / max(now - self._started, 1e-9)
                self._floor = max(MIN_ITEMS_PER_S, FLOOR_SHARE * measured)
                self.rate = measured
            self.rate = max(self._floor, self.rate / 2)
            self.slowdowns += 1
            self.latency.clear()
        elif self.rate is not None and p99 < QUIET * limit:
            self.rate *= GROWTH
            if self.max_items_per_s is not None and self.rate >= self.max_items_per_s:
                self.rate = None  # the cap takes over

    def to_dict(self) -> dict[str, Any]:
        """What the state file records (``pace``)."""
        rate = self.allowed()
        return {
            "p99_factor": self.p99_factor,
            "max_items_per_s": self.max_items_per_s,
            "latency_from": self.idle_from,
            "idle_p99_ms": self.idle_p99_ms,
            "last_p99_ms": self.last_p99_ms,
            "items_per_s_allowed": None if not np.isfinite(rate) else round(float(rate), 3),
            "slowdowns": self.slowdowns,
            "slept_s": round(self.slept_s, 3),
        }

    @classmethod
    def resumed(cls, recorded: Mapping[str, Any] | None, p99_factor: float | None, cap: float | None) -> Pace:
        """The pace of a rollout that resumes: the idle p99 it measured before it was interrupted."""
        recorded = recorded or {}
        idle = recorded.get("idle_p99_ms")
        source = recorded.get("latency_from") or (SearchLatency.kind if idle is not None else None)
        return cls(p99_factor=p99_factor, max_items_per_s=cap, idle_p99_ms=idle, idle_from=source)


def latency_sources(
    index: Any, collection: str, query: np.ndarray, service_urls: Sequence[str] = ()
) -> list[LatencySource]:
    """The sources a pace tries, in order: the announced services' users' queries, then timed searches of
    ``collection`` with ``query`` (a vector of its space)."""
    own = SearchLatency(search_timer(index, collection, query))
    return [ServiceLatency(service_urls), own] if service_urls else [own]
