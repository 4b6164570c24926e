"""The MLflow tracking server compatflow starts on loopback (components.adapters.mlflow_server)."""

from __future__ import annotations

import urllib.request
from pathlib import Path


def test_the_tracking_server_answers_on_loopback_and_starts_no_job_runner(tmp_path: Path) -> None:
    import psutil

    from components.adapters import mlflow_server

    with mlflow_server.start(tmp_path / "mlflow") as server:
        assert server.uri.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{server.uri}/health", timeout=30) as answer:
            assert answer.status == 200
        children = psutil.Process(server.process.pid).children(recursive=True)
        commands = [" ".join(child.cmdline()) for child in children]
        assert commands and not any("huey" in command for command in commands), commands
