"""Shared test set-up: offline, telemetry-free environment and a per-test TMPDIR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _milvus import SERVER_BACKENDS, milvus_binaries_cache, server_uri

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# the rollout tests name their known-geometry encoders in serving records (components.serving.record)
os.environ.setdefault("COMPATFLOW_TRUSTED_MODULES", "benchmarks.synthetic_upgrade")


_NETNS_NOTE = "not tried"


def pytest_configure(config):
    """Run the whole session in a private network namespace with only loopback (root only): Milvus 2.3
    listens on every interface, and nothing a test starts may be reachable from beyond this machine."""
    global _NETNS_NOTE
    from components import milvus_server

    if milvus_server.loopback_only():
        _NETNS_NOTE = "the session's network namespace has loopback only"
        return
    if os.geteuid() != 0:
        _NETNS_NOTE = "not root, so the test session cannot make a private network namespace"
        return
    try:
        milvus_server.enter_private_network()
        _NETNS_NOTE = "the session runs in a private network namespace (loopback only)"
    except (OSError, RuntimeError) as exc:
        _NETNS_NOTE = f"the private network namespace failed: {exc}"


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


def _loopback_server(argv: list[str], port: int, data, name: str, wait_s: float = 120):
    """Start a server process (its output in ``data/server.log``) and wait until it accepts connections on
    127.0.0.1:``port``; yields ``http://127.0.0.1:port`` and stops it afterwards."""
    import socket
    import subprocess
    import time

    log = open(data / "server.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"{name} exited with {proc.returncode}: {(data / 'server.log').read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{name} did not accept connections within {wait_s:.0f} s")
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
def milvus_lite_server(tmp_path_factory):
    """A real ``milvus-lite server`` on a free 127.0.0.1 port for the session; yields its URI."""
    import shutil
    import sys

    exe = Path(sys.executable).with_name("milvus-lite")
    exe = str(exe) if exe.is_file() else shutil.which("milvus-lite")
    if exe is None:
        pytest.fail("the milvus-lite executable is missing from the environment (pip package milvus-lite)")
    data = tmp_path_factory.mktemp("milvus-lite-server")
    port = _free_loopback_port()
    argv = [exe, "server", "--data-dir", str(data / "data"), "--host", "127.0.0.1", "--port", str(port)]
    yield from _loopback_server(argv, port, data, "milvus-lite server", wait_s=60)


@pytest.fixture(scope="session")
def milvus_standalone(tmp_path_factory):
    """A real Milvus standalone server (PyPI ``milvus``) for the session, in this session's private
    network namespace; yields the :class:`~components.milvus_server.MilvusStandalone`."""
    from components import milvus_server

    if not milvus_server.loopback_only():
        pytest.skip(f"Milvus standalone needs a loopback-only network namespace: {_NETNS_NOTE}")
    server = milvus_server.start(
        tmp_path_factory.mktemp("milvus-standalone"), bin_dir=milvus_binaries_cache(), graceful_stop_s=3
    )
    yield server
    server.stop()


@pytest.fixture(params=SERVER_BACKENDS)
def milvus_server(request):
    """The URI of a real Milvus server, once per backend: ``milvus-lite server`` and Milvus standalone
    (the collections the test creates are dropped after it)."""
    return server_uri(request, request.param)


@pytest.fixture
def mlflow_server(tmp_path):
    """An MLflow tracking server (sqlite store, served artifacts) on a free 127.0.0.1 port; yields its URI."""
    import sys
    from pathlib import Path

    data = tmp_path / "mlflow-server"
    data.mkdir()
    port = _free_loopback_port()
    argv = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{data}/mlflow.db",
        "--artifacts-destination",
        str(data / "artifacts"),
        "--workers",
        "1",
    ]
    yield from _loopback_server(argv, port, data, "mlflow server")


@pytest.fixture(scope="session")
def stream_dir(tmp_path_factory):
    """A small synthetic stream of four phases (16 gallery items each), shared by the upgrade-chain tests."""
    from compat.data.synth import generate_stream

    out = tmp_path_factory.mktemp("chain-stream") / "stream"
    generate_stream(
        out, phases=4, samples_per_phase=96, seed=0, eval_per_domain=12, gallery_per_domain=16, image_size=64
    )
    return out


@pytest.fixture
def rendered():
    """The manifest overlays rendered once per session (``tests/_manifests.py``), copied for each test."""
    import copy

    from _manifests import rendered_overlays

    return copy.deepcopy(rendered_overlays())
