"""``compatflow compat ...``: compatibility training (``train``) and the methods available (``methods``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import DeviceOpt, JsonOpt, OldModelOpt, echo_json, exit_codes, fail, refusing

compat_app = typer.Typer(
    help="Make a candidate compatible with the production model (BCT, lambda-orth, BT2, ...).",
    no_args_is_help=True,
)


def _settings(config: Path | None, assignments: list[str]) -> dict[str, Any]:
    """The method settings of ``--config`` (a YAML mapping) with each ``--set KEY=VALUE`` over them."""
    import yaml

    from pipelines.commands._common import key_values

    values: dict[str, Any] = {}
    if config is not None:
        try:
            loaded = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError) as exc:
            fail(f"--config {config}: cannot read YAML ({exc})")
        if not isinstance(loaded, dict):
            fail(f"--config {config}: expected a mapping of method settings")
        values.update(loaded)
    given = key_values(assignments, "--set", "KEY=VALUE, e.g. --set lam=12")
    return values | {key: yaml.safe_load(raw) if raw else "" for key, raw in given.items()}


@compat_app.command("train")
@exit_codes()
def train(
    method: Annotated[
        str, typer.Option(help="bct, lambda_orth, bt2, none, ... (see: compatflow compat methods).")
    ],
    old: OldModelOpt,
    new: Annotated[Path, typer.Option(help="New model checkpoint (candidate / independently trained).")],
    shards: Annotated[
        list[str], typer.Option(help="Training shards: path, glob, brace pattern or URL (repeatable).")
    ],
    out: Annotated[Path, typer.Option(help="Directory receiving the compatible model (compat.json, ...).")],
    steps: Annotated[
        int | None, typer.Option(help="Optimisation steps (overrides the method default).")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Image-text pairs per batch; default: the config's compat.batch_size.")
    ] = None,
    device: DeviceOpt = None,
    config: Annotated[Path | None, typer.Option(help="YAML mapping of method settings.")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Method setting KEY=VALUE (repeatable).")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="Read at most N samples per epoch.")] = None,
) -> None:
    """Fit METHOD with OLD frozen, starting from NEW; save the compatible model to OUT."""
    values = _settings(config, set_ or [])
    values.update({k: v for k, v in (("steps", steps), ("device", device)) if v is not None})
    from compat.compat_training import train_compat
    from components.deployment import CompatSection

    batch_size = CompatSection().batch_size if batch_size is None else batch_size
    with refusing(FileNotFoundError, ValueError, KeyError):
        model = train_compat(
            method, old, new, shards, out, values, batch_size=batch_size, max_samples=max_samples
        )
    info, c = model.training_info, model.contract
    typer.echo(
        f"{method}: {info.get('steps', 0)} steps in {info.get('seconds', 0):.1f} s, "
        f"{model.trainable_parameters:,} trainable parameters -> {out}"
    )
    typer.echo(
        f"serving contract: space {c.space_id!r}, dim {c.dim}, old vectors {c.old_vector_rule} "
        f"(old dims {list(c.old_dims)}){'' if c.keeps_space else ' -- new space: blue-green rollout'}"
    )


@compat_app.command("methods")
@exit_codes()
def methods(as_json: JsonOpt = False) -> None:
    """List the registered methods and their default settings."""
    from compat.methods import available_methods, get_method

    doc = {name: get_method(name).make_config().to_dict() for name in available_methods()}
    if as_json:
        echo_json(doc)
        return
    for name, defaults in doc.items():
        typer.echo(f"{name}: " + ", ".join(f"{k}={v}" for k, v in defaults.items()))


def register(app: typer.Typer) -> None:
    app.add_typer(compat_app, name="compat")
