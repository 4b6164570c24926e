"""``compatflow run`` (the main job, what ``make run`` calls) and ``compatflow compile``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import exit_codes, fail

# succeeded / rejected: the pipeline did its job; blocked: fix the phase's data (as `compatflow validate`).
EXIT_CODES = {"succeeded": 0, "rejected": 0, "blocked": 3, "failed": 1}
NEXT = {  # what a person does after each outcome (a failure carries its own next action)
    "succeeded": "`compatflow status` shows what is served; `compatflow run` runs the next pending phase",
    "rejected": "read the report's reasons; `compatflow run` goes on with the next phase",
    "blocked": "fix or replace the phase's shards (quarantine listed in the report), then `compatflow run`",
    "failed": "read the log, then `compatflow run` resumes the phase",
}


@exit_codes(
    {
        0: "succeeded, rejected (production unchanged) or nothing pending",
        1: "failed (step, error and next action printed), or the workspace is busy",
        EXIT_CODES["blocked"]: "blocked: validation refused the phase; fix its shards, then run again",
    }
)
def run(
    config: Annotated[
        str, typer.Option("--config", "-c", help="Config file, or a shipped name (local, cluster).")
    ] = "local",
    phase: Annotated[int | None, typer.Option(help="Run this phase instead of the next pending one.")] = None,
) -> None:
    """Run the continual-upgrade pipeline locally (kfp.local) on the next pending phase."""
    from components.state.lock import WorkspaceBusy
    from pipelines.config import ConfigError, load_config
    from pipelines.local_runner import run_local

    try:
        result = run_local(load_config(config).resolved(), phase=phase)
    except WorkspaceBusy as err:
        fail(str(err), code=1)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        fail(str(err))
    if result.status == "nothing-to-do":
        typer.echo("nothing pending: every phase of the stream has been processed (succeeded or rejected)")
        typer.echo("  next:    `compatflow stream add-phase` adds one; `compatflow status` shows the history")
        return
    typer.echo(f"run {result.run_id}: phase {result.phase} {result.status}")
    if result.failure:
        error = result.failure["error"]
        last = (str(error.get("message", "")).strip().splitlines() or [""])[-1]
        typer.echo(f"  failed step: {result.failure['step']}")
        typer.echo(f"  error:   {error.get('type')}: {last}")
        if result.failure.get("unwritten"):
            typer.echo(f"  unwritten: {result.failure['unwritten']} (the log may end early)")
        typer.echo(f"  next:    {result.failure['next_action']}")
        if result.failure.get("log_line"):
            typer.echo(f"  look at: {result.failure['log']}:{result.failure['log_line']}")
    typer.echo(f"  outputs: {result.run_dir}")
    typer.echo(f"  report:  {result.outputs['report']}")
    typer.echo(f"  log:     {result.outputs['log']}")
    if result.status == "rejected":  # the gate did its job: production stays, the next run moves on
        typer.echo("  the candidate was not released: production is unchanged (reasons in the report)")
    if not result.failure:
        typer.echo(f"  next:    {NEXT[result.status]}")
    raise typer.Exit(EXIT_CODES[result.status])


@exit_codes({0: "compiled; the package's path is printed"})
def compile_(
    out: Annotated[Path | None, typer.Option(help="Output directory (default: pipelines/compiled).")] = None,
    config: Annotated[
        str,
        typer.Option(
            "--config",
            "-c",
            envvar="COMPATFLOW_COMPILE_CONFIG",
            help="Config file, or a shipped name (local, cluster), whose resources, GPU pool and values "
            "the compiled pipeline carries.",
        ),
    ] = "cluster",
    digest: Annotated[
        list[str] | None,
        typer.Option(
            "--digest",
            help="Pin an image by the digest its push printed: cpu=sha256:... and gpu=sha256:... (pipeline "
            "submit and schedule refuse a package whose images are named by tag only).",
        ),
    ] = None,
) -> None:
    """Compile the pipeline to KFP IR YAML for a cluster."""
    from pipelines.compile import COMPILED_DIR, compile_pipeline
    from pipelines.config import ConfigError

    digests = dict(d.partition("=")[::2] for d in digest or [])
    try:
        path = compile_pipeline(out or COMPILED_DIR, config=config, digests=digests)
    except ConfigError as err:
        fail(str(err))
    typer.echo(str(path))
    typer.echo(f"next: compatflow pipeline submit --package {path} --host URL (or schedule)", err=True)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("compile")(compile_)
