"""How a run ends: a step that stopped it, the exit handler's outcome and the on-call report."""

from __future__ import annotations

import shutil
from pathlib import Path

from components.deployment import Deployment
from components.runs import RunBlock, RunOutcome, finish_run, run_dir_of_job
from components.state.run_dir import RunDir
from components.steps.base import Config


def note_blocked(run_dir: Path, step: str, reason: str) -> None:
    """Record that a step stopped the run (read by the report, the outcome and ``compatflow status``)."""
    RunBlock(step=step, reason=reason).write(RunDir(run_dir).blocked_file)


def finish_step(
    config: Config,
    run_id: str,
    pipeline_state: str,
    error: str,
    html_path: Path,
    job_name: str = "",
    job_id: str = "",
) -> RunOutcome:
    """Exit handler: the run's outcome into the workspace state, then the on-call report, whatever happened
    before. On a cluster whose ConfigMap names the KFP UI (``$COMPATFLOW_KFP_UI_URL``) the outcome keeps the
    run's page (``job_id``: the KFP run's ID), for the report's header."""
    import os

    from components.report import write_reports

    deployment = Deployment.coerce(config)
    run_dir = run_dir_of_job(deployment, run_id, job_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    outcome = finish_run(deployment, run_dir, pipeline_state, error)
    ui = os.environ.get("COMPATFLOW_KFP_UI_URL", "").rstrip("/")
    if ui and job_id:
        outcome.kfp_run_url = f"{ui}/#/runs/details/{job_id}"
        outcome.write(RunDir(run_dir).outcome_file)
    end_mlflow_run(deployment, run_dir.name, outcome.status, pipeline_state)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(write_reports(run_dir, RunDir(run_dir).report_dir)["html"], html_path)
    return outcome


def end_mlflow_run(deployment: Deployment, pipeline_run_id: str, status: str, pipeline_state: str) -> None:
    """End the phase's MLflow run as the phase ended: FAILED when it failed, KILLED when the pipeline was
    cancelled, else FINISHED (a blocked or rejected phase ran to its end). Best effort: the outcome is
    already recorded, and a registry that cannot be reached is logged, not raised."""
    import logging

    from components.steps.base import registry_of

    mlflow_status = "FAILED" if status == "failed" else "FINISHED"
    if pipeline_state.upper() in ("CANCELED", "CANCELLED", "CANCELING"):
        mlflow_status = "KILLED"
    try:
        registry_of(deployment).end_pipeline_run(pipeline_run_id, mlflow_status)
    except Exception as err:  # the report must still be written
        logging.getLogger(__name__).warning("MLflow run of %s not ended: %s", pipeline_run_id, err)
