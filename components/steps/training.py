"""Training steps: continual training of the new model (Mod-X), compatibility training against production."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from compat.io import read_json_object_or_none, write_json_atomic
from components.deployment import Deployment, TrainingSection
from components.state.run_dir import METRICS_FILE, SPATIAL_DISORDER_FILE, VALIDATION_FILE, RunDir
from components.steps.base import checkpoint_dir_of, copy_summaries, live_metrics, step
from components.steps.data import accepted_shards
from components.steps.ranks import launch, under_launcher

logger = logging.getLogger(__name__)


@step("continual")
def continual_step(
    deployment: Deployment,
    run_dir: Path,
    phase: int,
    stream_dir: str,
    validated_dir: str,
    production: str,
    out_dir: Path,
) -> dict[str, Any]:
    """The candidate of the phase (CLIP_0 on phase 0).

    Scenario ``continual``: the production model trained on the phase's validated shards with
    ``training.method`` (Mod-X by default). Scenario ``foundation``: ``compat.foundation_config`` trained
    from its own initialisation on every phase so far (the new architecture that the compat step then
    makes compatible with production). The training curve is logged to the run's MLflow run as training
    goes (``train.loss``, ``train.contrastive``, ``train.kl``, ``train.lr``, ... by step).

    With ``resources.gpu.accelerator_count`` > 1 the step launches :func:`train_candidate` on that many
    processes with torchrun (:func:`components.steps.ranks.launch`: DDP, one rank per GPU of the task's node)
    and reads what rank 0 wrote; with 0 or 1 it trains in this process.
    """
    ranks = deployment.resources.gpu.accelerator_count
    if ranks > 1 and not under_launcher():
        arguments = {
            "config": deployment.to_json(),
            "run_dir": str(run_dir),
            "phase": phase,
            "stream_dir": stream_dir,
            "validated_dir": validated_dir,
            "production": production,
            "out_dir": str(out_dir),
        }
        launch("continual", ranks, arguments, RunDir(run_dir).continual_dir)
        metrics = read_json_object_or_none(Path(out_dir) / METRICS_FILE) or {}
    else:
        metrics = train_candidate(deployment, run_dir, phase, stream_dir, validated_dir, production, out_dir)
    copy_summaries(out_dir, RunDir(run_dir).continual_dir, (METRICS_FILE, SPATIAL_DISORDER_FILE))
    return metrics


def train_candidate(
    config: Deployment | str,
    run_dir: str | Path,
    phase: int,
    stream_dir: str,
    validated_dir: str,
    production: str,
    out_dir: str | Path,
) -> dict[str, Any]:
    """The body of :func:`continual_step`, run by one process or by every rank under torchrun
    (:mod:`components.steps.ranks`): the candidate trained, ``metrics.json`` written by rank 0 (the other
    ranks return {}), the curve logged to MLflow by rank 0 alone."""
    from compat.training import env_dist_info
    from components.runs import replay_shards
    from components.state.workspace import Workspace
    from components.training.continual import TrainingSettings, run_continual

    deployment = Deployment.coerce(config)
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    training = deployment.training
    foundation = bool(production) and deployment.compat.scenario == "foundation"
    accepted = accepted_shards(validated_dir)
    budget = training_budget(training, _validated_count(validated_dir))
    settings = dataclasses.replace(
        TrainingSettings.from_section(training),
        steps=budget["steps"],
        seed=training.seed + phase,
        weights_dir=str(Workspace.of(deployment).weights_dir),
        **(
            {"config_name": deployment.compat.foundation_config, "method": "foundation", "alpha": None}
            if foundation
            else {}
        ),
    )
    main_rank = env_dist_info().is_main
    with live_metrics(deployment, run_dir, "train.") if main_rank else contextlib.nullcontext() as live:
        metrics = run_continual(
            stream_dir,
            phase,
            out_dir,
            settings,
            production=production or None,
            replay_urls=replay_shards(deployment, phase) if training.replay_buffer_size else None,
            train_urls=accepted or None,
            version=run_dir.name,
            # In the run directory, not the task's artifact: a resumed run (same run id) continues from there.
            train_dir=RunDir(run_dir).training_dir,
            on_step=live,
        )
    if metrics:
        metrics["budget"] = budget
        write_json_atomic(out_dir / METRICS_FILE, metrics)
    return metrics


# A budget that passes over the phase more often than this is reported as a warning (it memorises the phase).
MAX_EPOCHS_WITHOUT_WARNING = 20.0


def training_budget(training: TrainingSection, samples: int | None) -> dict[str, Any]:
    """Optimizer steps of the phase: ``training.steps``, or ``ceil(epochs x samples / batch_size)`` when
    ``training.epochs`` is set; with the epochs the budget amounts to and a warning when it repeats a small
    phase many times (shown in the report)."""
    import math

    batch, epochs = training.batch_size, training.epochs
    if epochs is not None and samples:
        steps = max(1, math.ceil(float(epochs) * samples / batch))
    else:
        steps = int(training.steps)
    passes = None if not samples else round(steps * batch / samples, 2)
    warning = None
    if passes is not None and passes > MAX_EPOCHS_WITHOUT_WARNING:
        warning = (
            f"the budget ({steps} steps x {batch} pairs) passes over this phase's {samples} samples "
            f"{passes:g} times: the model may memorise it; set training.epochs (e.g. 5) to size the budget "
            "to the phase"
        )
        logger.warning(warning)
    return {
        "steps": steps,
        "from": "epochs" if epochs is not None and samples else "steps",
        "samples": samples,
        "epochs": passes,
        "warning": warning,
    }


def _validated_count(validated_dir: str | Path) -> int | None:
    """Samples the validation step accepted (its ``validation.json``), or None when unknown."""
    path = Path(validated_dir) / VALIDATION_FILE
    try:
        return int(json.loads(path.read_text())["passed"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


@step("compat")
def compat_step(
    deployment: Deployment,
    run_dir: Path,
    phase: int,
    candidate: str,
    production: str,
    validated_dir: str,
    out_dir: Path,
) -> str:
    """Make the candidate compatible with production with the configured method; returns the model dir.

    Trains on the phase's accepted shards plus the first ``compat.replay_shards_per_phase`` validated
    shards of every earlier phase: the old gallery holds those domains too, and the cross-model losses
    need them among the in-batch negatives.
    """
    from compat.compat_training import train_compat
    from compat.methods.model import COMPAT_FILE
    from compat.models.checkpoint import tensors_digest
    from compat.production import identity
    from components.runs import replay_shards

    settings = deployment.compat
    per_phase = settings.replay_shards_per_phase
    replay = (
        [s for shards in replay_shards(deployment, phase, per_phase) for s in shards] if per_phase else []
    )
    candidate = checkpoint_dir_of(candidate)
    # Trained once per run: a resumed run reuses the model its earlier attempt finished (same inputs), so
    # it registers the same version and a rollout it had started resumes from its cursor.
    key = {
        "method": settings.method,
        "options": settings.options,
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "production": identity(production)["sha256"],
        "candidate": tensors_digest(Path(candidate)),  # the weights, not the file (see tensors_digest)
        "replay_shards": replay,
    }
    model_dir, record_path = RunDir(run_dir).compat_model_dir, RunDir(run_dir).compat_record
    record = read_json_object_or_none(record_path)
    if record and record.get("key") == key and (model_dir / COMPAT_FILE).is_file():
        logger.info("compat: reusing %s (trained by an earlier attempt of this run)", model_dir)
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
        with live_metrics(deployment, run_dir, "compat.") as live:
            model = train_compat(
                settings.method,
                production,
                candidate,
                accepted_shards(validated_dir) + replay,
                model_dir,
                settings={**settings.options, "steps": settings.steps, "device": deployment.training.device},
                batch_size=settings.batch_size,
                on_step=live,
            )
        record = {
            "method": settings.method,
            "path": str(model_dir),
            "replay_shards": replay,
            "contract": model.contract.to_dict(),
            "trainable_parameters": model.trainable_parameters,
            "key": key,
        }
        write_json_atomic(record_path, record)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(model_dir, out_dir)
    return str(out_dir)
