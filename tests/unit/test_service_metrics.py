"""The service's /metrics carries the standard process and Python collectors beside its own series."""

from __future__ import annotations

from pathlib import Path


def test_metrics_hold_the_standard_collectors(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from components.serving.app import create_app

    app = create_app(
        tmp_path / "serving.json", watch_interval_s=60
    )  # no record yet: not ready, still scraped
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 503
        text = client.get("/metrics").text
        second = TestClient(create_app(tmp_path / "serving.json", watch_interval_s=60))  # one registry each
        with second:
            assert "process_resident_memory_bytes" in second.get("/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_gc_collections_total"):
        assert f"\n{name}" in text, name
    assert "python_info{" in text and "compatflow_queries_total" in text
