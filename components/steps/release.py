"""Release steps: the production model, the compatibility evaluation, the gate and the registration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compat.io import write_json_atomic
from components.deployment import Deployment
from components.state.run_dir import COMPAT_REPORT_FILE, GATE_FILE, RunDir
from components.steps.base import Config, copy_summaries, model_dir_in, registry_of, run_params, step


@step("resolve-production")
def resolve_production(deployment: Deployment, run_dir: Path | None = None) -> str:
    """Path of the production model (downloaded and verified once per version), or "" if none: a plain
    checkpoint or a compatible model of any method (:mod:`compat.production`); ``run_dir`` gets a failure."""
    registry = registry_of(deployment)
    version = registry.alias_version("production") if registry.exists() else None
    return "" if version is None else model_dir_of(deployment, version)


def model_dir_of(config: Config, version: str) -> str:
    """The workspace copy of a registered model version, downloaded once and hash-verified on reuse: what
    serving records and rollouts name (never a pipeline artifact path, which is task-local on a cluster)."""
    return str(registry_of(config).local_copy(version))


@step("evaluate")
def evaluate_step(
    deployment: Deployment,
    run_dir: Path,
    production: str,
    compat_model: str,
    eval_shards: list[str],
    out_dir: Path,
    phase: int,
) -> dict[str, Any]:
    """The compatibility matrix, bootstrap margins and ECC verdicts of the candidate against production, on
    the eval items that validation accepted."""
    from components.runs import validated_shards
    from components.training.evaluate import evaluate

    report = evaluate(
        production,
        compat_model,
        validated_shards(deployment, eval_shards, "eval"),
        out_dir,
        scenario=deployment.compat.scenario,
        data_phase=phase,
        seed=deployment.training.seed,
    )
    copy_summaries(out_dir, RunDir(run_dir).compat_report.parent, (COMPAT_REPORT_FILE,))
    return report


@step("gate")
def gate_step(
    deployment: Deployment, run_dir: Path, report: str, validation: str, drift: str, out_dir: Path
) -> str:
    """Pass or block (fail-closed); returns the decision."""
    from components.gate import run_gate

    policy = deployment.gate.policy
    decision = run_gate(report, out_dir, policy=policy, validation=validation, drift=drift)
    copy_summaries(out_dir, RunDir(run_dir).gate_file.parent, (GATE_FILE,))
    return decision.decision


@step("register")
def register_step(
    deployment: Deployment, run_dir: Path, phase: int, model_dir: str, *, bootstrap: bool = False
) -> dict:
    """Log the run to MLflow and register the model as the ``candidate`` version."""
    from components.gate import GateDecision

    method = "bootstrap" if bootstrap else deployment.compat.method
    run = RunDir(run_dir)
    if run.gate_file.is_file():
        gate = GateDecision.read(run.gate_file)
    else:  # the first model: nothing to be compatible with
        gate = GateDecision.bootstrap_record()
        gate.write(run.gate_file.parent)
    reports = [run.validation_summary, run.drift_summary, run.drift_report, run.gate_file]
    metrics, report = run.continual_metrics, run.compat_report
    info = registry_of(deployment).register_run(
        run_dir.name,
        model_dir_in(model_dir),
        data_phase=phase,
        method=method,
        gate=gate,
        compat_report=report if report.is_file() else None,
        training_metrics=metrics if metrics.is_file() else None,
        reports=reports,
        params={
            "phase": phase,
            "method": method,
            "model_config": deployment.training.model_config_name,
            "bootstrap": bootstrap,
            **run_params(deployment),
        },
    )
    write_json_atomic(run.registered_file, info)
    return info
