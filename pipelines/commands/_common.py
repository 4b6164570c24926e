"""Helpers shared by command modules: exit codes declared in the help, fatal errors, JSON output, the
options and the workspace a command works on."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

USAGE = 2  # click's own code for a usage error; ``fail`` uses it for every refused argument or config
DEFAULT_EXIT_CODES = {
    0: "done",
    1: "it failed; the message says why",
    USAGE: "refused before it started: a bad argument or config (the message names it)",
}
F = TypeVar("F", bound=Callable[..., Any])


def exit_codes(codes: Mapping[int, str] | None = None) -> Callable[[F], F]:
    """Declare a command's exit codes over :data:`DEFAULT_EXIT_CODES`: its help ends with them."""

    def declare(command: F) -> F:
        declared = {**DEFAULT_EXIT_CODES, **(codes or {})}
        rows = "\n".join(f"  {code}  {meaning}" for code, meaning in sorted(declared.items()))
        command.__doc__ = f"{inspect.cleandoc(command.__doc__ or '')}\n\n\b\nExit codes:\n{rows}"
        command.exit_codes = declared  # type: ignore[attr-defined]
        return command

    return declare


def fail(message: str, code: int = USAGE, *, next_step: str | None = None) -> NoReturn:
    """Print ``error: message`` (and ``next: next_step``) to stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    if next_step:
        typer.echo(f"next: {next_step}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def refusing(*errors: type[Exception], code: int = USAGE) -> Iterator[None]:
    """:func:`fail` with the message of any of ``errors`` raised in the block."""
    try:
        yield
    except errors as err:
        fail(str(err), code)


def key_values(pairs: list[str], option: str, example: str = "KEY=VALUE") -> dict[str, str]:
    """The ``KEY=VALUE`` pairs of a repeatable option, stripped (exit 2 on a pair without ``=`` or key)."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"{option} {pair!r}: expected {example}")
        values[key.strip()] = value.strip()
    return values


def echo_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


@contextlib.contextmanager
def holding_workspace(workspace: Any, purpose: str) -> Iterator[None]:
    """Hold the workspace lock for the block; exit 1 naming the holder if taken."""
    from components.state.lock import WorkspaceBusy, workspace_lock
    from components.state.workspace import Workspace

    with refusing(WorkspaceBusy, code=1):
        with workspace_lock(Workspace.coerce(workspace), purpose):
            yield


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu, cuda or auto.")]
OldModelOpt = Annotated[
    Path, typer.Option(help="Production checkpoint (frozen), or a compatible-model directory.")
]
WorkspaceOpt = Annotated[
    Path | None,
    typer.Option("--workspace", help="Workspace directory with local services (instead of --config)."),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        help="Config file or shipped name (local, cluster) whose workspace and services to use "
        "(default: local, or $COMPATFLOW_WORKSPACE when set).",
    ),
]


def config_of(config: str | None) -> Any:
    """The resolved config (default ``local``), unchecked in what only a run or training reads."""
    from pipelines.config import ConfigError, load_config, resolve

    with refusing(ConfigError):
        return resolve(load_config(config or "local", local_paths=False, training=False))


def _bare_workspace(config: str | None, workspace: Path | None) -> bool:
    """Whether the command works on a directory (``--workspace`` or $COMPATFLOW_WORKSPACE), not a config."""
    from components.state.workspace import ENV_ROOT

    return workspace is not None or (config is None and bool(os.environ.get(ENV_ROOT)))


def serving_workspace(config: str | None, workspace: Path | None) -> tuple[Any, Any]:
    """The workspace a query command serves and the check of its query models against the registry."""
    from components.serving.verify import RegistryDigestCheck

    deployment = None if _bare_workspace(config, workspace) else config_of(config)
    ws = reading_workspace(config, workspace, deployment)
    return ws, RegistryDigestCheck(ws, deployment.registry.model_name if deployment else None)


def reading_workspace(config: str | None, workspace: Path | None, deployment: Any = None) -> Any:
    """The workspace a read-only command answers about (:func:`workspace_of`), refused (exit 2) when the
    configured index URI disagrees with the serving record: the answer would describe another gallery."""
    from components.serving.record import ServingError, check_index_agrees, read_serving

    ws = workspace_of(config, workspace, deployment)
    try:
        record = read_serving(ws.serving_path)
    except ServingError:
        return ws  # a damaged record: each command names it in its own answer
    with refusing(ServingError):
        check_index_agrees(ws.configured_index_uri, record, ws.serving_path)
    return ws


def workspace_of(
    config: str | None, workspace: Path | None, deployment: Any = None, *, index_uri: str | None = None
) -> Any:
    """The config's workspace, or a bare ``--workspace`` directory; ``index_uri`` replaces the index URI."""
    from components.state.workspace import Workspace, WorkspaceError

    if config is not None and workspace is not None:
        fail("give --config or --workspace, not both")
    with refusing(WorkspaceError):
        if _bare_workspace(config, workspace):
            return Workspace(workspace, index_uri=index_uri)
        chosen = Workspace.of(deployment if deployment is not None else config_of(config))
        return chosen.with_index_uri(index_uri) if index_uri else chosen
