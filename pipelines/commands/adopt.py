"""``compatflow adopt``: make a team's Milvus collection and the model that made it production version 1
(:mod:`components.adoption`)."""

from __future__ import annotations

from typing import Annotated

import typer

from pipelines.commands._common import ConfigOpt, WorkspaceOpt, echo_json, exit_codes, refusing

REFUSED = 3


@exit_codes(
    {
        REFUSED: "refused: the model does not reproduce the vectors, or the collection cannot be adopted "
        "(the figures and reason printed); nothing was written"
    }
)
def adopt(
    uri: Annotated[str, typer.Option(help="The team's Milvus URI or milvus-lite path.")],
    collection: Annotated[str, typer.Option(help="The team's collection (only read).")],
    id_field: Annotated[str, typer.Option(help="Its primary key field.")],
    vector_field: Annotated[str, typer.Option(help="Its float vector field.")],
    arch: Annotated[str, typer.Option(help="The model: an open_clip architecture or a cf-* config name.")],
    weights: Annotated[
        str,
        typer.Option(
            help="The model's weights: a checkpoint file or folder open_clip wrote, or an MLflow models:/ or "
            "runs:/ URI whose artifacts hold one such file."
        ),
    ],
    image_field: Annotated[
        str | None, typer.Option(help="The field holding each item's image path or file:// URI.")
    ] = None,
    image_template: Annotated[
        str | None, typer.Option(help="Each item's image path from its id, e.g. /data/{id}.jpg.")
    ] = None,
    caption_field: Annotated[str | None, typer.Option(help="A field holding each item's caption.")] = None,
    sample: Annotated[int, typer.Option(min=1, max=4096, help="Items re-embedded to prove the model.")] = 256,
    threshold: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Least median and p5 cosine accepted.")
    ] = 0.99,
    max_unreadable: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Largest fraction of unreadable images.")
    ] = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the sample.")] = 0,
    weights_tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="The MLflow server (or store) a models:/ or runs:/ --weights is read from "
            "(default: $MLFLOW_TRACKING_URI)."
        ),
    ] = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Adopt an existing collection: prove on a sample that the model made its vectors, then copy every
    row's vector (no re-embedding) into a collection of compatflow's schema, serve it, record each item's
    lineage, register the model as production version 1 and record phase 0 as shipped.

    The team's collection is only read. The copy lands in the workspace's index (its index.uri)."""
    from components.adoption import AdoptionRefused, Source
    from components.adoption import adopt as run_adoption
    from components.state.workspace import DEFAULT_MODEL_NAME
    from pipelines.commands._common import config_of, holding_workspace, workspace_of

    model_name = config_of(config).registry.model_name if config else DEFAULT_MODEL_NAME
    ws = workspace_of(config, workspace)
    with refusing(AdoptionRefused):
        source = Source(uri, collection, id_field, vector_field, image_field, image_template, caption_field)
    with holding_workspace(ws, "adopt"), refusing(AdoptionRefused, code=REFUSED):
        summary = run_adoption(
            ws,
            source,
            arch=arch,
            weights=weights,
            sample_size=sample,
            seed=seed,
            threshold=threshold,
            max_unreadable=max_unreadable,
            model_name=model_name,
            tracking_uri=weights_tracking_uri,
            on_proof=lambda proof: typer.echo(f"proof: {proof.summary()}"),
        )
    typer.echo(
        f"adopted {summary['n_items']} items of {collection!r} as version {summary['model']['version']}: "
        f"served from {summary['collection']!r} (alias {summary['alias']!r}); {collection!r} is unchanged"
    )
    echo_json({k: summary[k] for k in ("run_id", "collection", "n_items", "seconds_per_item")})


def register(app: typer.Typer) -> None:
    app.command("adopt")(adopt)
