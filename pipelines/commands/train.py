"""``compatflow train continual``: Mod-X / fine-tuning / joint training on one phase of the stream."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import echo_json, exit_codes, fail

train_app = typer.Typer(help="Train models on the data stream.", no_args_is_help=True)

TRAINER_SETTINGS = ("accum_steps", "weight_decay", "precision")  # the trainer's own: no config key


def settings_given(params: Mapping[str, Any]) -> dict[str, Any]:
    """The training settings the command's options set (:func:`pipelines.config.setting_option`), from its
    parsed parameters (the rest left to the section), the trainer's own options included."""
    from components.training.continual import SECTION_FIELDS
    from pipelines.config import setting_option

    chosen = {s: params.get(setting_option(s)[2:].replace("-", "_")) for s in SECTION_FIELDS.values()}
    chosen.update({s: params.get(s) for s in TRAINER_SETTINGS})
    return {setting: value for setting, value in chosen.items() if value is not None}


@train_app.command("continual")
@exit_codes()
def continual(
    ctx: typer.Context,
    stream: Annotated[Path, typer.Option("--stream", help="Stream directory (holds stream.json).")],
    phase: Annotated[int, typer.Option("--phase", min=0, help="Phase to train on.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (model/, metrics.json, train/).")],
    production: Annotated[
        Path | None,
        typer.Option(
            "--production", help="Production checkpoint (dir or model.json); omit only for phase 0 (CLIP_0)."
        ),
    ] = None,
    deployment: Annotated[
        Path | None,
        typer.Option(
            "--deployment",
            help="A deployment config (a pod's $COMPATFLOW_CONFIG): its training section gives every "
            "setting an option leaves out (default: the shipped defaults).",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option("--config", help="Model config for CLIP_0 (phase 0; default: training.model_config)."),
    ] = None,
    pretrained: Annotated[
        str | None,
        typer.Option("--pretrained", help="CLIP_0's start weights: an open_clip tag or a local file/folder."),
    ] = None,
    weights_dir: Annotated[
        str | None, typer.Option("--weights-dir", help="Where a pretrained tag is looked up first.")
    ] = None,
    resize_mode: Annotated[
        str | None, typer.Option("--resize-mode", help="shortest | longest | squash (default: the model's).")
    ] = None,
    method: Annotated[
        str | None, typer.Option("--method", help="modx | finetune | joint (default: training.method).")
    ] = None,
    alpha: Annotated[
        float | None, typer.Option("--alpha", min=0.0, help="Mod-X KL weight (default: training.alpha).")
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Optimizer steps (default: training.steps).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", min=2, help="Global contrastive batch B (default: training.batch_size)."
        ),
    ] = None,
    accum_steps: Annotated[
        int | None, typer.Option("--accum-steps", min=1, help="Micro-batches per step.")
    ] = None,
    lr: Annotated[
        float | None, typer.Option("--lr", help="Peak learning rate (default: training.lr).")
    ] = None,
    weight_decay: Annotated[float | None, typer.Option("--weight-decay")] = None,
    warmup_fraction: Annotated[float | None, typer.Option("--warmup-fraction", min=0.0, max=1.0)] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="auto | fp32 | bf16 | fp16.")] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option("--checkpoint-every", min=0, help="Resumable checkpoint every N steps (0: end only)."),
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    replay_buffer_size: Annotated[
        int | None,
        typer.Option(
            "--replay-buffer-size",
            min=0,
            help="Pairs of earlier phases kept for replay (default: training.replay_buffer_size; 0: none).",
        ),
    ] = None,
    replay_rows: Annotated[
        int | None,
        typer.Option(
            "--replay-rows",
            min=0,
            help="Replayed pairs in every batch, at most batch size - 2 (default: training.replay_rows).",
        ),
    ] = None,
    loader_workers: Annotated[
        int | None,
        typer.Option(
            "--loader-workers",
            min=0,
            help="Processes decoding training images, in order (default: training.loader_workers; 0: this "
            "process).",
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda.")] = None,
    train_shard: Annotated[
        list[str] | None,
        typer.Option(
            "--train-shard", help="Train shard URL/spec (repeatable); default: the phase's train shards."
        ),
    ] = None,
    version: Annotated[str | None, typer.Option("--version", help="Version name of the new model.")] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Ignore checkpoints in OUT/train; start over.")
    ] = False,
) -> None:
    """Train the next model on PHASE, evaluate it on every domain so far, print the summary as JSON.

    An option left out takes the training section's value (--deployment's, else the shipped default), as
    the pipeline's step would.
    Resumes from OUT/train after an interruption. Under torchrun every rank trains (DDP), rank 0 writes.
    """
    from compat.data.loader import LoaderError
    from compat.data.synth import StreamError
    from compat.models import CheckpointError
    from compat.training import ResumeError
    from components.training.continual import METRICS_FILE, ContinualError, TrainingSettings, run_continual

    try:
        chosen = settings_given(ctx.params)
        section = _training_section(deployment)
        if section.epochs is not None and steps is None:
            fail(
                f"training.epochs is {section.epochs} in {deployment}: the pipeline's continual step turns "
                "epochs into steps from the phase's sample count; give --steps"
            )
        settings = TrainingSettings.from_section(section, **chosen)
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
    except (
        ContinualError,
        StreamError,
        LoaderError,
        CheckpointError,
        ResumeError,
        FileNotFoundError,
        KeyError,
        ValueError,
    ) as exc:
        fail(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))
    if not doc:  # a non-zero DDP rank
        return
    echo_json(
        {
            "phase": doc["phase"],
            "domain": doc["domain"],
            "method": doc["method"],
            "model": doc["candidate"]["path"],
            "metrics": str(out / METRICS_FILE),
            "r1": {d: {k: m[k]["R@1"] for k in ("t2i", "i2t")} for d, m in doc["domains"].items()},
        }
    )


def _training_section(deployment: Path | None) -> Any:
    """The ``training`` section of the deployment config at ``deployment`` (None: the shipped defaults), its
    weights folder the workspace's as the pipeline's step takes it (``training.weights_dir``, else
    ``<workspace>/weights``)."""
    from components.deployment import TrainingSection

    if deployment is None:
        return TrainingSection()
    from components.state.workspace import Workspace
    from pipelines.config import ConfigError, load_config

    try:
        loaded = load_config(deployment, local_paths=False)
    except ConfigError as err:
        fail(str(err))
    weights = str(Workspace.of(loaded).weights_dir)
    return loaded.training.model_copy(update={"weights_dir": weights})


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")
