"""Server processes this machine starts on 127.0.0.1 (Milvus standalone, ``milvus-lite server``, ``mlflow
server``): waiting until one is ready, or saying why it is not, and stopping it."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ServerStartError(RuntimeError):
    """A server did not start; the message names it and carries its log's tail or its log's path."""


def accepts_connections(port: int) -> Callable[[], bool]:
    """A readiness check: something accepts TCP connections on 127.0.0.1:``port``."""

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    return ready


def wait_until_ready(
    process: subprocess.Popen,
    ready: Callable[[], bool],
    *,
    name: str,
    log: Path,
    stop: Callable[[], object],
    wait_s: float,
    error: type[ServerStartError] = ServerStartError,
) -> None:
    """Poll ``ready()`` every 0.2 s until it holds. Raises ``error`` with the tail of ``log`` when the process
    exits first, and after ``stop()`` when ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    while not ready():
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"
            status = process.returncode
            raise error(f"{name} exited with status {status} while starting; its log ({log}):\n{tail}")
        if time.monotonic() > deadline:
            stop()
            raise error(f"{name} was not ready within {wait_s:.0f} s; its log: {log}")
        time.sleep(0.2)


def terminate(process: subprocess.Popen, timeout_s: float = 20) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


@dataclass
class LoopbackServer:
    """A server process listening on 127.0.0.1:``port``, its output in ``data_dir/server.log``."""

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
        return terminate(self.process)


def start_server(
    argv: list[str],
    data_dir: Path,
    port: int,
    *,
    name: str,
    wait_s: float = 120,
    error: type[ServerStartError] = ServerStartError,
) -> LoopbackServer:
    """Start ``argv`` (a server that listens on 127.0.0.1:``port``), its output appended to
    ``data_dir/server.log``, and wait until it accepts connections."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "server.log", "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LoopbackServer(data_dir, process, port)
    wait_until_ready(
        process,
        accepts_connections(port),
        name=name,
        log=server.log_path,
        stop=server.stop,
        wait_s=wait_s,
        error=error,
    )
    return server
