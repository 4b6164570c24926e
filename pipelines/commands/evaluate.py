"""``compatflow evaluate``: the compatibility matrix, bootstrap margins and ECC verdicts of a candidate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import DeviceOpt, JsonOpt, OldModelOpt, echo_json, exit_codes, fail, refusing


@exit_codes()
def evaluate(
    old: OldModelOpt,
    new: Annotated[Path, typer.Option(help="Candidate: a compatible-model directory or a plain checkpoint.")],
    eval_shards: Annotated[
        list[str], typer.Option(help="Evaluation shards: path, glob, brace pattern or URL (repeatable).")
    ],
    out: Annotated[Path, typer.Option(help="Directory receiving compat_report.json.")],
    independent: Annotated[
        Path | None, typer.Option(help="Independently trained new model, for retention.")
    ] = None,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples of every margin.")] = 1000,
    confidence: Annotated[float, typer.Option(help="Confidence level of the intervals.")] = 0.95,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    device: DeviceOpt = "cpu",
    max_items: Annotated[int | None, typer.Option(help="Evaluate the first N images only.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write OUT/compat_report.json (retrieval old/old, new/old, new/new; margins with intervals; ECC)."""
    if bootstrap < 1 or not 0 < confidence < 1:
        fail(f"--bootstrap must be >= 1 and --confidence in (0, 1), got {bootstrap} and {confidence}")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a directory")
    from components.training.evaluate import REPORT_FILE
    from components.training.evaluate import evaluate as run_evaluate

    with refusing(FileNotFoundError, ValueError, KeyError):
        report = run_evaluate(
            old,
            new,
            eval_shards,
            out,
            independent=independent,
            n_bootstrap=bootstrap,
            confidence=confidence,
            seed=seed,
            device=device,
            max_items=max_items,
        )
    if as_json:
        echo_json(report)
        return
    typer.echo(
        f"compat report: {out / REPORT_FILE}  (method {report['method']}, "
        f"{report['eval_sizes']['images']} images, {report['eval_sizes']['captions']} captions)"
    )
    for direction in ("t2i", "i2t"):
        for metric, interval in report["margins"][direction].items():
            row = report["retrieval"][direction]
            verdict = "pass" if report["ecc"][direction][metric] else "FAIL"
            typer.echo(
                f"  {direction} {metric:>5}: old/old {row['old/old'][metric]:6.2f}  new/old "
                f"{row['new/old'][metric]:6.2f}  new/new {row['new/new'][metric]:6.2f}  margin "
                f"{interval['margin']:+6.2f} [{interval['ci_low']:+.2f}, {interval['ci_high']:+.2f}]  "
                f"ECC {verdict}"
            )
    typer.echo(f"ECC {'passed' if report['ecc_passed'] else 'failed'} (the gate decides the release)")


def register(app: typer.Typer) -> None:
    app.command("evaluate")(evaluate)
