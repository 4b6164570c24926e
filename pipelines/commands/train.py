"""``compatflow train continual``: Mod-X / fine-tuning / joint training on one phase of the stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import echo_json, exit_codes, fail, refusing

train_app = typer.Typer(help="Train models on the data stream.", no_args_is_help=True)

TRAINER_SETTINGS = ("accum_steps", "weight_decay", "precision")  # the trainer's own: no config key
DeploymentOpt = Annotated[
    Path | None,
    typer.Option(
        help="A deployment config (a pod's $COMPATFLOW_CONFIG): its training section gives every setting an "
        "option leaves out (default: the shipped defaults)."
    ),
]


def settings_given(params: Mapping[str, Any]) -> dict[str, Any]:
    """The training settings the command's parsed options set (the rest left to the section)."""
    from components.training.continual import SECTION_FIELDS
    from pipelines.config import setting_option

    chosen = {s: params.get(setting_option(s)[2:].replace("-", "_")) for s in SECTION_FIELDS.values()}
    chosen.update({s: params.get(s) for s in TRAINER_SETTINGS})
    return {setting: value for setting, value in chosen.items() if value is not None}


def _setting(name: str, what: str, more: str = "", **limits: Any) -> Any:
    """The option of training setting ``name``: left out, the training section's value stands."""
    return typer.Option(help=f"{what} (default: training.{name}{more}).", **limits)


@train_app.command("continual")
@exit_codes()
def continual(
    ctx: typer.Context,
    stream: Annotated[Path, typer.Option(help="Stream directory (holds stream.json).")],
    phase: Annotated[int, typer.Option(min=0, help="Phase to train on.")],
    out: Annotated[Path, typer.Option(help="Output directory (model/, metrics.json, train/).")],
    production: Annotated[
        Path | None,
        typer.Option(help="Production checkpoint (dir or model.json); omit only for phase 0 (CLIP_0)."),
    ] = None,
    deployment: DeploymentOpt = None,
    config: Annotated[
        str | None, typer.Option(help="Model config for CLIP_0 (phase 0; default: training.model_config).")
    ] = None,
    pretrained: Annotated[
        str | None, typer.Option(help="CLIP_0's start weights: an open_clip tag or a local file/folder.")
    ] = None,
    weights_dir: Annotated[
        str | None, typer.Option(help="Where a pretrained tag is looked up first.")
    ] = None,
    resize_mode: Annotated[
        str | None, typer.Option(help="shortest | longest | squash (default: the model's).")
    ] = None,
    method: Annotated[str | None, _setting("method", "modx | finetune | joint")] = None,
    alpha: Annotated[float | None, _setting("alpha", "Mod-X KL weight", min=0.0)] = None,
    steps: Annotated[int | None, _setting("steps", "Optimizer steps", min=1)] = None,
    batch_size: Annotated[int | None, _setting("batch_size", "Global contrastive batch B", min=2)] = None,
    accum_steps: Annotated[int | None, typer.Option(min=1, help="Micro-batches per step.")] = None,
    lr: Annotated[float | None, _setting("lr", "Peak learning rate")] = None,
    weight_decay: float | None = None,
    warmup_fraction: Annotated[float | None, typer.Option(min=0.0, max=1.0)] = None,
    precision: Annotated[str | None, typer.Option(help="auto | fp32 | bf16 | fp16.")] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(min=0, help="Resumable checkpoint every N steps (0: end only).")
    ] = None,
    seed: int | None = None,
    replay_buffer_size: Annotated[
        int | None,
        _setting("replay_buffer_size", "Pairs of earlier phases kept for replay", "; 0: none", min=0),
    ] = None,
    replay_rows: Annotated[
        int | None, _setting("replay_rows", "Replayed pairs in every batch, at most batch size - 2", min=0)
    ] = None,
    loader_workers: Annotated[
        int | None,
        _setting(
            "loader_workers", "Processes decoding training images, in order", "; 0: this process", min=0
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda.")] = None,
    train_shard: Annotated[
        list[str] | None,
        typer.Option(help="Train shard URL/spec (repeatable); default: the phase's train shards."),
    ] = None,
    version: Annotated[str | None, typer.Option(help="Version name of the new model.")] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Ignore checkpoints in OUT/train; start over.")
    ] = False,
) -> None:
    """Train the next model on PHASE, evaluate it on every domain so far, print the summary as JSON.

    An option left out takes the training section's value (--deployment's, else the shipped default), as
    the pipeline's step would. Resumes from OUT/train after an interruption. Under torchrun every rank
    trains (DDP), rank 0 writes."""
    from components.training.continual import METRICS_FILE, TrainingSettings, run_continual

    with _refusing_bad_input():
        section = _training_section(deployment, steps_given=steps is not None)
        settings = TrainingSettings.from_section(section, **settings_given(ctx.params))
        doc = run_continual(
            stream,
            phase,
            out,
            settings,
            production=production,
            train_urls=train_shard,
            version=version,
            resume=not fresh,
        )
    if doc:  # empty on a non-zero DDP rank
        r1 = {d: {k: m[k]["R@1"] for k in ("t2i", "i2t")} for d, m in doc["domains"].items()}
        shown = {k: doc[k] for k in ("phase", "domain", "method")}
        echo_json({**shown, "model": doc["candidate"]["path"], "metrics": str(out / METRICS_FILE), "r1": r1})


@contextlib.contextmanager
def _refusing_bad_input() -> Iterator[None]:
    """Exit 2 naming an input training cannot use: a stream, shard, checkpoint or setting."""
    from compat.data.loader import LoaderError
    from compat.data.synth import StreamError
    from compat.models import CheckpointError
    from compat.training import ResumeError
    from components.training.continual import ContinualError

    refused = (ContinualError, StreamError, LoaderError, CheckpointError, ResumeError, FileNotFoundError)
    try:
        yield
    except (*refused, KeyError, ValueError) as exc:
        fail(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))


def _training_section(deployment: Path | None, *, steps_given: bool = True) -> Any:
    """The ``training`` section of the deployment config at ``deployment`` (None: the shipped defaults), its
    weights folder the workspace's as the pipeline's step takes it (``training.weights_dir``, else
    ``<workspace>/weights``); refused when it counts epochs and no ``--steps`` is given."""
    from components.deployment import TrainingSection

    if deployment is None:
        return TrainingSection()
    from components.state.workspace import Workspace
    from pipelines.config import ConfigError, load_config

    with refusing(ConfigError):
        loaded = load_config(deployment, local_paths=False)
    if loaded.training.epochs is not None and not steps_given:
        fail(
            f"training.epochs is {loaded.training.epochs} in {deployment}: the pipeline's continual step "
            "turns epochs into steps from the phase's sample count; give --steps"
        )
    weights = str(Workspace.of(loaded).weights_dir)
    return loaded.training.model_copy(update={"weights_dir": weights})


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")
