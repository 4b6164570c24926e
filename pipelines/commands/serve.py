"""``compatflow serve``: the HTTP search service of a workspace, following its serving record live."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, WorkspaceOpt, exit_codes, fail, serving_workspace

LOOPBACK = "127.0.0.1"


def _check_host(host: str) -> None:
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        fail(f"--host {host!r} is not an IP address (give the address of the interface to bind)")
    if address.is_unspecified:
        fail(f"--host {host}: binding every interface is refused; give the address of one interface")


def _server(app: Any, host: str, port: int, log_level: str) -> Any:
    """A uvicorn server that stops on SIGTERM/SIGINT after in-flight requests and returns normally
    (uvicorn itself re-raises the signal after shutting down, which would end the process by that signal)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False)
    return Server(config)


@exit_codes({0: "stopped by SIGTERM or SIGINT", 1: "could not listen or start"})
def serve(
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port to listen on.", min=1, max=65535)],
    host: Annotated[
        str, typer.Option(help="Address to bind (loopback by default; another one only when given here).")
    ] = LOOPBACK,
    uri: Annotated[
        str | None,
        typer.Option(
            help="Milvus URI instead of the serving record's (e.g. a milvus-lite server while a rollout "
            "runs in another process: an embedded .db directory is held by one process only)."
        ),
    ] = None,
    watch_interval: Annotated[
        float, typer.Option(help="Seconds between checks of the serving record.", min=0.05)
    ] = 0.25,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Serve searches over HTTP (POST /search, GET /healthz /readyz /metrics) until SIGTERM or SIGINT.

    Queries are answered by the serving record's query model against the collection it names; when a
    rollout or a rollback rewrites the record, both are swapped together. While it runs, the service is
    announced in the workspace (services/<hostname>-<port>.json): a rollout with an SLO throttle paces its
    backfill on the latency of these users' queries."""
    _check_host(host)
    ws, verify = serving_workspace(config, workspace)
    from components.adapters.services import announced
    from components.serving.app import create_app

    if not ws.serving_path.is_file():
        typer.echo(
            f"no serving record at {ws.serving_path} yet: /readyz answers 503 until one is written", err=True
        )
    has_lineage = (ws.lineage_dir / "feature_store.yaml").is_file()  # captions of cold shards
    app = create_app(
        ws.serving_path,
        state_path=ws.rollout_state_path,
        uri=uri,
        watch_interval_s=watch_interval,
        verify=verify,
        lineage_repo=ws.lineage_dir if has_lineage else None,
    )
    server = _server(app, host, port, log_level)
    try:
        with announced(ws.services_dir, host, port):  # a rollout paces itself on these queries
            server.run()
    except OSError as err:
        fail(f"cannot listen on {host}:{port}: {err}", code=1)
    if not server.started:
        fail(f"the service did not start on {host}:{port} (see the log above)", code=1)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
