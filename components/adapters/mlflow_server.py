"""An MLflow tracking server on loopback: a sqlite backend store and an artifact store served through the
server (``--artifacts-destination``: clients upload and download artifacts over HTTP, as on the cluster,
whose manifest proxies an object store the same way). Used by the cluster rehearsal and the tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compat.io import free_loopback_port


class MlflowServerError(RuntimeError):
    """The server did not start; the message carries its log's tail."""


@dataclass
class MlflowServer:
    data_dir: Path
    process: subprocess.Popen
    port: int

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def stop(self) -> int:
        """Terminate the server (kill after 20 s); its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start(data_dir: str | os.PathLike[str], *, port: int | None = None, wait_s: float = 120) -> MlflowServer:
    """Start ``mlflow server`` on 127.0.0.1 (a free port unless ``port``) with its store under ``data_dir``
    and wait until it accepts connections."""
    data = Path(data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
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
    with open(data / "server.log", "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = MlflowServer(data, process, port)
    deadline = time.monotonic() + wait_s
    while True:
        if process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-3000:]
            raise MlflowServerError(f"mlflow server exited with {process.returncode}:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise MlflowServerError(
                    f"mlflow server did not accept connections within {wait_s:.0f} s; log: {server.log_path}"
                ) from None
            time.sleep(0.2)


@contextlib.contextmanager
def running(data_dir: str | os.PathLike[str], **kwargs: object) -> Iterator[MlflowServer]:
    """:func:`start` for the duration of a block, then stop."""
    server = start(data_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
