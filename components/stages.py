"""The pipeline's stages as plain functions of the resolved config.

Each function runs one stage of a pipeline run: it reads its inputs (paths), calls the stage
implementation, writes its summary under ``<run_dir>/<stage>/`` (what the on-call report and
``compatflow status`` read) and returns what the next stage needs. The KFP components in
:mod:`components.kfp_ops` are thin wrappers around these; tests call them directly.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from compat.io import write_json_atomic

logger = logging.getLogger(__name__)

BOOTSTRAP_REASON = {
    "code": "bootstrap",
    "message": "no production model yet: the phase-0 model becomes the first production model",
}


Config = dict[str, Any] | str
F = TypeVar("F", bound=Callable[..., Any])


def step(name: str) -> Callable[[F], F]:
    """Name a step function ``f(config, run_dir, ...)``: it runs under the workspace's shared step lock
    (:func:`components.lock.step_lock`); when it raises, ``<run_dir>/failure.json`` records the step, the
    exception and what to do next (:func:`components.runs.record_failure`), for the report, ``outcome.json``
    and the CLI."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(config: Config, run_dir: Path | None = None, *args: Any, **kwargs: Any) -> Any:
            from components.lock import step_lock

            try:
                with step_lock(as_config(config)["workspace"]):
                    return fn(config, run_dir, *args, **kwargs)
            except Exception as error:
                from components.runs import record_failure

                if run_dir is not None:
                    record_failure(Path(run_dir), name, error)
                raise

        return run  # type: ignore[return-value]

    return decorate


def as_config(config: Config) -> dict[str, Any]:
    """The resolved config, from a mapping or the JSON string the KFP components receive."""
    return json.loads(config) if isinstance(config, str) else config


def plan_stage(config: Config, phase: int, run_id: str, job_name: str = "") -> dict[str, Any]:
    """The run's plan (see :func:`components.runs.plan_run`); fails when every phase has succeeded."""
    from components.runs import PlanError, plan_run, record_failure, run_dir_for

    config = as_config(config)
    try:
        plan = plan_run(config, phase, run_id, job_name)
        if plan is None:
            raise PlanError("every phase of the stream has succeeded: nothing to run")
    except Exception as error:
        record_failure(run_dir_for(config, run_id or job_name), "plan", error)
        raise
    return plan


@step("validate")
def validate_stage(
    config: Config, run_dir: Path, phase: int, shards: list[str], out_dir: Path, summary_path: Path
) -> dict:
    """Validation of the phase's shards into ``out_dir``; the summary is also copied to the run dir.

    A phase that passes has its accepted shards kept in the workspace (:func:`components.runs.keep_validated`)
    for later runs' replay and drift reference."""
    from components.runs import keep_validated
    from components.validation import ValidationPolicy, validate_phase

    config = as_config(config)
    policy = ValidationPolicy(max_quarantined_fraction=config["validation"]["max_quarantined_fraction"])
    result = validate_phase(shards, out_dir, policy)
    document = result.to_dict()
    if not document["blocked"]:
        keep_validated(config["workspace"], phase, result.accepted_paths)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "validation.json", summary_path)
    _copy_summaries(out_dir, run_dir / "validate", ("validation.json",))
    return document


def accepted_shards(validated_dir: str | Path) -> list[str]:
    """The accepted shards the validation stage wrote into ``validated_dir``."""
    return sorted(str(p) for p in Path(validated_dir, "accepted").glob("*.tar"))


@step("drift")
def drift_stage(
    config: Config,
    run_dir: Path,
    reference_shards: list[str],
    validated_dir: str,
    production: str,
    html_path: Path,
    summary_path: Path,
) -> str:
    """Drift of the validated phase against the reference; returns the overall severity."""
    from components.drift import run_drift

    settings = as_config(config)["drift"]
    stage_dir = run_dir / "drift"
    result = run_drift(
        reference_shards,
        accepted_shards(validated_dir),
        stage_dir,
        production_checkpoint=Path(production) if production and settings["embeddings"] else None,
        sample_size=settings["sample_size"],
    )
    for path, name in ((html_path, "drift_report.html"), (summary_path, "drift.json")):
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stage_dir / name, path)
    return str(result["severity"])


