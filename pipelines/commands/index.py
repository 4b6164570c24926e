"""``compatflow index``: the gallery index's server for local use (Milvus standalone on loopback only), and
moving a served gallery to another index."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import ConfigOpt, JsonOpt, WorkspaceOpt, echo_json, exit_codes, fail, refusing

index_app = typer.Typer(help="The gallery index: run a Milvus standalone server locally, on loopback only.")


def _into_namespace(name: str) -> None:
    """Re-run this command inside the named network namespace (created with loopback up if missing)."""
    if os.geteuid() != 0:
        fail(
            "Milvus 2.3 listens on every network interface, so compatflow starts it only in a network "
            "namespace with loopback alone, and making one needs root. Run this command as root, or inside "
            "a container or 'unshare --net' namespace whose only interface is lo."
        )
    if name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
        subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    argv = [sys.executable, "-m", "pipelines.cli", *sys.argv[1:]]
    os.execvp("ip", ["ip", "netns", "exec", name, *argv])


def _in_named_namespace(name: str) -> bool:
    with contextlib.suppress(OSError):
        return os.stat(f"/run/netns/{name}").st_ino == os.stat("/proc/self/ns/net").st_ino
    return False


@index_app.command("serve-milvus")
@exit_codes({0: "stopped by SIGTERM or SIGINT", 2: "a bad argument, or Milvus did not start (its log shown)"})
def serve_milvus(
    data: Annotated[Path, typer.Option(help="Folder of the server's data, configs and logs.")],
    netns: Annotated[
        str,
        typer.Option(
            help="Network namespace to run in when this one has interfaces beyond loopback (root; created "
            "if missing; compatflow commands that use the server run in it too: 'ip netns exec NAME ...')."
        ),
    ] = "compatflow",
    binaries: Annotated[
        Path | None,
        typer.Option(help="Folder to unpack the server's binaries into (~250 MB; default: --data)."),
    ] = None,
    graceful_stop: Annotated[
        int, typer.Option(help="Seconds a stop may wait for in-flight work.", min=1)
    ] = 10,
) -> None:
    """Run Milvus standalone (PyPI package milvus) on loopback only until SIGTERM or SIGINT.

    Prints the index.uri to put in a config. Data survives a restart on the same --data folder."""
    from components.adapters import milvus_server

    if not milvus_server.loopback_only():
        _into_namespace(netns)
    with refusing(milvus_server.MilvusServerError):
        server = milvus_server.start(data, bin_dir=binaries, graceful_stop_s=graceful_stop)
    typer.echo(f"Milvus standalone {milvus_server.server_version()} is ready (data in {server.data_dir})")
    typer.echo(f"  index.uri: {server.uri}")
    if _in_named_namespace(netns):
        typer.echo(
            f"  it listens in network namespace {netns!r} only: run the commands that use it there, "
            f"e.g. ip netns exec {shlex.quote(netns)} .venv/bin/compatflow run --config CONFIG"
        )
    typer.echo("SIGTERM or Ctrl+C stops it.")
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    while not stopping and server.process.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=0.5)
    if not stopping:
        fail(f"Milvus exited with status {server.process.returncode}:\n{server.log_tail()}")
    status = server.stop()
    said = {-6: "an abort: Milvus 2.3 aborts once its embedded etcd has stopped, data written"}.get(status)
    typer.echo(f"Milvus stopped (status {status}{f': {said}' if said else ''}).")


@index_app.command("move")
@exit_codes()
def move(
    to: Annotated[str, typer.Option(help="URI of the index to serve the gallery from (e.g. a server).")],
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    batch_size: Annotated[int, typer.Option(help="Rows per copied batch.", min=1)] = 2000,
    as_json: JsonOpt = False,
) -> None:
    """Move the served gallery (the collections its serving record and rollout states name, vectors
    included) to the index at --to, then serve from it: a killed move is run again; the source is left as it
    was. Refused before anything is written when a collection of those names or the alias at --to belongs to
    another deployment (a copy of this workspace included). Set index.uri to --to in the config afterwards
    (a config naming the old index is refused)."""
    from pipelines.commands._common import holding_workspace, workspace_of

    chosen = workspace_of(config, workspace)
    from components.adapters.index import GalleryIndexError
    from components.rollout import RolloutError
    from components.rollout.move import move_gallery
    from components.serving.record import ServingError

    with refusing(RolloutError, GalleryIndexError, ServingError, OSError):
        with holding_workspace(chosen, "compatflow index move"):
            moved = move_gallery(chosen, to, batch_size=batch_size)
    if as_json:
        echo_json(moved)
        return
    if not moved["collections"]:
        typer.echo(f"the gallery is already served from {to}")
        return
    rows = ", ".join(f"{name} {n} rows" for name, n in moved["collections"].items())
    typer.echo(f"moved {rows} from {moved['from']} to {to}; {moved['served']} is served from {to} now")
    typer.echo(f"set index.uri: {to} in the config (the source index was left as it was)")


def register(app: typer.Typer) -> None:
    app.add_typer(index_app, name="index")
