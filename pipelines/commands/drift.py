"""``compatflow drift``: the new phase against a reference phase (Evidently)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import exit_codes, refusing


@exit_codes()
def drift(
    reference: Annotated[str, typer.Option(help="Reference shards: glob, brace pattern or URL.")],
    current: Annotated[str, typer.Option(help="New phase shards: glob, brace pattern or URL.")],
    out: Annotated[Path, typer.Option(help="Output directory (drift.json, drift_report.html).")],
    production: Annotated[
        Path | None, typer.Option(help="Production checkpoint: adds embedding drift of both towers.")
    ] = None,
    sample_size: Annotated[
        int | None,
        typer.Option(help="Samples per side (a uniform reservoir); default: the config's drift.sample_size."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
) -> None:
    """Write a drift report (HTML) and a JSON summary with a verdict and severity per signal."""
    from components.data.drift import run_drift
    from components.deployment import DriftSection
    from components.state.run_dir import DRIFT_REPORT_FILE

    sample_size = DriftSection().sample_size if sample_size is None else sample_size
    with refusing(FileNotFoundError, ValueError):
        summary = run_drift(
            reference, current, out, production_checkpoint=production, sample_size=sample_size, seed=seed
        )
    typer.echo(f"drift severity: {summary['severity']}")
    for name, verdict in sorted(summary["verdicts"].items()):
        flag = "DRIFT" if verdict["drift"] else "ok"
        typer.echo(
            f"  {name:<22} {verdict['method']:<13} {verdict['score']:8.3f}  {verdict['severity']:<6} {flag}"
        )
    typer.echo(f"report: {out / DRIFT_REPORT_FILE}")


def register(app: typer.Typer) -> None:
    app.command("drift")(drift)