def note_blocked(run_dir: Path, stage: str, reason: str) -> None:
    """Record that a stage stopped the run (read by the report, the outcome and ``compatflow status``)."""
    from components.runs import BLOCKED_FILE

    write_json_atomic(run_dir / BLOCKED_FILE, {"stage": stage, "reason": reason})


def finish_stage(
    config: Config, run_id: str, pipeline_state: str, error: str, html_path: Path, job_name: str = ""
) -> dict:
    """Exit handler: the run's outcome into the workspace state, then the on-call report."""
    from components.runs import finish_run, run_dir_of_job

    resolved = as_config(config)
    run_dir = run_dir_of_job(resolved, run_id, job_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    outcome = finish_run(resolved, run_dir, pipeline_state, error)
    paths = report_stage(run_dir)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(paths["html"], html_path)
    return outcome


def workspace_of(config: dict[str, Any]) -> Any:
    from components.workspace import Workspace

    return Workspace.from_config(config)


def registry_of(config: dict[str, Any]) -> Any:
    from components.registry import Registry

    return Registry(workspace_of(config), model_name=config["registry"]["model_name"])


@step("resolve-production")
def resolve_production(config: Config, run_dir: Path | None = None) -> str:
    """Path of the production model (downloaded and verified once per version), or "" if none.

    The model may be a plain checkpoint or a compatible model of any method (:mod:`compat.production`).
    ``run_dir`` is where a failure is recorded."""
    config = as_config(config)
    registry = registry_of(config)
    version = registry.alias_version("production") if registry.exists() else None
    return "" if version is None else model_dir_of(config, version)


def model_dir_of(config: Config, version: str) -> str:
    """The workspace copy of a registered model version, downloaded once and hash-verified on reuse.

    Serving records and rollouts name this copy (never a pipeline artifact path, which is task-local
    on a cluster).
    """
    config = as_config(config)
    target = workspace_of(config).models_dir / f"v{version}"
    if (target / "model.json").is_file() or (target / "compat.json").is_file():
        registry_of(config).verify_copy(version, target)
        return str(target)
    return str(registry_of(config).download(version, target))


@step("serve-first-model")
def serve_first_model_stage(
    config: Config, run_dir: Path, version: str, gallery_shards: list[str]
) -> dict[str, Any]:
    """First run: index the gallery with the first model, record lineage, make it ``production``.

    The first model is a plain checkpoint: its space is its checkpoint version (as
    :func:`compat.methods.run.space_id_of` names it), read from the sidecar without loading the weights twice.
    """
    from compat.models import read_sidecar
    from components.rollout_stage import index_stage

    config = as_config(config)
    model = model_dir_of(config, version)
    record = index_stage(
        workspace_of(config),
        model,
        version,
        str(read_sidecar(Path(model))["version"]),
        gallery_shards,
        seed=config["training"]["seed"],
        uri=config["index"]["uri"],
    )
    _record_lineage(config, record.pop("new_items"))
    state = {"state": "completed", "model_version": version, "kind": "initial_index"}
    registry_of(config).promote(version, rollout_state=state)
    summary = {**record, "version": version, "promoted": True}
    write_json_atomic(run_dir / "rollout" / "rollout.json", summary)
    return summary


@step("ingest")
def ingest_stage(config: Config, run_dir: Path, gallery_shards: list[str]) -> dict[str, Any]:
    """Index the phase's new gallery items with the serving model, whatever the gate will decide.

    Items already in the index are skipped (idempotent), so the items of every phase are searchable from
    the run that brings them; an upgrade that ships later re-embeds them with the rest of the gallery.
    Lineage records them. Writes ``ingest/ingest.json``.
    """
    from components.rollout import RolloutPaths, read_serving
    from components.rollout_stage import index_stage

    config = as_config(config)
    workspace = workspace_of(config)
    serving = read_serving(RolloutPaths.for_workspace(workspace).serving)
    if serving is None:
        raise RuntimeError(f"no serving record in {workspace.root}: the first run indexes the gallery")
    served = serving["query_model"]
    added = index_stage(
        workspace,
        served["uri"],
        served["version"],
        "",
        gallery_shards,
        seed=config["training"]["seed"],
        uri=config["index"]["uri"],
    )
    summary = {
        "model_version": served["version"],
        "n_items": added["n_items"],
        "n_new": added["n_new"],
        "lineage_recorded": _record_lineage(config, added.pop("new_items")),
    }
    write_json_atomic(run_dir / "ingest" / "ingest.json", summary)
    return summary


@step("rollout")
def rollout_candidate_stage(config: Config, run_dir: Path, version: str) -> dict[str, Any]:
    """After a gate pass: roll ``version`` out and make it ``production``.

    The phase's new gallery items are already indexed with the serving model (:func:`ingest_stage` runs
    before it in the pipeline); the rollout switches queries and backfills the whole gallery in stages,
    probing each (resumable; a rollback restores every item it touched). Lineage follows the index. A
    rollout that halts (a stage probe fell below its floor; the stage was restored) ends the run
    ``rejected`` and leaves ``production`` where it was.
    """
    from components.lineage import sync_from_index
    from components.rollout import RolloutPaths, rollback
    from components.rollout_stage import open_index, rollout_stage

    config = as_config(config)
    settings, uri, seed = config["rollout"], config["index"]["uri"], config["training"]["seed"]
    workspace = workspace_of(config)
    undone = _undo_unfinished_rollout(workspace, uri, version)
    state = rollout_stage(
        workspace,
        version,
        new_model=model_dir_of(config, version),
        policy=settings["order"],
        fractions=settings["fractions"],
        seed=seed,
        batch_size=settings["batch_size"],
        floors=settings.get("floors") or {},
        uri=uri,
    )
    if state["state"] == "halted":
        # Halt means roll back: the stages accepted before the halted one are undone too and queries go back
        # to the production model, so the gallery holds production's vectors only and production, the
        # serving record and the index agree on what is served (the next upgrade is compatible with it).
        with open_index(workspace, uri) as index:
            state = rollback(RolloutPaths.for_workspace(workspace), index)
    gallery = state["gallery"]
    summary: dict[str, Any] = {
        "version": version,
        "undone_first": undone,
        "rollout": state,
        "lineage_updated": sync_from_index(config["lineage"]["repo"], gallery["uri"], gallery["alias"]),
        "promoted": state["state"] == "completed",
    }
    if summary["promoted"]:
        registry_of(config).promote(version, rollout_state=state)
    else:
        reason = state.get("halt_reason") or "see rollout/rollout.json"
        note_blocked(run_dir, "rollout", f"rollout halted and rolled back: {reason}")
    write_json_atomic(run_dir / "rollout" / "rollout.json", summary)
    write_json_atomic(run_dir / "rollout" / "rollout_state.json", state)  # for the on-call report
    return summary


def _undo_unfinished_rollout(workspace: Any, uri: str, version: str) -> dict[str, Any] | None:
    """Roll back a rollout of another version left unfinished (its run was killed or failed and will not
    resume it, or it halted under `compatflow rollout run`: never promoted); a rollout of ``version`` itself
    is resumed by the caller. Returns what was undone (for the report), or None."""
    from components.rollout import RolloutPaths, load_state, rollback
    from components.rollout_stage import open_index

    paths = RolloutPaths.for_workspace(workspace)
    state = load_state(paths.state)
    # Halted counts too: one left by `compatflow rollout run` keeps its accepted stages (a mixed gallery
    # queried by its candidate), which the candidate here was not trained to read.
    unfinished = state is not None and state["state"] in ("pending", "running", "halted")
    if not unfinished or str(state["model_version"]) == str(version):
        return None
    logger.warning(
        "rolling back unfinished rollout %s of version %s first", state["rollout_id"], state["model_version"]
    )
    with open_index(workspace, uri) as index:
        rollback(paths, index)
    return {
        "rollout_id": state["rollout_id"],
        "model_version": state["model_version"],
        "state": state["state"],
    }


def _record_lineage(config: dict[str, Any], items: list[dict[str, Any]]) -> int:
    """Record freshly indexed items in Feast (who embedded them, in which space, from which image)."""
    from components.lineage import LineageStore

    if not items:
        return 0
    store = LineageStore(config["lineage"]["repo"])
    store.apply()
    return store.write_items(items)


@step("continual")
def continual_stage(
    config: Config,
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
    from its own initialisation on every phase so far (the new architecture that the compat stage then
    makes compatible with production).
    """
    from components.continual import run_continual
    from components.runs import replay_shards, training_dir

    config = as_config(config)
    training = config["training"]
    foundation = bool(production) and config["compat"]["scenario"] == "foundation"
    accepted = accepted_shards(validated_dir)
    budget = training_budget(training, _validated_count(validated_dir))
    metrics = run_continual(
        stream_dir,
        phase,
        out_dir,
        production=production or None,
        config_name=config["compat"]["foundation_config"] if foundation else training["model_config"],
        method="foundation" if foundation else training["method"],
        alpha=None if foundation else training["alpha"],
        replay_buffer_size=training["replay_buffer_size"],
        replay_rows=training["replay_rows"],
        replay_urls=replay_shards(config, phase) if training["replay_buffer_size"] else None,
        steps=budget["steps"],
        checkpoint_every=training.get("checkpoint_every", 50),
        batch_size=training["batch_size"],
        lr=training["lr"],
        warmup_fraction=training["warmup_fraction"],
        seed=training["seed"] + phase,
        device=training["device"],
        train_urls=accepted or None,
        version=f"{run_dir.name}",
        # In the run directory, not the task's artifact: a resumed run (same run id) continues from there.
        train_dir=training_dir(run_dir),
    )
    if metrics:
        metrics["budget"] = budget
        write_json_atomic(Path(out_dir) / "metrics.json", metrics)
    _copy_summaries(out_dir, run_dir / "continual", ("metrics.json", "spatial_disorder.json"))
    return metrics


# A budget that passes over the phase more often than this is reported as a warning (it memorises the phase).
MAX_EPOCHS_WITHOUT_WARNING = 20.0


def training_budget(training: dict[str, Any], samples: int | None) -> dict[str, Any]:
    """Optimizer steps of the phase: ``training.steps``, or ``ceil(epochs x samples / batch_size)`` when
    ``training.epochs`` is set; with the epochs the budget amounts to and a warning when it repeats a small
    phase many times (shown in the report)."""
    import math

    batch, epochs = training["batch_size"], training.get("epochs")
    if epochs is not None and samples:
        steps = max(1, math.ceil(float(epochs) * samples / batch))
    else:
        steps = int(training["steps"])
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
    """Samples the validation stage accepted (its ``validation.json``), or None when unknown."""
    path = Path(validated_dir) / "validation.json"
    try:
        return int(json.loads(path.read_text())["passed"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


@step("compat")
def compat_stage(
    config: Config,
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
    from compat.methods.base import COMPAT_FILE
    from compat.methods.run import train_compat
    from compat.models.checkpoint import tensors_digest
    from compat.production import identity
    from components.runs import replay_shards

    config = as_config(config)
    settings = config["compat"]
    per_phase = settings["replay_shards_per_phase"]
    replay = [s for shards in replay_shards(config, phase, per_phase) for s in shards] if per_phase else []
    candidate = _checkpoint_dir(candidate)
    # Trained once per run: a resumed run reuses the model its earlier attempt finished (same inputs), so
    # it registers the same version and a rollout it had started resumes from its cursor.
    key = {
        "method": settings["method"],
        "options": settings["options"],
        "steps": settings["steps"],
        "batch_size": settings["batch_size"],
        "production": identity(production)["sha256"],
        "candidate": tensors_digest(Path(candidate)),  # the weights, not the file (see tensors_digest)
        "replay_shards": replay,
    }
    model_dir, record_path = run_dir / "compat" / "model", run_dir / "compat" / "compat_model.json"
    record = _read_json(record_path)
    if record and record.get("key") == key and (model_dir / COMPAT_FILE).is_file():
        logger.info("compat: reusing %s (trained by an earlier attempt of this run)", model_dir)
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
        model = train_compat(
            settings["method"],
            production,
            candidate,
            accepted_shards(validated_dir) + replay,
            model_dir,
            settings={
                **settings["options"],
                "steps": settings["steps"],
                "device": config["training"]["device"],
            },
            batch_size=settings["batch_size"],
        )
        record = {
            "method": settings["method"],
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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


@step("evaluate")
def evaluate_stage(
    config: Config,
    run_dir: Path,
    production: str,
    compat_model: str,
    eval_shards: list[str],
    out_dir: Path,
    phase: int,
) -> dict[str, Any]:
    """The compatibility matrix, bootstrap margins and ECC verdicts of the candidate against production."""
    from components.evaluate import evaluate

    config = as_config(config)
    report = evaluate(
        production,
        compat_model,
        eval_shards,
        out_dir,
        scenario=config["compat"]["scenario"],
        data_phase=phase,
        seed=config["training"]["seed"],
    )
    _copy_summaries(out_dir, run_dir / "evaluate", ("compat_report.json",))
    return report


@step("gate")
def gate_stage(config: Config, run_dir: Path, report: str, validation: str, drift: str, out_dir: Path) -> str:
    """Pass or block (fail-closed); returns the decision."""
    from components.gate import run_gate

    config = as_config(config)
    decision = run_gate(report, out_dir, policy=config["gate"]["policy"], validation=validation, drift=drift)
    _copy_summaries(out_dir, run_dir / "gate", ("gate.json",))
    return decision.decision


def bootstrap_gate(run_dir: Path) -> dict[str, Any]:
    """The gate record of the first model: nothing to be compatible with."""
    from datetime import UTC, datetime

    document = {
        "decision": "pass",
        "reasons": [BOOTSTRAP_REASON],
        "checks": [],
        "bootstrap": True,
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_json_atomic(run_dir / "gate" / "gate.json", document)
    return document


@step("register")
def register_stage(
    config: Config, run_dir: Path, phase: int, model_dir: str, *, bootstrap: bool = False
) -> dict:
    """Log the run to MLflow and register the model as the ``candidate`` version."""
    from components.registry import register_stage as register

    config = as_config(config)
    method = "bootstrap" if bootstrap else config["compat"]["method"]
    gate_path = run_dir / "gate" / "gate.json"
    gate = json.loads(gate_path.read_text()) if gate_path.is_file() else bootstrap_gate(run_dir)
    reports = [
        run_dir / s / f
        for s, f in (
            ("validate", "validation.json"),
            ("drift", "drift.json"),
            ("drift", "drift_report.html"),
            ("gate", "gate.json"),
        )
    ]
    metrics = run_dir / "continual" / "metrics.json"
    report = run_dir / "evaluate" / "compat_report.json"
    info = register(
        workspace_of(config),
        run_dir.name,
        _model_dir(model_dir),
        data_phase=phase,
        method=method,
        gate=gate,
        compat_report=report if report.is_file() else None,
        training_metrics=metrics if metrics.is_file() else None,
        reports=reports,
        params={
            "phase": phase,
            "method": method,
            "model_config": config["training"]["model_config"],
            "bootstrap": bootstrap,
        },
        model_name=config["registry"]["model_name"],
    )
    write_json_atomic(run_dir / "register" / "registered.json", info)
    return info


def report_stage(run_dir: Path) -> dict[str, str]:
    """The on-call report (HTML + Markdown) of the run, written whatever happened before."""
    from components.report import write_reports

    paths = write_reports(run_dir, run_dir / "report")
    return {fmt: str(path) for fmt, path in paths.items()}


def _checkpoint_dir(path: str) -> str:
    """A checkpoint directory from a directory or its ``model.json``."""
    candidate = Path(path)
    return str(candidate.parent if candidate.name == "model.json" else candidate)


def _model_dir(path: str) -> str:
    """The model directory inside a stage's model artifact (``<artifact>/model`` or the artifact itself)."""
    nested = Path(path) / "model"
    return str(nested if nested.is_dir() else _checkpoint_dir(path))


def _copy_summaries(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)
