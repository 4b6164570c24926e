"""How a run ends: a step that stopped it, the exit handler's outcome and the on-call report."""

from __future__ import annotations

import shutil
from pathlib import Path

from compat.io import write_json_atomic
from components.deployment import Deployment
from components.steps.base import Config


def note_blocked(run_dir: Path, step: str, reason: str) -> None:
    """Record that a step stopped the run (read by the report, the outcome and ``compatflow status``)."""
    from components.runs import BLOCKED_FILE

    write_json_atomic(run_dir / BLOCKED_FILE, {"step": step, "reason": reason})


def finish_step(
    config: Config, run_id: str, pipeline_state: str, error: str, html_path: Path, job_name: str = ""
) -> dict:
    """Exit handler: the run's outcome into the workspace state, then the on-call report."""
    from components.runs import finish_run, run_dir_of_job

    deployment = Deployment.coerce(config)
    run_dir = run_dir_of_job(deployment, run_id, job_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    outcome = finish_run(deployment, run_dir, pipeline_state, error)
    paths = report_step(run_dir)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(paths["html"], html_path)
    return outcome


def report_step(run_dir: Path) -> dict[str, str]:
    """The on-call report (HTML + Markdown) of the run, written whatever happened before."""
    from components.report import write_reports

    paths = write_reports(run_dir, run_dir / "report")
    return {fmt: str(path) for fmt, path in paths.items()}
