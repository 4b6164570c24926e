"""``compatflow validate``: validate a data phase, quarantine bad samples, block over a threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import JsonOpt, echo_json, exit_codes, refusing

EXIT_BLOCKED = 3


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


@exit_codes({0: "the phase passes", EXIT_BLOCKED: "the phase is blocked: too many samples quarantined"})
def validate(
    shards: Annotated[
        list[str],
        typer.Option(
            help="Glob, brace pattern, folder or fsspec URL (s3://, gs://, file://...) of the phase's tar "
            "shards, expanded as training expands them; repeat for several. Quote it so the shell does not "
            "expand it."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Output directory: validation.json, accepted/, quarantine/.")],
    max_quarantined_fraction: Annotated[
        float | None,
        typer.Option(
            help="Block the phase when more than this fraction is quarantined (default: the policy's)."
        ),
    ] = None,
    policy_file: Annotated[
        Path | None,
        typer.Option(
            "--policy", help="Validation policy (JSON or YAML, schemas/validation_policy.schema.json)."
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Redo the work even if validation.json is up to date.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Validate a phase's shards into OUT, quarantining bad samples; over the threshold it is blocked."""
    from components.data.validation import (
        ShardSpecError,
        ValidationPolicy,
        load_validation_policy,
        validate_phase,
    )

    with refusing(OSError, ValueError):  # schemas.SchemaError is a ValueError
        policy = load_validation_policy(policy_file) if policy_file else ValidationPolicy()
        if max_quarantined_fraction is not None:
            policy = policy.replace(max_quarantined_fraction=max_quarantined_fraction)
    with refusing(ShardSpecError):
        summary = validate_phase(shards if len(shards) > 1 else shards[0], out, policy, force=force)
    if as_json:
        echo_json(summary.to_dict())
    else:
        reasons = ", ".join(f"{code} {count}" for code, count in summary.by_reason.items()) or "none"
        typer.echo(
            f"{summary.total} samples in {len(summary.shards)} shards: {summary.passed} passed, "
            f"{summary.quarantined} quarantined ({summary.quarantined_fraction:.2%}; {reasons})"
        )
        typer.echo(f"summary: {summary.path}" + (" (up to date, reused)" if summary.reused else ""))
    if summary.blocked:
        for reason in summary.blocked_reasons:
            typer.echo(f"blocked: {reason}", err=True)
        raise typer.Exit(EXIT_BLOCKED)
