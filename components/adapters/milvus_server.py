"""A Milvus standalone server (PyPI ``milvus``) started on loopback only, for local use and tests.

Milvus 2.3 listens on every interface whatever its ``*.ip`` settings, so it is started only inside a network
namespace whose one interface is loopback (:func:`loopback_only`): the caller's own, or one entered with
:func:`enter_private_network` (root) or ``ip netns exec``; its clients run in the same namespace. Everything
the server writes (binaries, configs, etcd, segments, logs, pid file) lives under one data folder; its ports
are the first free ones from Milvus's defaults. :meth:`MilvusStandalone.stop` ends it within
``graceful_stop_s`` (Milvus's own ``common.gracefulStopTimeout`` is 1800 s with a loaded collection).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import lzma
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from compat.io import free_loopback_port
from components.adapters.loopback import LoopbackServer, ServerStartError, launch, wait_until_ready

CLONE_NEWNET = 0x40000000


class MilvusServerError(ServerStartError):
    """The Milvus server cannot be started here; the message says why and what to do."""


def interfaces() -> list[str]:
    """Names of the network interfaces of this process's network namespace."""
    return sorted(name for _, name in socket.if_nameindex())


def loopback_only() -> bool:
    """True when this network namespace has no interface but loopback (nothing here reaches beyond it)."""
    return interfaces() == ["lo"]


def enter_private_network() -> None:
    """Move this process (and every child it starts later) into a new network namespace with only
    loopback, up. Needs root (CAP_SYS_ADMIN); call it before any thread starts (namespaces are per thread).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise MilvusServerError(f"cannot create a private network namespace: {os.strerror(err)} (needs root)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)


def server_version() -> str:
    """The version of the installed Milvus server package."""
    import milvus

    return str(milvus.__version__)


def unpack_binaries(root: Path) -> Path:
    """The server's binaries under ``root/bin``, unpacked from the wheel once (by digest); returns the
    executable."""
    try:
        import milvus
    except ImportError as exc:
        raise MilvusServerError(
            "the Milvus server package is not installed: `pip install milvus==2.3.5` (requirements/dev.txt)"
        ) from exc
    source = Path(milvus.__file__).parent / "data" / "bin"
    bin_dir = Path(root) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for packed in sorted(source.glob("*.lzma")):
        target = bin_dir / packed.name[: -len(".lzma")]
        digest = hashlib.md5(packed.read_bytes()).hexdigest()
        stamp = target.with_name(target.name + ".lzma.md5")
        if target.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
            continue
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # two starts at once never share one
        with lzma.open(packed) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        tmp.chmod(0o755)
        tmp.replace(target)
        stamp.write_text(digest)
    return bin_dir / "milvus"


def _die_with_parent() -> None:
    """In the server's child process: SIGTERM it when the process (thread) that started it ends, so a
    killed test session or command leaves no server behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _write_config(data_dir: Path, graceful_stop_s: int) -> tuple[int, int]:
    """Render ``configs/milvus.yaml`` from the wheel's template with free loopback ports; returns
    (gRPC port, health port)."""
    from milvus import MilvusServerConfig

    config = MilvusServerConfig(data_dir=str(data_dir))
    for role in "proxy rootCoord queryCoord queryNode indexCoord indexNode dataCoord dataNode".split():
        config.set(f"{role}.ip", "127.0.0.1")
    config.set("common.gracefulStopTimeout", int(graceful_stop_s))
    config.set("log.level", "warn")
    config.resolve()  # picks the first free port from each default and writes the file
    health, sock = config.resolve_port(9091)
    sock.close()
    # the embedded etcd gets its own loopback ports (``etcd.config.path``): by default it listens on 2379 and
    # 2380 whatever ``milvus.yaml`` says, so a second server on this machine would fail to start
    client, peer = (f"http://127.0.0.1:{free_loopback_port()}" for _ in range(2))
    etcd = data_dir / "configs" / "embedEtcd.yaml"
    etcd.write_text(
        "name: default\n"
        f"listen-client-urls: {client}\nadvertise-client-urls: {client}\n"
        f"listen-peer-urls: {peer}\ninitial-advertise-peer-urls: {peer}\n"
        f"initial-cluster: default={peer}\n"
    )
    _add_keys(data_dir / "configs" / "milvus.yaml", "etcd", ["config:", f"  path: {etcd}"])
    # A standalone query node has no peer to hand its segments to: waiting for one (30 s by default) runs
    # past common.gracefulStopTimeout, and Milvus then force-quits (a panic) without revoking its etcd
    # sessions, which a restart on this folder must wait out.
    _add_keys(data_dir / "configs" / "milvus.yaml", "queryNode", ["gracefulStopTimeout: 0"])
    return int(config.get("proxy_port")), int(health)


def _add_keys(milvus_yaml: Path, section: str, lines: list[str]) -> None:
    """Add ``lines`` (YAML, indented from the section's level) at the top of a top-level ``section`` of
    ``milvus.yaml``: the wheel's config writer only replaces keys its template already has."""
    text = milvus_yaml.read_text().splitlines()
    at = text.index(f"{section}:") + 1
    text[at:at] = [f"  {line}" for line in lines]
    milvus_yaml.write_text("\n".join(text) + "\n")


@dataclass
class MilvusStandalone(LoopbackServer):
    """A running Milvus standalone process (see the module doc); its ``uri`` is the ``index.uri`` to use."""

    health_port: int
    graceful_stop_s: int

    @property
    def log_path(self) -> Path:
        return self.data_dir / "logs" / "milvus-stdout.log"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as resp:
                return b"OK" in resp.read()
        except OSError:
            return False

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)  # the server's whole session

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM the server, SIGKILL after the graceful time; its exit status."""
        return super().stop(self.graceful_stop_s + 5 if timeout_s is None else timeout_s)


def start(
    data_dir: str | os.PathLike[str],
    *,
    bin_dir: str | os.PathLike[str] | None = None,
    graceful_stop_s: int = 10,
) -> MilvusStandalone:
    """Start Milvus standalone with its data under ``data_dir`` and wait until it is healthy; a ``with``
    block stops it at its end.

    ``bin_dir`` holds the unpacked binaries (~250 MB; default ``data_dir``; several data folders may
    share one). Refuses unless this network namespace is loopback-only (see the module doc).
    """
    if not loopback_only():
        raise MilvusServerError(
            "Milvus 2.3 listens on every network interface; it is started only in a network namespace with "
            f"loopback alone (this one has {', '.join(interfaces())}). As root: `compatflow index "
            "serve-milvus` creates one, or run inside `unshare --net sh -c 'ip link set lo up; ...'`"
        )
    data = Path(data_dir).expanduser().resolve()
    (data / "logs").mkdir(parents=True, exist_ok=True)
    exe = unpack_binaries(Path(bin_dir).expanduser().resolve() if bin_dir else data)
    port, health = _write_config(data, graceful_stop_s)
    env = {
        **os.environ,
        "DEPLOY_MODE": "STANDALONE",
        "MILVUSCONF": str(data / "configs"),
        "METRICS_PORT": str(health),
        "MILVUS_RUN_DIR": str(data / "run"),  # its pid file (default /run/milvus/standalone.pid)
        "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    }
    argv, log = [str(exe), "run", "standalone"], data / "logs" / "milvus-stdout.log"
    process = launch(argv, log, cwd=data, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    server = MilvusStandalone(data, process, port, health, graceful_stop_s)
    wait_until_ready(server, server.healthy, name="Milvus standalone", wait_s=180, error=MilvusServerError)
    return server
