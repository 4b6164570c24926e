"""KFP v2 components (ops): one per pipeline step, each a thin typed wrapper around a function of
:mod:`components.steps` imported inside its body (KFP ships the function's source to the task). The
resolved config travels as a JSON string (KFP's struct parameters turn every number into a float). No
``from __future__ import annotations`` here: KFP reads the annotations at runtime."""

from typing import List, NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output, PipelineTaskFinalStatus

from components.deployment import CPU_IMAGE as IMAGE

COMPONENT = {"base_image": IMAGE, "install_kfp_package": False}


@dsl.component(**COMPONENT)
def plan_op(
    config: str,
    phase: int,
    run_id: str,
    job_name: str,
    training_method: str,
    training_steps: int,
    compat_method: str,
    compat_steps: int,
    rollout_fractions: list,
) -> NamedTuple(
    "Plan",
    [
        ("config", str),
        ("run_dir", str),
        ("phase", int),
        ("stream_dir", str),
        ("train_shards", List[str]),
        ("reference_shards", List[str]),
        ("eval_shards", List[str]),
        ("gallery_shards", List[str]),
    ],
):
    """Plan the run: its config (the run parameters set), the phase (-1: next pending), its run directory and
    the shard lists."""
    from components.steps import plan_step

    parameters = {
        "training_method": training_method,
        "training_steps": training_steps,
        "compat_method": compat_method,
        "compat_steps": compat_steps,
        "rollout_fractions": rollout_fractions,
    }
    plan = plan_step(config, phase, run_id, job_name, parameters)
    shards = ("train_shards", "reference_shards", "eval_shards", "gallery_shards")
    return tuple(plan[f] for f in ("config", "run_dir", "phase", "stream_dir", *shards))  # Plan's fields


@dsl.component(**COMPONENT)
def resolve_production_op(config: str, run_dir: str) -> str:
    """Path of the production model from the registry, or "" on the very first run."""
    from pathlib import Path

    from components.steps import resolve_production

    return resolve_production(config, Path(run_dir))


@dsl.component(**COMPONENT)
def validate_op(
    config: str,
    phase: int,
    shards: List[str],
    run_dir: str,
    accepted: Output[Dataset],
    summary: Output[Dataset],
    metrics: Output[Metrics],
) -> bool:
    """Validate a phase's shards into ``accepted`` (accepted/, quarantine/); returns ``blocked``."""
    from pathlib import Path

    from components.steps import validate_step
    from components.steps.base import log_metrics

    document = validate_step(config, Path(run_dir), phase, shards, Path(accepted.path), Path(summary.path))
    log_metrics(metrics, {k: document[k] for k in ("total", "passed", "quarantined", "quarantined_fraction")})
    return bool(document["blocked"])


@dsl.component(**COMPONENT)
def drift_op(
    config: str,
    run_dir: str,
    reference_shards: List[str],
    current: Input[Dataset],
    production: str,
    report: Output[HTML],
    summary: Output[Dataset],
) -> str:
    """Drift of the validated phase against the reference phase; returns the overall severity."""
    from pathlib import Path

    from components.steps import drift_step

    outputs = Path(report.path), Path(summary.path)
    return drift_step(config, Path(run_dir), reference_shards, current.path, production, *outputs)


