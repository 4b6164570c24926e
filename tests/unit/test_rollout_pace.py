"""The rollout's pace: the rate cap, halving when queries slow down and recovering when quiet, the idle p99
kept only for the same latency source, and the histogram quantile it reads."""

from __future__ import annotations

import pytest


# ------------------------------------------------------------------------------------------------- pacing
class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_pace_caps_the_rate() -> None:
    from components.rollout.pacing import Pace

    clock = _FakeClock()
    pace = Pace(max_items_per_s=100, clock=clock, sleep=clock.sleep)
    pace.begin()
    for _ in range(4):
        clock.now += 0.1  # a batch of 50 items takes 0.1 s; the cap allows 50 items per 0.5 s
        pace.after_batch(50)
    assert clock.now == pytest.approx(2.0) and pace.slept_s == pytest.approx(1.6)
    assert pace.to_dict()["items_per_s_allowed"] == 100


def test_pace_halves_when_queries_slow_down_and_recovers_when_they_are_quiet() -> None:
    from components.rollout.pacing import (
        FLOOR_SHARE,
        GROWTH,
        MIN_SAMPLES,
        SAMPLE_INTERVAL_S,
        Pace,
        SearchLatency,
    )

    clock = _FakeClock()
    latency = {"ms": 30.0}
    pace = Pace(p99_factor=1.5, clock=clock, sleep=clock.sleep)
    idle = iter([10.0] * 30)
    source = SearchLatency(lambda: next(idle, latency["ms"]))
    assert pace.watch([source]) is source and pace.idle_p99_ms == pytest.approx(10.0)
    pace.begin()
    for _ in range(MIN_SAMPLES):  # 100 items/s unpaced, queries at 3x idle
        clock.now += 1.0
        pace.after_batch(100)
    assert pace.slowdowns == 1 and pace.rate == pytest.approx(50.0) and pace.last_p99_ms == 30.0
    for _ in range(40 * MIN_SAMPLES):  # still slow: halves again and again, down to the floor only
        clock.now += SAMPLE_INTERVAL_S
        pace.after_batch(10)
    assert pace.rate == pytest.approx(FLOOR_SHARE * 100.0)
    slow = pace.rate
    latency["ms"] = 5.0
    for _ in range(MIN_SAMPLES):  # quiet again: the rate grows
        pace.after_batch(10)
    assert pace.rate == pytest.approx(slow * GROWTH)
    assert pace.to_dict()["latency_from"] == "searches"
    with pytest.raises(ValueError, match="p99_factor must be above 1"):
        Pace(p99_factor=0.5)


def test_resumed_pace_keeps_its_idle_p99_only_for_the_same_source() -> None:
    from components.rollout.pacing import Pace, SearchLatency

    calls = {"n": 0}

    def timed() -> float:
        calls["n"] += 1
        return 4.0

    recorded = {"idle_p99_ms": 9.0, "latency_from": "searches"}
    pace = Pace.resumed(recorded, 1.5, None)
    pace.watch([SearchLatency(timed)])
    assert pace.idle_p99_ms == 9.0 and calls["n"] == 0  # the idle p99 measured before the crash
    pace = Pace.resumed({**recorded, "latency_from": "service"}, 1.5, None)
    pace.watch([SearchLatency(timed)])
    assert pace.idle_p99_ms == pytest.approx(4.0) and calls["n"] == 30  # another source: measured again


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    from components.rollout.pacing import histogram_quantile

    inf = float("inf")
    # 100 observations: 50 up to 5 ms, 40 in (5, 10], 10 in (10, 20]: p99 is 90 % of the way into (10, 20]
    assert histogram_quantile(0.99, [5.0, 10.0, 20.0, inf], [50, 90, 100, 100]) == pytest.approx(19.0)
    assert histogram_quantile(0.5, [5.0, 10.0, 20.0, inf], [50, 90, 100, 100]) == pytest.approx(5.0)
    assert histogram_quantile(0.99, [5.0, 10.0, inf], [10, 10, 20]) == 10.0  # in +Inf: the highest bound
    assert histogram_quantile(0.99, [5.0, inf], [0, 0]) is None
