"""Shared test set-up: offline, telemetry-free environment and a per-test TMPDIR."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(autouse=True)
def _tmpdir_env(tmp_path, monkeypatch):
    """Point TMPDIR (and tempfile's cached default) inside the test's own tmp_path."""
    import tempfile

    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield


def _free_loopback_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory):
    """A real ``milvus-lite server`` on a free 127.0.0.1 port for the session; yields its URI."""
    import shutil
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = Path(sys.executable).with_name("milvus-lite")
    exe = str(exe) if exe.is_file() else shutil.which("milvus-lite")
    if exe is None:
        pytest.fail("the milvus-lite executable is missing from the environment (pip package milvus-lite)")
    data = tmp_path_factory.mktemp("milvus-server")
    port = _free_loopback_port()
    log = open(data / "server.log", "wb")
    proc = subprocess.Popen(
        [exe, "server", "--data-dir", str(data / "data"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            log.close()
            output = (data / "server.log").read_text()
            pytest.fail(f"milvus-lite server exited with {proc.returncode}: {output}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("milvus-lite server did not accept connections within 60 s")
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="session")
def stream_dir(tmp_path_factory):
    """A small synthetic stream of four phases (16 gallery items each), shared by the upgrade-chain tests."""
    from compat.data.synth import generate_stream

    out = tmp_path_factory.mktemp("chain-stream") / "stream"
    generate_stream(
        out, phases=4, samples_per_phase=96, seed=0, eval_per_domain=12, gallery_per_domain=16, image_size=64
    )
    return out
