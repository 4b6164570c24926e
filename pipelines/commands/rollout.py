"""``compatflow rollout index|run|status|rollback`` and ``compatflow search``: the gallery in service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, JsonOpt, WorkspaceOpt, echo_json, exit_codes, fail, refusing

UriOpt = Annotated[
    str | None,
    typer.Option(
        "--uri",
        help="Milvus URI or milvus-lite directory (default: the serving record's, else "
        "<workspace>/milvus/gallery.db).",
    ),
]

rollout_app = typer.Typer(
    help="Gallery index rollout: index, staged partial backfill, status, rollback.", no_args_is_help=True
)


@rollout_app.command("index")
@exit_codes()
def index_cmd(
    model: Annotated[Path, typer.Option(help="Model or checkpoint directory that embeds the gallery.")],
    version: Annotated[str, typer.Option(help="Model version written with each vector.")],
    space: Annotated[str, typer.Option(help="Embedding space id of the vectors.")],
    gallery: Annotated[list[str], typer.Option(help="Gallery shard URL(s), globs or brace patterns.")],
    probe_size: Annotated[int, typer.Option(help="Captions kept as the rollout probe set.")] = 500,
    seed: int = 0,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    uri: UriOpt = None,
) -> None:
    """Embed a gallery with MODEL and index it behind the serving alias (first run); writes the probe set."""
    from pipelines.commands._common import workspace_of

    workspace = workspace_of(config, workspace, index_uri=uri)
    from components.adapters.index import GalleryIndexError
    from components.rollout import ServingError
    from components.rollout.operations import index_new_items

    with refusing(ServingError, GalleryIndexError, ValueError, OSError):
        record = index_new_items(workspace, model, version, space, gallery, probe_size=probe_size, seed=seed)
    typer.echo(
        f"indexed {record['n_items']} items into {record['collection']} (alias {record['alias']}); "
        f"probe set: {record['probe']}"
    )


@rollout_app.command("run")
@exit_codes({0: "the rollout completed", 1: "halted: a probe fell below its floor (the stage was restored)"})
def run_cmd(
    new_version: Annotated[str, typer.Option(help="Version of the model being rolled out.")],
    new_model: Annotated[
        str, typer.Option(help="New model directory (compatible model or checkpoint).")
    ] = "",
    old_model: Annotated[
        str, typer.Option(help="Serving query model directory (default: the serving record's).")
    ] = "",
    probe: Annotated[
        Path | None, typer.Option(help="Probe set JSON (default: <workspace>/rollout/probe.json).")
    ] = None,
    order: Annotated[
        str | None,
        typer.Option(
            help="random | oldest_first | lambda_orth | uncertainty (default: the config's rollout.order)."
        ),
    ] = None,
    fractions: Annotated[
        str | None, typer.Option(help="Stage fractions, comma-separated (default: the config's).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Default: the config's training.seed.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Default: the config's rollout.batch_size.")] = None,
    p99_factor: Annotated[
        float | None,
        typer.Option(
            "--slo-p99-factor",
            help="Query p99 the backfill may cause, x idle (0: unpaced; default: the config's rollout.slo).",
        ),
    ] = None,
    max_items_per_s: Annotated[
        float | None, typer.Option(help="Backfill rate cap (default: the config's rollout.slo).")
    ] = None,
    space: Annotated[
        str | None,
        typer.Option(
            help="Target space (default: the contract's or the serving one; another space goes blue-green)."
        ),
    ] = None,
    floor: Annotated[
        list[str],
        typer.Option(help="Floor METRIC=VALUE over the config's rollout.floors (only raises old/old)."),
    ] = [],  # noqa: B006
    encoders: Annotated[
        str | None, typer.Option(help="Encoder factory module:function (default: the models' own).")
    ] = None,
    query_factory: Annotated[
        str | None,
        typer.Option(help="Factory of the query encoder recorded for search (default: the model)."),
    ] = None,
    option: Annotated[list[str], typer.Option(help="KEY=VALUE passed to the factories.")] = [],  # noqa: B006
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    uri: UriOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Roll NEW_VERSION out: switch queries, backfill in stages with probes; resumes after any crash."""
    from pipelines.commands._common import config_of, key_values, workspace_of

    deployment = config_of(config)  # the settings' defaults, and the workspace unless --workspace is given
    workspace = workspace_of(config, workspace, deployment, index_uri=uri)
    from components.adapters.index import GalleryIndexError
    from components.rollout import RolloutError, ServingError
    from components.rollout.operations import roll_out

    with refusing(RolloutError, ServingError, GalleryIndexError, ValueError, OSError):
        state = roll_out(
            workspace,
            new_version,
            _settings(deployment.rollout, order, fractions, batch_size, floor, p99_factor, max_items_per_s),
            new_model=new_model,
            old_model=old_model,
            probe=probe,
            seed=deployment.training.seed if seed is None else seed,
            space=space,
            encoders=encoders,
            query_factory=query_factory,
            options=key_values(option, "--option"),
        )
    if as_json:
        echo_json(state.document())
    else:
        typer.echo(
            f"rollout {state.rollout_id}: {state.status} at stage {state.stage}, "
            f"{100 * state.fraction_backfilled:.0f}% backfilled"
        )
        for point in state.curve:
            typer.echo(f"  {100 * point.fraction:5.1f}%  t2i R@1 {point.t2i_r1:.2f}")
    if state.status == "halted":
        fail(f"rollout halted: {state.halt_reason}", code=1)


