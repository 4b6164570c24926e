"""``compatflow lineage``: which model embedded a gallery item (Feast's online store), and whether Feast
agrees with the index."""

from __future__ import annotations

import warnings
from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, JsonOpt, WorkspaceOpt, echo_json, exit_codes, fail, refusing


@exit_codes({1: "Feast and the index disagree (--check), or no lineage to read"})
def lineage(
    item_ids: Annotated[list[str], typer.Argument(help="Gallery item ids.", show_default=False)] = None,  # noqa: B006
    check: Annotated[
        bool,
        typer.Option("--check", help="Check every indexed item's model version against its Feast lineage."),
    ] = False,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the lineage of ITEM_IDS (model version, space, when embedded, image, caption) from Feast's
    online store; with --check, whether Feast and the index hold the same versions (exit 1 when not)."""
    from pipelines.commands._common import reading_workspace

    ws = reading_workspace(config, workspace)  # before Feast is imported: a disagreeing config costs nothing
    from components.adapters.lineage import LineageError, LineageStore

    warnings.filterwarnings("ignore", message='Field name "vector_enabled"')  # feast's own model, on import
    if not (ws.lineage_dir / "feature_store.yaml").is_file():
        fail(f"no lineage repo at {ws.lineage_dir} (no gallery indexed yet, or give --config)", code=1)
    if not item_ids and not check:
        fail("name item ids, or --check")
    store = LineageStore(ws.lineage_dir)
    with refusing(LineageError, code=1):
        rows = store.get_items(item_ids or [])
        agreement = _agreement(ws, store) if check else None
    if as_json:
        items = [{**r, "embedded_at": r["embedded_at"] and r["embedded_at"].isoformat()} for r in rows]
        echo_json({"items": items, **({"check": agreement} if agreement else {})})
    else:
        for row in rows:
            if row["model_version"] is None:
                typer.echo(f"{row['item_id']}: not in the lineage")
                continue
            typer.echo(
                f"{row['item_id']}: v{row['model_version']} space {row['space_id']} embedded "
                f"{row['embedded_at']:%Y-%m-%d %H:%M:%S} phase {row['phase']} ({row['domain']})  "
                f"{row['image_uri']}  {row['caption']!r}"
            )
        if agreement:
            verdict = "they agree" if agreement["agree"] else "they DISAGREE (a sync was missed)"
            typer.echo(f"lineage {agreement['lineage']} / index {agreement['index']}: {verdict}")
            if agreement["disagreeing"]:
                typer.echo(f"{agreement['disagreeing']} item(s) differ, e.g. {agreement['examples']}")
            if agreement.get("note"):
                typer.echo(agreement["note"])
    if agreement and not agreement["agree"]:
        raise typer.Exit(1)


def _agreement(ws: Any, store: Any) -> dict[str, Any]:
    """Every served item against its online lineage; with no gallery served, the lineage must be empty."""
    from components.adapters.lineage import check_from_index
    from components.rollout import read_serving
    from components.rollout.operations import open_index

    if read_serving(ws.serving_path) is None:
        agreement = store.check_against_index([])
        if store.has_items():
            agreement.update(agree=False, note="no gallery is served, but the lineage records items")
        return agreement
    with open_index(ws) as index:  # the index the serving record names (a configured other one is refused)
        uri, alias = index.uri, index.alias
    return check_from_index(ws.lineage_dir, uri, alias, definition=ws.lineage_definition)


def register(app: typer.Typer) -> None:
    app.command("lineage")(lineage)
