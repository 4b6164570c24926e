"""``compatflow report``: the on-call report of a run (HTML or Markdown), written to a file or printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import ConfigOpt, WorkspaceOpt


def report(
    run: Annotated[
        str | None,
        typer.Argument(help="Run directory, or a run id under WORKSPACE/runs (default: the newest run)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the report here instead of printing it.")
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="html or md (default: from --out's suffix, else html).")
    ] = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Render the on-call report of RUN: validation, drift, training, compatibility, gate, rollout."""
    from components.report import FORMATS, render, write_report
    from pipelines.commands._common import fail, workspace_of

    if fmt is not None and fmt not in FORMATS:
        fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    ws = workspace_of(config, workspace)
    if run is None:
        runs = ws.run_ids()
        if not runs:
            fail(f"no runs under {ws.runs_dir}: pass a run directory")
        run_dir = ws.run_dir(runs[-1])
    elif Path(run).is_dir():
        run_dir = Path(run)
    else:
        try:
            run_dir = ws.run_dir(run)
        except ValueError as err:
            fail(f"{run!r} is neither a directory nor a run id: {err}")
        if not run_dir.is_dir():
            fail(f"{run!r} is neither a directory nor a run under {ws.runs_dir}")
    if out is not None:
        written = write_report(run_dir, out, fmt)
        typer.echo(f"report written to {written}", err=True)
        return
    sys.stdout.write(render(run_dir, fmt or "html", link_base=Path.cwd()))


def register(app: typer.Typer) -> None:
    app.command("report")(report)
