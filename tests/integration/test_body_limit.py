"""A request body over the query service's limit gets a 413 that a plain client reads, even one that sends
the whole body before reading (Python's urllib); the service drains such a body within bounds and goes on.

The service here is the query service's own middleware (:class:`components.serving.app.BodyLimit`) in front of
a ``POST /search`` that reads a JSON body, served by uvicorn on 127.0.0.1 as ``compatflow serve`` serves it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from starlette.requests import Request  # at module level: the route's annotation is resolved here

from components.serving.app import BodyLimit
from components.serving.limits import MAX_BODY_BYTES, MAX_DRAIN_BYTES

BODY_SECONDS = 2.0  # the service's body-read timeout here (30 s by default)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    import uvicorn
    from fastapi import FastAPI

    inner = FastAPI()

    @inner.post("/search")
    async def search(request: Request) -> dict[str, int]:
        return {"queries": len((await request.json())["queries"])}

    @inner.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    inner.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, body_seconds=BODY_SECONDS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(inner, host="127.0.0.1", port=free, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the service did not start"
        time.sleep(0.05)
    try:
        yield free
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def post(port: int, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/search", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
        return answer.status == 200


@pytest.mark.parametrize("megabytes", [20, 200])
def test_urllib_sending_a_body_over_the_limit_reads_a_413(port: int, megabytes: int) -> None:
    body = b'{"queries": ["' + b"x" * (megabytes * 1_000_000) + b'"], "k": 3}'
    t0 = time.monotonic()
    status, answer = post(port, body)
    seconds = time.monotonic() - t0
    assert status == 413, answer
    assert f"request body of {len(body)} bytes, over the limit of {MAX_BODY_BYTES} bytes" in answer["detail"]
    assert seconds < 5 if megabytes == 20 else seconds < 30, seconds
    assert healthy(port) and post(port, b'{"queries": ["a cat"], "k": 3}') == (200, {"queries": 1})


def test_a_chunked_body_over_the_limit_is_drained_and_answered(port: int) -> None:
    """No Content-Length: the 413 comes once the bytes received pass the limit, the rest read first."""
    chunk = b"x" * 65536
    count = 4 * MAX_BODY_BYTES // len(chunk)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(count):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # no reset midway: the body is read
        sock.sendall(b"0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"over the limit of 1048576 bytes" in answer and healthy(port)


def test_a_declared_body_that_never_comes_and_one_beyond_the_drain_bound_are_answered_at_once(
    port: int,
) -> None:
    """A client that declares a body and sends nothing waits one idle pause, not the whole drain; a declared
    length over the drain bound is answered without reading."""
    for declared, within in ((100 * MAX_BODY_BYTES, 5.0), (MAX_DRAIN_BYTES + 1, 1.0)):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared)
            answer = b""
            with contextlib.suppress(OSError):
                while data := sock.recv(65536):
                    answer += data
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - t0 < within
    assert healthy(port)


def test_a_declared_body_that_stops_coming_is_a_408_after_the_body_read_timeout(port: int) -> None:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"queries": ')
        answer = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                answer += data
    seconds = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request body not received within 2 s (12 bytes arrived)" in answer
    assert BODY_SECONDS <= seconds < BODY_SECONDS + 3 and healthy(port)
