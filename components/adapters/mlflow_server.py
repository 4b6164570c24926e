"""An MLflow tracking server on loopback: a sqlite backend store and an artifact store served through the
server (``--artifacts-destination``: clients upload and download artifacts over HTTP, as on the cluster,
whose manifest proxies an object store the same way). Used by the cluster rehearsal and the tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from compat.io import free_loopback_port
from components.adapters.loopback import LoopbackServer, ServerStartError, start_server

MlflowServer = LoopbackServer


class MlflowServerError(ServerStartError):
    """The server did not start; the message carries its log's tail."""


def start(data_dir: str | os.PathLike[str], *, port: int | None = None, wait_s: float = 120) -> MlflowServer:
    """Start ``mlflow server`` on 127.0.0.1 (a free port unless ``port``) with its store under ``data_dir``
    and wait until it accepts connections."""
    data = Path(data_dir).resolve()
    port = port or free_loopback_port()
    argv = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{data / 'backend.db'}",
        "--artifacts-destination",
        str(data / "artifacts"),
        "--workers",
        "1",
    ]
    return start_server(argv, data, port, name="mlflow server", wait_s=wait_s, error=MlflowServerError)


@contextlib.contextmanager
def running(data_dir: str | os.PathLike[str], **kwargs: object) -> Iterator[MlflowServer]:
    """:func:`start` for the duration of a block, then stop."""
    server = start(data_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
