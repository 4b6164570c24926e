"""``compatflow status`` and ``compatflow rollback``: what is in production; undoing the last promotion."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, JsonOpt, WorkspaceOpt, echo_json, exit_codes, fail

ModelOpt = Annotated[str, typer.Option("--model-name", help="Registered model name.")]
SHOWN_ABOVE = {"workspace", "registry", "last_gate", "rollout", "phases", "production_check", "gallery"}


@exit_codes(
    {
        1: "a problem, printed: a file unreadable, checksum FAILED, index and registry disagree",
        2: "a bad argument or config: one whose index.uri disagrees with the serving record",
    }
)
def status(
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    model_name: ModelOpt = "compatflow-clip",
    count: Annotated[
        bool, typer.Option("--count", help="Count the gallery's vectors per model version (opens the index).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show production, candidate and previous versions, the served model's checksum, the last gate
    decision, rollout progress, every phase's outcome and what the gallery serves, then what to do next.

    Reads files and the registry only: no model is loaded, and the index is opened only with --count (a
    server index is checked to accept connections). A config whose index.uri disagrees with the serving
    record is refused, as compatflow run refuses it."""
    from pipelines.commands._common import reading_workspace
    from pipelines.status import collect, next_step, problems

    doc = collect(reading_workspace(config, workspace), model_name=model_name, count=count)
    found = problems(doc)
    if as_json:
        echo_json({**doc, "problems": found, "next": next_step(doc, found)})
    else:
        typer.echo(_format_status(doc))
        typer.echo(f"next:       {next_step(doc, found)}")
    if found:
        for problem in found:
            typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)


@exit_codes(
    {0: "rolled back", 1: "refused or failed: nothing to roll back, the workspace busy, a hook failed"}
)
def rollback(
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    model_name: ModelOpt = "compatflow-clip",
    as_json: JsonOpt = False,
) -> None:
    """Undo the newest change to what is served: a candidate's unfinished rollout (killed or failed
    mid-backfill, or completed but never promoted; production stays), else production back to the previous
    version: registry, serving record, index alias and lineage together, or nothing. The returning model is
    checked against the registry's digest first (a damaged workspace copy is downloaded again)."""
    from pipelines.commands._common import holding_workspace, workspace_of

    workspace = workspace_of(config, workspace)
    from components.adapters.registry import Registry, RegistryError, RollbackHookError
    from components.steps import rollback_production

    registry = Registry(workspace, model_name=model_name)
    look = "`compatflow status` shows what is served and what ran"
    if not registry.exists():
        fail(f"no registry at {registry.tracking_uri}: nothing to roll back", code=1, next_step=look)
    try:
        with holding_workspace(registry.workspace, "compatflow rollback"):
            result = rollback_production(registry)
    except RollbackHookError as err:
        if as_json:
            echo_json(err.result)
        fail(str(err), code=1, next_step="fix what the failed hook names, then `compatflow rollback` again")
    except RegistryError as err:
        fail(str(err), code=1, next_step=look)
    if as_json:
        echo_json(result)
        return
    undone = result.get("undone_rollout")
    if undone is not None:
        completed = undone["was"] == "completed"
        where = "completed, never promoted" if completed else f"{undone['was']} at stage {undone['stage']}"
        typer.echo(
            f"{model_name}: rolled back the unfinished rollout {undone['rollout_id']} of candidate "
            f"v{undone['candidate']} ({where}); production stays "
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
    lines += [f"            {key}: {registry[key]}" for key in ("note", "error") if registry.get(key)]
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
    gallery = doc.get("gallery")
    if gallery:
        served = f"v{gallery['query_model_version']} queries" if gallery.get("query_model_version") else "-"
        held = gallery.get("by_version")
        counted = (
            f"{gallery['count']:,} items ({', '.join(f'v{v}: {n:,}' for v, n in sorted(held.items()))})"
            if isinstance(gallery.get("count"), int) and held
            else gallery.get("note") or f"{gallery.get('count')} items"
        )
        lines.append(f"gallery     {gallery.get('collection') or '-'}  {served}  {counted}")
    for key, value in doc.items():
        if key not in SHOWN_ABOVE:
            shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
            lines.append(f"{key:<11} {shown}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("rollback")(rollback)
