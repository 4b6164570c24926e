"""``compatflow models``: model configs, their pretrained tags and which are on this machine; ``models fetch``
downloads a tag's weights (the one command that downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import ConfigOpt, JsonOpt, WorkspaceOpt, echo_json, exit_codes, fail, refusing

models_app = typer.Typer(
    help="Model configs (cf-* and open_clip architectures), their pretrained tags and which are on this "
    "machine; fetch a tag's weights.",
    invoke_without_command=True,
    no_args_is_help=False,
)

WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights-dir",
        help="Weights folder laid out ARCH/TAG/ (default: the config's training.weights_dir, else "
        "<workspace>/weights).",
    ),
]


def _weights_dir(config: str | None, workspace: Path | None, weights_dir: Path | None) -> Path:
    from pipelines.commands._common import workspace_of

    return weights_dir if weights_dir is not None else workspace_of(config, workspace).weights_dir


@models_app.callback()
def models(
    ctx: typer.Context,
    arch: Annotated[
        list[str] | None, typer.Option(help="Only these configs / architectures (repeatable).")
    ] = None,
    cached_only: Annotated[bool, typer.Option("--cached", help="Only tags whose weights are here.")] = False,
    weights_dir: WeightsOpt = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the model configs (the project's cf-* and every open_clip architecture) with their pretrained
    tags, and for each tag where its weights are on this machine (the weights folder, then the Hugging Face
    cache) or that it is not here. training.model_config takes a config, training.pretrained a tag."""
    if ctx.invoked_subcommand is not None:
        return
    from compat.models.factory import list_architectures, list_configs, read_config
    from compat.models.pretrained import find_cached

    folder = _weights_dir(config, workspace, weights_dir)
    own, architectures = list_configs(), list_architectures()
    wanted = set(arch or [])
    unknown = sorted(wanted - set(own) - set(architectures))
    if unknown:
        fail(f"unknown model config(s) {unknown}: `compatflow models` lists them")
    from open_clip.pretrained import list_pretrained_tags_by_model

    rows: list[dict[str, Any]] = []
    for name in [*own, *architectures]:
        if wanted and name not in wanted:
            continue
        kind = "compatflow" if name in own else "open_clip"
        arch_name = name if kind == "open_clip" else read_config(name).get("open_clip_model")
        known = list_pretrained_tags_by_model(arch_name) if arch_name else []
        tags = []
        for tag in known:
            path, _ = find_cached(arch_name, tag, [folder])
            if path is not None or not cached_only:
                tags.append({"tag": tag, "cached": path is not None, "path": str(path) if path else None})
        if arch_name and (folder / arch_name).is_dir():  # a team's own weights: tags open_clip does not list
            for p in sorted((folder / arch_name).iterdir()):
                if p.is_dir() and p.name not in known and not p.name.startswith("."):
                    tags.append({"tag": p.name, "cached": True, "path": str(p)})
        if cached_only and not tags:
            continue
        rows.append({"config": name, "kind": kind, "open_clip_model": arch_name, "tags": tags})
    if as_json:
        echo_json({"weights_dir": str(folder), "configs": rows})
        return
    typer.echo(f"weights folder: {folder} (then the Hugging Face cache); nothing is downloaded at run time")
    for row in rows:
        head = f"{row['config']}  [{row['kind']}]"
        if not row["tags"]:
            typer.echo(f"{head}  (random init: no pretrained tags)")
            continue
        typer.echo(head)
        for tag in row["tags"]:
            where = f"cached  {tag['path']}" if tag["cached"] else "-"
            typer.echo(f"    {tag['tag']:<36} {where}")


@models_app.command("fetch")
@exit_codes({1: "the weights could not be downloaded"})
def fetch(
    arch: Annotated[str, typer.Argument(help="open_clip architecture, e.g. ViT-B-32.", show_default=False)],
    tag: Annotated[
        str, typer.Argument(help="Its pretrained tag, e.g. laion2b_s34b_b79k.", show_default=False)
    ],
    to: Annotated[
        Path | None,
        typer.Option(
            help="Weights folder (written as TO/ARCH/TAG/); default: the config's weights folder, which the "
            "pipeline reads."
        ),
    ] = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Download the weights of ARCH/TAG from Hugging Face into the weights folder, where
    training.pretrained: TAG finds them. Needs a network that reaches huggingface.co (exit 1 without)."""
    from compat.models.factory import is_architecture
    from compat.models.pretrained import PretrainedError
    from compat.models.pretrained import fetch as fetch_weights

    if not is_architecture(arch):
        fail(f"{arch!r} is not an open_clip architecture (`compatflow models` lists them)")
    folder = _weights_dir(config, workspace, to)
    with refusing(PretrainedError, code=1):
        path = fetch_weights(arch, tag, folder)
    typer.echo(f"{arch}/{tag}: {path}")


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
