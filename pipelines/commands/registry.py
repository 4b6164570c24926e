"""``compatflow status`` and ``compatflow rollback``: what is in production; undoing the last promotion."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, WorkspaceOpt

ModelOpt = Annotated[str, typer.Option("--model-name", help="Registered model name.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def status(
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    model_name: ModelOpt = "compatflow-clip",
    as_json: JsonOpt = False,
) -> None:
    """Show production, candidate and previous versions, the last gate decision and rollout progress.

    Exits 1 (after printing what it could) when a workspace file cannot be read or a part fails."""
    from pipelines.commands._common import workspace_of

    workspace = workspace_of(config, workspace)
    from pipelines.commands._common import echo_json
    from pipelines.status import collect

    doc = collect(workspace, model_name=model_name)
    if as_json:
        echo_json(doc)
    else:
        typer.echo(_format_status(doc))
    problems = [
        *doc.get("unreadable", []),
        *(f"{e['part']}: {e['error']}" for e in doc.get("part_errors", [])),
    ]
    if problems:
        from pipelines.commands._common import fail

        fail("; ".join(problems), code=1)


def rollback(
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    model_name: ModelOpt = "compatflow-clip",
    as_json: JsonOpt = False,
) -> None:
    """Undo the newest change to what is served: a candidate's unfinished rollout (killed or failed
    mid-backfill; production stays), else production back to the previous version: registry, serving record,
    index alias and lineage together, or nothing (see ``Registry.rollback``)."""
    from pipelines.commands._common import workspace_of

    workspace = workspace_of(config, workspace)
    from components.adapters.registry import Registry, RegistryError, RollbackHookError
    from components.steps import rollback_production
    from pipelines.commands._common import echo_json, fail, holding_workspace

    registry = Registry(workspace, model_name=model_name)
    if not registry.exists():
        fail(f"no registry at {registry.tracking_uri}: nothing to roll back", code=1)
    try:
        with holding_workspace(registry.workspace, "compatflow rollback"):
            result = rollback_production(registry)
    except RollbackHookError as err:
        if as_json:
            echo_json(err.result)
        fail(str(err), code=1)
    except RegistryError as err:
        fail(str(err), code=1)
    if as_json:
        echo_json(result)
        return
    undone = result.get("undone_rollout")
    if undone is not None:
        typer.echo(
            f"{model_name}: rolled back the unfinished rollout {undone['rollout_id']} of candidate "
            f"v{undone['candidate']} ({undone['was']} at stage {undone['stage']}); production stays "
            f"v{result['production']} and answers over its own vectors"
        )
        typer.echo("run `compatflow rollback` again to move production back to its previous version")
        return
    typer.echo(f"{model_name}: production {result['from_version']} -> {result['to_version']}")
    typer.echo(f"previous is now {result['previous_version'] or '(none)'}")
    for hook in result["hooks"]:
        typer.echo(f"  hook {hook['hook']}: ok")


def _format_status(doc: dict[str, Any]) -> str:
    registry = doc.get("registry") or {}
    lines = [
        f"workspace   {doc.get('workspace')}",
        f"model       {registry.get('model')}  ({registry.get('tracking_uri')})",
    ]
    for key in ("note", "error"):
        if registry.get(key):
            lines.append(f"            {key}: {registry[key]}")
    for alias in ("production", "candidate", "previous"):
        info = registry.get(alias)
        if info is None:
            lines.append(f"{alias:<11} -")
            continue
        tags = info.get("tags", {})
        lines.append(
            f"{alias:<11} v{info['version']}  phase {tags.get('data_phase', '?')}"
            f"  method {tags.get('method', '?')}"
            f"  gate {tags.get('gate.decision', '?')}  registered {info.get('created_at')}"
        )
    check = doc.get("production_check")
    if check:
        verdict = {True: "ok", False: "FAILED", None: "not checked"}[check["ok"]]
        lines.append(f"checksum    {verdict}: {check['message']}")
    gate = doc.get("last_gate")
    if gate is None:
        lines.append("last gate   - (no gate.json under runs/)")
    else:
        lines.append(
            f"last gate   {str(gate.get('decision')).upper()}  run {gate.get('run_id')}  "
            f"{gate.get('decided_at')}"
        )
        lines += [f"              - [{r.get('code')}] {r.get('message')}" for r in gate.get("reasons", [])]
    rollout = doc.get("rollout")
    if not rollout or rollout.get("status") in (None, "none"):
        lines.append("rollout     - (no rollout state)")
    else:
        fraction = rollout.get("fraction_backfilled")
        shown = f"{100 * fraction:.1f}%" if isinstance(fraction, int | float) else "?"
        lines.append(f"rollout     {rollout.get('status')}  stage {rollout.get('stage')}  backfilled {shown}")
    phases = doc.get("phases") or []
    lines.append("phases" + ("      - (no run yet)" if not phases else ""))
    for row in phases:
        why = f"  ({row['why'].splitlines()[0][:120]})" if row.get("why") else ""
        lines.append(
            f"  {row['phase']:>3}  {row.get('status', '?'):<9}  run {row.get('run_id')}  {row.get('at')}{why}"
        )
    for key, value in doc.items():
        if key not in {"workspace", "registry", "last_gate", "rollout", "phases", "production_check"}:
            shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
            lines.append(f"{key:<11} {shown}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("rollback")(rollback)
