"""Milvus standalone on loopback only: the session's server, its listening sockets, refusal and stop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from components.adapters import milvus_server

ROOT = Path(__file__).resolve().parents[2]
LISTEN = "0A"


def _listening(proc_net: str) -> list[str]:
    """Local addresses (hex ``ADDR:PORT``) of the listening TCP sockets in a /proc/net table."""
    path = Path(proc_net)
    if not path.is_file():
        return []
    rows = [line.split() for line in path.read_text().splitlines()[1:]]
    return [row[1] for row in rows if row[3] == LISTEN]


def _is_loopback(hex_addr: str) -> bool:
    addr = hex_addr.split(":")[0]
    if len(addr) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return addr.endswith("7F")
    return addr == "00000000000000000000000001000000"  # ::1


def test_nothing_listens_beyond_loopback_while_milvus_runs(milvus_standalone) -> None:
    """Milvus 2.3 binds every interface: the server shares this session's network namespace, whose only
    interface is loopback, so none of its wildcard sockets can be reached from another machine."""
    server = milvus_standalone
    assert server.healthy() and server.process.poll() is None
    assert os.readlink(f"/proc/{server.process.pid}/ns/net") == os.readlink("/proc/self/ns/net")
    sockets = _listening("/proc/net/tcp") + _listening("/proc/net/tcp6")
    port = f"{server.port:04X}"
    assert any(s.endswith(f":{port}") for s in sockets), f"the gRPC port {server.port} is not listening"
    wildcard = [s for s in sockets if not _is_loopback(s)]
    assert wildcard, "Milvus 2.3 was expected to bind every interface (the reason for the namespace)"
    assert milvus_server.interfaces() == ["lo"], (
        f"sockets {wildcard} listen beyond loopback in a namespace with {milvus_server.interfaces()}"
    )


def _in_own_namespace(script: str, *, with_veth: bool, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a Python script in a fresh network namespace (loopback up; a veth pair too if asked)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to make a network namespace")
    setup = "ip link set lo up" + ("; ip link add v0 type veth peer name v1" if with_veth else "")
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", f'{setup}; exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_start_refuses_a_namespace_with_another_interface(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        from components.adapters.milvus_server import start
        start({str(tmp_path / "data")!r})
        """
    )
    done = _in_own_namespace(script, with_veth=True, timeout=60)
    assert done.returncode != 0
    assert "listens on every network interface" in done.stderr and "v0" in done.stderr
    assert not (tmp_path / "data").exists(), "nothing may be written or started before the refusal"


def test_a_loaded_server_stops_within_seconds(tmp_path) -> None:
    """SIGTERM with a loaded collection waits common.gracefulStopTimeout (1800 s by default): the server is
    started with a short one and stopped well within it."""
    from _milvus import milvus_binaries_cache

    script = textwrap.dedent(
        f"""
        import time
        from pymilvus import MilvusClient
        from components.adapters.milvus_server import start
        data, binaries = {str(tmp_path / "data")!r}, {str(milvus_binaries_cache())!r}
        server = start(data, bin_dir=binaries, graceful_stop_s=3)
        client = MilvusClient(uri=server.uri)
        client.create_collection("loaded", dimension=8)
        client.insert("loaded", [{{"id": i, "vector": [float(i + 1)] * 8}} for i in range(100)])
        assert client.get_load_state("loaded")["state"].name == "Loaded"
        client.close()
        t0 = time.monotonic()
        server.stop()
        print("stopped in", round(time.monotonic() - t0, 2))
        """
    )
    t0 = time.monotonic()
    done = _in_own_namespace(script, with_veth=False, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    stopped_in = float(done.stdout.split("stopped in")[-1])
    assert stopped_in < 3 + 5, f"stop took {stopped_in} s"
    assert time.monotonic() - t0 < 200


def test_serve_milvus_command_prints_the_uri_and_stops_on_sigterm(tmp_path) -> None:
    """`compatflow index serve-milvus` in a loopback-only namespace of its own (the session's already runs a
    Milvus): the server starts in place, the printed index.uri answers, SIGTERM stops it and the command
    exits 0; the data folder survives a restart."""
    from _milvus import milvus_binaries_cache

    script = textwrap.dedent(
        f"""
        import signal, subprocess, sys
        from pymilvus import MilvusClient
        argv = [sys.executable, "-m", "pipelines.cli", "index", "serve-milvus"]
        argv += ["--data", {str(tmp_path / "m")!r}, "--binaries", {str(milvus_binaries_cache())!r}]
        argv += ["--graceful-stop", "3"]  # "kept" is loaded: a stop waits this long (10 s by default)
        log_file = {str(tmp_path / "m" / "logs" / "milvus-stdout.log")!r}
        for round_ in range(2):
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            uri = None
            for line in proc.stdout:
                if "index.uri:" in line:
                    uri = line.split("index.uri:")[1].strip()
                    break
            assert uri and uri.startswith("http://127.0.0.1:"), f"no index.uri printed (exit {{proc.poll()}})"
            try:
                client = MilvusClient(uri=uri)
                if round_ == 0:
                    client.create_collection("kept", dimension=4)
                    client.insert("kept", [{{"id": 1, "vector": [0.1, 0.2, 0.3, 0.4]}}])
                    client.flush("kept")
                else:
                    assert client.has_collection("kept")
                client.close()
            except Exception:  # what the server said, for whoever reads the failure
                proc.send_signal(signal.SIGTERM)
                print(f"round {{round_}}: the command said:", proc.communicate(timeout=60)[0][-3000:])
                print("milvus-stdout.log:", open(log_file, errors="replace").read()[-3000:])
                raise
            proc.send_signal(signal.SIGTERM)
            rest = proc.communicate(timeout=60)[0]
            assert proc.returncode == 0 and "Milvus stopped" in rest, rest[-2000:]
            print(f"round {{round_}}:", rest.strip().splitlines()[-1])
        print("both rounds ok")
        """
    )
    done = _in_own_namespace(script, with_veth=False, timeout=400)
    assert done.returncode == 0 and "both rounds ok" in done.stdout, done.stdout[-7000:] + done.stderr[-3000:]
    print(done.stdout)
