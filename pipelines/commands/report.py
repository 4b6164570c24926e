"""``compatflow report``: the on-call report of a run, written beside the run (or to ``--out``); prints where
it is and a text summary (``--format md`` without ``--out`` prints the Markdown report instead)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import ConfigOpt, WorkspaceOpt, exit_codes, fail, workspace_of


@exit_codes()
def report(
    run: Annotated[
        str | None,
        typer.Argument(help="Run directory, or a run id under WORKSPACE/runs (default: the newest run)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Write the report here (default: RUN/report/report.html).")
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="html or md (default: from --out's suffix, else html).")
    ] = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Write the on-call report of RUN (validation, drift, training, compatibility, gate, rollout) and print
    its path and a summary."""
    from components.report import FORMATS, render, summary, write_report, write_reports
    from components.state.run_dir import RunDir

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
        if not RunDir(run_dir).holds_a_run():
            fail(
                f"{run_dir.resolve()} is not a run folder (no run.json, outcome, log or step output in it): "
                "the report is written into the run's own folder; give a run directory or a run id"
            )
    else:
        try:
            run_dir = ws.run_dir(run)
        except ValueError as err:
            fail(f"{run!r} is neither a directory nor a run id: {err}")
        if not run_dir.is_dir():
            fail(f"{run!r} is neither a directory nor a run under {ws.runs_dir}")
    if out is None and fmt == "md":
        sys.stdout.write(render(run_dir, "md", link_base=Path.cwd()))
        return
    if out is not None:
        written = write_report(run_dir, out, fmt)
    else:
        written = write_reports(run_dir, RunDir(run_dir).report_dir)["html"]
    sys.stdout.write(summary(run_dir))
    typer.echo(f"report: {written}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
