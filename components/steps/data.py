"""Steps on the phase's data: the run's plan, validation of its shards, drift against the reference."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from components.deployment import Deployment
from components.state.run_dir import DRIFT_FILE, DRIFT_REPORT_FILE, VALIDATION_FILE, RunDir
from components.state.workspace import Workspace
from components.steps.base import Config, copy_summaries, step


def plan_step(
    config: Config, phase: int, run_id: str, job_name: str = "", parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's plan (see :func:`components.runs.plan_run`) with ``config``: the run's config, the run
    parameters set (:data:`components.runs.RUN_PARAMETERS`); fails when every phase has succeeded."""
    from components.runs import PlanError, plan_run, record_failure, run_dir_for, with_run_parameters

    deployment = Deployment.coerce(config)
    try:
        deployment = with_run_parameters(deployment, parameters or {})
        plan = plan_run(deployment, phase, run_id, job_name)
        if plan is None:
            raise PlanError("every phase of the stream has succeeded: nothing to run")
    except Exception as error:
        record_failure(run_dir_for(deployment, run_id or job_name), "plan", error)
        raise
    return {**plan.model_dump(), "config": deployment.to_json()}


@step("validate")
def validate_step(
    deployment: Deployment, run_dir: Path, phase: int, shards: list[str], out_dir: Path, summary_path: Path
) -> dict:
    """Validation of the phase's train shards (``shards``) and its eval and gallery shards (from the stream)
    into ``out_dir``; the summary is also copied to the run dir. Captions are measured against the training
    model's text context.

    A phase that passes has its accepted shards of every split kept in the workspace
    (:func:`components.runs.keep_validated`): later runs replay and compare against the train split; the
    gallery and evaluation steps read the kept gallery and eval splits
    (:func:`components.runs.validated_shards`)."""
    from compat.data.manifest import phase_urls
    from compat.models import read_config
    from components.data.validation import ValidationPolicy, split_accepted_paths, validate_splits
    from components.runs import keep_validated

    text_cfg = read_config(deployment.training.model_config_name).get("text_cfg", {})
    policy = ValidationPolicy(
        max_quarantined_fraction=deployment.validation.max_quarantined_fraction,
        max_caption_tokens=int(text_cfg.get("context_length", 77)),
    )
    others = {split: phase_urls(deployment.stream.uri, phase, split) for split in ("eval", "gallery")}
    result = validate_splits({"train": shards, **others}, out_dir, policy)
    document = result.to_dict()
    if not document["blocked"]:
        kept = {split: split_accepted_paths(result, split) for split in others}
        keep_validated(Workspace.of(deployment), phase, result.accepted_paths, kept)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / VALIDATION_FILE, summary_path)
    copy_summaries(out_dir, RunDir(run_dir).validation_summary.parent, (VALIDATION_FILE,))
    return document


def accepted_shards(validated_dir: str | Path) -> list[str]:
    """The accepted shards the validation step wrote into ``validated_dir``."""
    return sorted(str(p) for p in Path(validated_dir, "accepted").glob("*.tar"))


@step("drift")
def drift_step(
    deployment: Deployment,
    run_dir: Path,
    reference_shards: list[str],
    validated_dir: str,
    production: str,
    html_path: Path,
    summary_path: Path,
) -> str:
    """Drift of the validated phase against the reference; returns the overall severity."""
    from components.data.drift import run_drift

    settings = deployment.drift
    stage_dir = RunDir(run_dir).drift_dir
    result = run_drift(
        reference_shards,
        accepted_shards(validated_dir),
        stage_dir,
        production_checkpoint=Path(production) if production and settings.embeddings else None,
        sample_size=settings.sample_size,
    )
    for path, name in ((html_path, DRIFT_REPORT_FILE), (summary_path, DRIFT_FILE)):
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stage_dir / name, path)
    return str(result["severity"])