def _settings(
    given: Any,
    order: str | None,
    fractions: str | None,
    batch_size: int | None,
    floors: list[str],
    p99_factor: float | None,
    max_items_per_s: float | None,
) -> Any:
    """The config's rollout section with the options given over it, validated (exit 2 naming each field)."""
    from pydantic import ValidationError

    from components.deployment import RolloutSection, error_lines
    from pipelines.commands._common import key_values

    slo = given.slo.model_dump()
    if p99_factor is not None:
        slo["p99_factor"] = p99_factor or None  # 0: unpaced
    if max_items_per_s is not None:
        slo["max_items_per_s"] = max_items_per_s
    chosen = {
        "order": order,
        "fractions": None if fractions is None else [float(f) for f in fractions.split(",") if f],
        "batch_size": batch_size,
    }
    try:
        return RolloutSection.model_validate(
            {
                **given.model_dump(),
                **{key: value for key, value in chosen.items() if value is not None},
                "floors": {**given.floors, **{k: float(v) for k, v in key_values(floors, "--floor").items()}},
                "slo": slo,
            }
        )
    except ValidationError as err:
        fail("; ".join(error_lines(err)))


@rollout_app.command("status")
@exit_codes({1: "the rollout state cannot be read"})
def status_cmd(workspace: WorkspaceOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """State, stage and fraction backfilled of the rollout in the workspace."""
    from pipelines.commands._common import workspace_of

    workspace = workspace_of(config, workspace)
    from components.rollout import RolloutError, status
    from schemas import SchemaError

    with refusing(RolloutError, SchemaError, code=1):  # a damaged state file: the message names it
        doc = status(workspace.rollout_state_path)
    if as_json:
        echo_json(doc)
        return
    line = f"state {doc['status']}  stage {doc['stage']}  backfilled {doc['fraction_backfilled']}"
    pace = doc.get("pace") or {}
    if pace.get("p99_factor") and pace.get("idle_p99_ms") is not None:
        last = pace.get("last_p99_ms")
        line += (
            f"  paced on {pace.get('latency_from')}: p99 {'-' if last is None else f'{last:.1f}'} ms "
            f"(limit {pace['p99_factor'] * pace['idle_p99_ms']:.1f}), {pace.get('slowdowns', 0)} slowdowns"
        )
    typer.echo(line)


@rollout_app.command("rollback")
@exit_codes({1: "nothing to roll back, or it failed"})
def rollback_cmd(workspace: WorkspaceOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Restore the previous gallery (collection or vectors) and the previous query model."""
    from pipelines.commands._common import holding_workspace, workspace_of

    workspace = workspace_of(config, workspace)
    from components.adapters.index import GalleryIndexError
    from components.rollout import RolloutError, RolloutPaths, ServingError, rollback
    from components.rollout.operations import open_index

    # the index opened for this deployment: an alias of another one is never switched
    with refusing(RolloutError, ServingError, GalleryIndexError, code=1):
        with holding_workspace(workspace, "compatflow rollout rollback"), open_index(workspace) as index:
            state = rollback(RolloutPaths.for_workspace(workspace), index)
    if as_json:
        echo_json(state.document())
    else:
        typer.echo(
            f"rollout {state.rollout_id} rolled back; queries served by "
            f"{state.query_model.version} on {state.gallery.source_collection}"
        )


@exit_codes(
    {
        0: "hits printed",
        2: "a bad argument, or nothing to search: no serving record, a query model failing its digest, a "
        "config whose index.uri disagrees with the serving record",
    }
)
def search_cmd(
    texts: Annotated[list[str], typer.Argument(help="Query text(s).")],
    k: Annotated[int, typer.Option("-k", "--k", help="Hits per query (1 to 1000).")] = 10,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    uri: UriOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Search the gallery as it is served and print each hit's score, item, caption and model version.

    A running compatflow serve of the workspace (announced in its services folder) answers when there is
    one; otherwise the serving record's query model is loaded here, after its folder is checked against the
    registry's digest of its version, and searches the collection the record names (--uri: another index)."""
    from components.serving.limits import QueryBoundError, check_search
    from pipelines.commands._common import serving_workspace

    with refusing(QueryBoundError):
        check_search(texts, k)  # before anything heavy is imported
    workspace, verify = serving_workspace(config, workspace)
    hits = _ask_service(workspace, texts, k) if uri is None else None
    if hits is None:
        from components.adapters.index import GalleryIndexError
        from components.rollout import ServingError
        from components.serving.search import search

        with refusing(ServingError, GalleryIndexError, ValueError):
            hits = search(texts, k, record_path=workspace.serving_path, uri=uri, captions=True, verify=verify)
    if as_json:
        echo_json(hits[0] if len(texts) == 1 else hits)
        return
    for text, row in zip(texts, hits, strict=True):
        typer.echo(text)
        for rank, hit in enumerate(row, 1):
            caption = hit.get("caption") or "(no caption)"
            typer.echo(
                f"  {rank:3d}  {hit['score']:.4f}  {hit['item_id']}  {caption}  ({hit['model_version']})"
            )


def _ask_service(workspace: Any, texts: list[str], k: int) -> list[list[dict[str, Any]]] | None:
    """The hits of the first live compatflow serve of the workspace that answers; None when none does."""
    import logging

    from components.adapters.services import ask, live_services

    for url in live_services(workspace.services_dir):
        try:
            return ask(url, texts, k)
        except ValueError as err:  # the service refused the query itself
            fail(f"{url}: {err}")
        except OSError as err:
            logging.getLogger(__name__).warning("%s did not answer (%s): searching here", url, err)
    return None


def register(app: typer.Typer) -> None:
    app.add_typer(rollout_app, name="rollout")
    app.command("search")(search_cmd)
