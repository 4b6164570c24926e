"""``compatflow gate``: the release gate on a compatibility report (exit 0 pass, 1 block, 2 usage error)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.commands._common import JsonOpt, echo_json, exit_codes, fail

EXIT_PASS, EXIT_BLOCK, EXIT_USAGE = 0, 1, 2


@exit_codes(
    {
        EXIT_PASS: "pass: the candidate may ship",
        EXIT_BLOCK: "block: the reasons are printed and in gate.json",
        EXIT_USAGE: "a bad argument, or an input the gate cannot read (gate.json says block)",
    }
)
def gate(
    report: Annotated[Path | None, typer.Option(help="compat_report.json from compatflow evaluate.")] = None,
    policy: Annotated[
        Path | None, typer.Option(help="Gate policy YAML (merged over the shipped default).")
    ] = None,
    validation: Annotated[Path | None, typer.Option(help="validation.json of the data phase.")] = None,
    drift: Annotated[Path | None, typer.Option(help="drift.json of the data phase.")] = None,
    out: Annotated[Path | None, typer.Option(help="Directory receiving gate.json.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Decide pass or block for a candidate; writes OUT/gate.json. Fails closed."""
    from components.gate import block_decision, run_gate
    from components.state.run_dir import GATE_FILE

    if report is None or out is None:
        missing = " and ".join(opt for opt, value in (("--report", report), ("--out", out)) if value is None)
        message = f"{missing} is required: compatflow gate --report compat_report.json --out DIR"
        if out is not None:
            block_decision("usage_error", message).write(out)
        fail(message, EXIT_USAGE)
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a directory", EXIT_USAGE)

    decision = run_gate(report, out, policy=policy, validation=validation, drift=drift)
    if as_json:
        echo_json(decision.to_dict())
    else:
        typer.echo(f"gate: {decision.decision.upper()}  ({out / GATE_FILE})")
        for reason in decision.reasons:
            typer.echo(f"  - [{reason.code}] {reason.message}")
    if "gate_error" in decision.reason_codes:
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(EXIT_PASS if decision.passed else EXIT_BLOCK)


def register(app: typer.Typer) -> None:
    app.command("gate")(gate)
