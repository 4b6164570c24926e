"""``compatflow run`` (the main job, what ``make run`` calls) and ``compatflow compile``."""

from __future__ import annotations

from pathlib import Path

import typer

# succeeded / rejected: the pipeline did its job; blocked: fix the phase's data (as `compatflow validate`).
EXIT_CODES = {"succeeded": 0, "rejected": 0, "blocked": 3, "failed": 1}


def run(
    config: str = typer.Option("local", "--config", "-c", help="Config file, or a shipped name (local, cluster)."),
    phase: int | None = typer.Option(None, help="Run this phase instead of the next pending one."),
) -> None:
    """Run the continual-upgrade pipeline locally (kfp.local) on the next pending phase."""
    from pipelines.commands._common import fail
    from pipelines.config import ConfigError, load_config, resolve
    from pipelines.local_runner import run_local

    try:
        resolved = resolve(load_config(config))
        result = run_local(resolved, phase=phase)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        fail(str(err))
    if result.status == "nothing-to-do":
        typer.echo("every phase of the stream has completed; nothing to do")
        return
    typer.echo(f"run {result.run_id}: phase {result.phase} {result.status}")
    typer.echo(f"  outputs: {result.run_dir}")
    typer.echo(f"  report:  {result.outputs['report']}")
    typer.echo(f"  log:     {result.outputs['log']}")
    if result.status == "rejected":  # the gate did its job: production stays, the next run moves on
        typer.echo("  the candidate was not released: production is unchanged (reasons in the report)")
    raise typer.Exit(EXIT_CODES[result.status])


def compile_(
    out: Path = typer.Option(None, "--out", help="Output directory (default: pipelines/compiled)."),
    config: str = typer.Option(
        "cluster",
        "--config",
        "-c",
        envvar="COMPATFLOW_COMPILE_CONFIG",
        help="Config file, or a shipped name (local, cluster), whose resources, GPU pool and values "
        "the compiled pipeline carries.",
    ),
) -> None:
    """Compile the pipeline to KFP IR YAML for a cluster."""
    from pipelines.commands._common import fail
    from pipelines.compile import COMPILED_DIR, compile_pipeline
    from pipelines.config import ConfigError

    try:
        path = compile_pipeline(out or COMPILED_DIR, config=config)
    except ConfigError as err:
        fail(str(err))
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("compile")(compile_)