@dsl.component(**COMPONENT)
def continual_op(
    config: str,
    run_dir: str,
    phase: int,
    stream_dir: str,
    accepted: Input[Dataset],
    production: str,
    candidate: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """Mod-X continual training on the validated phase; the candidate checkpoint is ``candidate/model``."""
    from pathlib import Path

    from components.steps import continual_step
    from components.steps.base import log_metrics

    doc = continual_step(
        config, Path(run_dir), phase, stream_dir, accepted.path, production, Path(candidate.path)
    )
    recalls = {}
    for domain, directions in (doc.get("domains") or {}).items():
        for direction, values in (directions if isinstance(directions, dict) else {}).items():
            if isinstance(values, dict) and isinstance(values.get("R@1"), (int, float)):
                recalls[f"{domain}.{direction}.R@1"] = values["R@1"]
    log_metrics(metrics, recalls)


@dsl.component(**COMPONENT)
def compat_op(
    config: str,
    run_dir: str,
    phase: int,
    candidate: Input[Model],
    production: str,
    accepted: Input[Dataset],
    compat_model: Output[Model],
) -> None:
    """Compatibility training of the candidate against the frozen production model."""
    from pathlib import Path

    from components.steps import compat_step

    checkpoint = str(Path(candidate.path) / "model")
    compat_step(config, Path(run_dir), phase, checkpoint, production, accepted.path, Path(compat_model.path))


@dsl.component(**COMPONENT)
def evaluate_op(
    config: str,
    run_dir: str,
    phase: int,
    production: str,
    compat_model: Input[Model],
    eval_shards: List[str],
    report: Output[Dataset],
    metrics: Output[Metrics],
) -> bool:
    """Retrieval matrix, margins and ECC of the candidate against production; returns the ECC verdict."""
    from pathlib import Path

    from components.steps import evaluate_step
    from components.steps.base import log_metrics

    doc = evaluate_step(
        config, Path(run_dir), production, compat_model.path, eval_shards, Path(report.path), phase
    )
    log_metrics(
        metrics,
        {
            f"{direction}.{pair.replace('/', '_')}.{metric}": value
            for direction, pairs in doc["retrieval"].items()
            for pair, values in pairs.items()
            for metric, value in values.items()
        },
    )
    return bool(doc.get("ecc_passed", False))


@dsl.component(**COMPONENT)
def gate_op(
    config: str,
    run_dir: str,
    report: Input[Dataset],
    validation: Input[Dataset],
    drift: Input[Dataset],
    decision: Output[Dataset],
) -> str:
    """The release gate (fail-closed): returns "pass" or "block"."""
    from pathlib import Path

    from components.state.run_dir import COMPAT_REPORT_FILE
    from components.steps import gate_step

    report_file = str(Path(report.path) / COMPAT_REPORT_FILE)
    return gate_step(config, Path(run_dir), report_file, validation.path, drift.path, Path(decision.path))


@dsl.component(**COMPONENT)
def register_op(config: str, run_dir: str, phase: int, model: Input[Model], bootstrap: bool) -> str:
    """Log the run to MLflow and register the model as the ``candidate`` version; returns the version."""
    from pathlib import Path

    from components.steps import register_step

    return register_step(config, Path(run_dir), phase, model.path, bootstrap=bootstrap)["version"]


@dsl.component(**COMPONENT)
def serve_first_model_op(config: str, run_dir: str, version: str, gallery_shards: List[str]) -> None:
    """First run: index the gallery with the first model, record lineage, make it ``production``."""
    from pathlib import Path

    from components.steps import serve_first_model_step

    serve_first_model_step(config, Path(run_dir), version, gallery_shards)


@dsl.component(**COMPONENT)
def ingest_op(config: str, run_dir: str, gallery_shards: List[str]) -> int:
    """Upgrade runs: index the phase's new gallery items with the serving model; returns how many."""
    from pathlib import Path

    from components.steps import ingest_step

    return int(ingest_step(config, Path(run_dir), gallery_shards)["n_new"])


@dsl.component(**COMPONENT)
def rollout_op(config: str, run_dir: str, version: str) -> str:
    """After a gate pass: staged backfill rollout (resumable), then ``production``; returns its status."""
    from pathlib import Path

    from components.steps import rollout_step

    return rollout_step(config, Path(run_dir), version)["rollout"]["status"]


@dsl.component(**COMPONENT)
def rollout_ranges_op(config: str, run_dir: str, version: str, written: list = []) -> list:  # noqa: B006
    """With ``rollout.workers`` > 1: the rollout up to the next backfill stage's rank ranges, returned as
    ``"start-end"`` for parallel :func:`rollout_range_op` tasks (one idle range when none waits);
    ``written`` collects the previous stage's ranges (the fan-in)."""
    from pathlib import Path

    from components.steps import rollout_ranges_step

    return rollout_ranges_step(config, Path(run_dir), version)


@dsl.component(**COMPONENT)
def rollout_range_op(config: str, run_dir: str, rank_range: str) -> str:
    """One backfill worker: re-embeds and writes one rank range of the running rollout (resumable)."""
    from pathlib import Path

    from components.steps import rollout_range_step

    rollout_range_step(config, Path(run_dir), rank_range)
    return rank_range


@dsl.component(**COMPONENT)
def note_blocked_op(run_dir: str, step: str, reason: str) -> None:
    """Record that a step stopped the run, for the report and ``compatflow status``."""
    from pathlib import Path

    from components.steps import note_blocked

    note_blocked(Path(run_dir), step, reason)


@dsl.component(**COMPONENT)
def finish_op(
    config: str, run_id: str, job_name: str, job_id: str, status: PipelineTaskFinalStatus, html: Output[HTML]
) -> None:
    """Exit handler: record the run's outcome and write the on-call report, whatever happened before."""
    from pathlib import Path

    from components.steps import finish_step

    error = status.error_message or ""
    finish_step(config, run_id, status.state, error, Path(html.path), job_name, job_id)
