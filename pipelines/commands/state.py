"""``compatflow state``: the workspace's record of every phase's outcome (the phase record)."""

from __future__ import annotations

from typing import Annotated

import typer

from pipelines.commands._common import exit_codes, holding_workspace, refusing

state_app = typer.Typer(help="The workspace's phase record: rebuild it from the run folders.")


@state_app.command("rebuild")
@exit_codes()
def rebuild(
    config: Annotated[
        str, typer.Option("--config", "-c", help="Config file, or a shipped name (local, cluster).")
    ] = "local",
) -> None:
    """Rebuild the phase record from the run folders (each phase's newest finished run)."""
    from components.runs import rebuild_state
    from components.state.workspace import Workspace
    from pipelines.config import ConfigError, load_config, resolve

    with refusing(ConfigError):
        workspace = Workspace.of(resolve(load_config(config)))
    with holding_workspace(workspace, "compatflow state rebuild"):
        state = rebuild_state(workspace)
    for phase, entry in state.phases.items():
        typer.echo(f"phase {phase:>3}  {entry.status:<9}  run {entry.run_id}")
    typer.echo(f"rebuilt {workspace.state_path}: {len(state.phases)} phase(s)")


def register(app: typer.Typer) -> None:
    app.add_typer(state_app, name="state")
