"""An MLflow tracking server on loopback: a sqlite backend store and an artifact store served through the
server (``--artifacts-destination``: clients upload and download artifacts over HTTP, as on the cluster,
whose manifest proxies an object store the same way). Used by the cluster rehearsal and the tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from compat.io import free_loopback_port
from components.adapters.loopback import LoopbackServer, ServerStartError, start_server


class MlflowServerError(ServerStartError):
    """The server did not start; the message carries its log's tail."""


def start(data_dir: str | os.PathLike[str]) -> LoopbackServer:
    """Start ``mlflow server`` on a free 127.0.0.1 port with its store under ``data_dir`` and wait until it
    accepts connections; a ``with`` block stops it at its end."""
    data, port = Path(data_dir).resolve(), free_loopback_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    argv = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    argv += ["--backend-store-uri", f"sqlite:///{data / 'backend.db'}"]
    argv += ["--artifacts-destination", str(data / "artifacts")]
    # No job runner: compatflow submits no MLflow server jobs, and the runner is four more processes.
    no_jobs = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return start_server(argv, data, port, name="mlflow server", error=MlflowServerError, env=no_jobs)
