"""The pace's reading of a service's latency histogram, from real prometheus_client exposition text."""

from __future__ import annotations

import pytest

from components.rollout.pacing import LATENCY_METRIC, _latency_buckets, histogram_quantile


def _exposition(observations: dict[str, list[float]]) -> str:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    histogram = Histogram(
        LATENCY_METRIC, "query latency", ["route"], buckets=(0.005, 0.01, 0.05, 0.1), registry=registry
    )
    for route, values in observations.items():
        for value in values:
            histogram.labels(route=route).observe(value)
    other = Histogram("other_latency_seconds", "not the pace's", registry=registry)
    other.observe(5.0)
    return generate_latest(registry).decode()


def test_buckets_are_read_with_the_library_parser_and_summed_over_labels() -> None:
    text = _exposition({"search": [0.004, 0.02, 0.02, 0.07], "batch": [0.2]})
    buckets = _latency_buckets(text)
    assert buckets == {5.0: 1.0, 10.0: 1.0, 50.0: 3.0, 100.0: 4.0, float("inf"): 5.0}
    bounds = sorted(buckets)
    assert histogram_quantile(0.5, bounds, [buckets[b] for b in bounds]) == pytest.approx(
        40.0
    )  # rank 2.5 of 5: 10 + (2.5 - 1) / 2 * 40 ms


def test_text_without_the_histogram_gives_nothing() -> None:
    assert _latency_buckets("# HELP up up\n# TYPE up gauge\nup 1\n") == {}
    with pytest.raises(ValueError):
        _latency_buckets(f'{LATENCY_METRIC}_bucket{{le="0.1" 3\n')
