"""Server processes this machine starts on 127.0.0.1 (Milvus standalone, ``milvus-lite server``, ``mlflow
server``): waiting until one is ready, or saying why it is not, and stopping it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ServerStartError(RuntimeError):
    """A server did not start; the message names it and carries its log's tail or its log's path."""


@dataclass
class LoopbackServer(contextlib.AbstractContextManager["LoopbackServer"]):
    """A server process listening on 127.0.0.1:``port``, its output in ``data_dir/server.log``; a ``with``
    block stops it at its end."""

    data_dir: Path
    process: subprocess.Popen
    port: int

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""

    def _signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM the server, SIGKILL after ``timeout_s``; its exit status."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        return int(self.process.returncode)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(argv: list[str], log: Path, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` with no input, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)


def wait_until_ready(
    server: LoopbackServer,
    ready: Callable[[], bool],
    *,
    name: str,
    wait_s: float,
    error: type[ServerStartError] = ServerStartError,
) -> None:
    """Poll ``ready()`` every 0.2 s until it holds. Raises ``error`` with the tail of the server's log when
    its process exits first, and after stopping it when ``wait_s`` passes."""
    deadline, log = time.monotonic() + wait_s, server.log_path
    while not ready():
        if server.process.poll() is not None:
            status, tail = server.process.returncode, server.log_tail() or "(no log)"
            raise error(f"{name} exited with status {status} while starting; its log ({log}):\n{tail}")
        if time.monotonic() > deadline:
            server.stop()
            raise error(f"{name} was not ready within {wait_s:.0f} s; its log: {log}")
        time.sleep(0.2)


def start_server(
    argv: list[str],
    data_dir: Path,
    port: int,
    *,
    name: str,
    wait_s: float = 120,
    error: type[ServerStartError] = ServerStartError,
    env: dict[str, str] | None = None,
) -> LoopbackServer:
    """Start ``argv`` (a server that listens on 127.0.0.1:``port``; ``env`` added to this process's
    environment), its output appended to ``data_dir/server.log``, and wait until it accepts connections."""

    def accepts_connections() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    data_dir.mkdir(parents=True, exist_ok=True)
    process = launch(argv, data_dir / "server.log", env={**os.environ, **(env or {})})
    server = LoopbackServer(data_dir, process, port)
    wait_until_ready(server, accepts_connections, name=name, wait_s=wait_s, error=error)
    return server
