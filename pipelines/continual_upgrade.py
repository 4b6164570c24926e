"""The continual-upgrade pipeline (KFP v2).

One run takes the next data phase through every step::

    plan -> production? -> validate -> drift -> continual (Mod-X)
        first run:  register -> serve (index the gallery, lineage, production)
        upgrades:   compat -> evaluate -> gate -> register -> [pass] rollout (staged backfill,
                    lineage, production)

Validation and the gate are ``dsl.If``/``dsl.Else`` pairs: nothing downstream runs when the phase is
blocked or the candidate fails the gate (the candidate is still registered, tagged with the
gate's decision and reasons, so on-call can see what was refused). An exit handler writes the
on-call report whatever happened. Every task gets the resources, scheduling, retries and caching
of the config the pipeline is built under (:mod:`pipelines.resources`). The same definition runs
locally through ``kfp.local.SubprocessRunner`` (:mod:`pipelines.local_runner`) and on a cluster
from the compiled YAML (``compatflow compile``).
"""

from typing import Any

from kfp import dsl

from components import kfp_ops

PIPELINE_NAME = "compatflow-continual-upgrade"
PIPELINE_DESCRIPTION = "Validate, train, make compatible, gate, register and roll out the next data phase."


def _task(op: Any, **inputs: Any) -> dsl.PipelineTask:
    """Call ``op`` and apply its step's task settings (see :func:`pipelines.resources.configure`)."""
    from pipelines import resources

    return resources.configure(op(**inputs), op.name.replace("-", "_"), resources.compile_settings())


def _rollout(config: Any, run_dir: Any, version: Any, ingest: dsl.PipelineTask) -> None:
    """The rollout after a gate pass. With ``rollout.workers`` > 1 in the config compiled for, every backfill
    stage's rank ranges run as parallel GPU tasks (``dsl.ParallelFor``, parallelism = workers) between
    ``rollout_ranges_op`` calls (each probes the stage before, then returns the next stage's ranges);
    ``rollout_op`` then finishes the step (and runs, in local processes, any stage a run-time config adds)."""
    from pipelines import resources

    settings = resources.compile_settings().get("config")
    rollout = getattr(settings, "rollout", None)
    after = ingest
    if rollout is not None and rollout.workers > 1:
        ranges = _task(kfp_ops.rollout_ranges_op, config=config, run_dir=run_dir, version=version).after(
            ingest
        )
        for stage in range(1, len(rollout.fractions) + 1):
            with dsl.ParallelFor(
                ranges.output, parallelism=rollout.workers, name=f"backfill-stage-{stage}"
            ) as rank:
                written = _task(kfp_ops.rollout_range_op, config=config, run_dir=run_dir, rank_range=rank)
            ranges = _task(
                kfp_ops.rollout_ranges_op,
                config=config,
                run_dir=run_dir,
                version=version,
                written=dsl.Collected(written.output),
            )
        after = ranges
    _task(kfp_ops.rollout_op, config=config, run_dir=run_dir, version=version).after(after)


def continual_upgrade_steps(
    config: str,
    phase: int = -1,
    run_id: str = "",
    training_method: str = "",
    training_steps: int = 0,
    compat_method: str = "",
    compat_steps: int = 0,
    rollout_fractions: list = [],  # noqa: B006 (KFP reads the default)
) -> None:
    """The pipeline's graph: ``dsl.pipeline`` of this under a config's task settings is the pipeline
    (:func:`pipelines.compile.build_pipeline`). ``config``: the resolved config as JSON; ``phase`` -1: the
    next pending one; ``run_id`` "": the KFP job name; the rest (:data:`components.runs.RUN_PARAMETERS`)
    override their config field for this run ("", 0, []: the config's; a compiled package's defaults are
    the config's values, so the KFP UI shows and compares them per run)."""
    job_name = dsl.PIPELINE_JOB_NAME_PLACEHOLDER
    job_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER  # the KFP run's ID: the report links its page
    finish = _task(kfp_ops.finish_op, config=config, run_id=run_id, job_name=job_name, job_id=job_id)
    with dsl.ExitHandler(finish, name="record-and-report"):
        plan = _task(
            kfp_ops.plan_op,
            config=config,
            phase=phase,
            run_id=run_id,
            job_name=job_name,
            training_method=training_method,
            training_steps=training_steps,
            compat_method=compat_method,
            compat_steps=compat_steps,
            rollout_fractions=rollout_fractions,
        )
        config = plan.outputs["config"]  # the run's: every step below reads the parameters set
        run_dir, phase = plan.outputs["run_dir"], plan.outputs["phase"]
        gallery_shards = plan.outputs["gallery_shards"]
        production = _task(kfp_ops.resolve_production_op, config=config, run_dir=run_dir)
        validation = _task(
            kfp_ops.validate_op,
            config=config,
            phase=phase,
            shards=plan.outputs["train_shards"],
            run_dir=run_dir,
        )
        accepted = validation.outputs["accepted"]
        with dsl.If(validation.outputs["Output"] == True, name="phase-blocked"):  # noqa: E712 (KFP condition)
            _task(
                kfp_ops.note_blocked_op,
                run_dir=run_dir,
                step="validate",
                reason="data validation blocked the phase",
            )
        with dsl.Else(name="phase-valid"):
            drift = _task(
                kfp_ops.drift_op,
                config=config,
                run_dir=run_dir,
                reference_shards=plan.outputs["reference_shards"],
                current=accepted,
                production=production.output,
            )
            continual = _task(
                kfp_ops.continual_op,
                config=config,
                run_dir=run_dir,
                phase=phase,
                stream_dir=plan.outputs["stream_dir"],
                accepted=accepted,
                production=production.output,
            ).after(drift)
            with dsl.If(production.output == "", name="first-model"):
                first = _task(
                    kfp_ops.register_op,
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    model=continual.outputs["candidate"],
                    bootstrap=True,
                )
                _task(
                    kfp_ops.serve_first_model_op,
                    config=config,
                    run_dir=run_dir,
                    version=first.output,
                    gallery_shards=gallery_shards,
                )
            with dsl.Else(name="upgrade"):
                ingest = _task(
                    kfp_ops.ingest_op, config=config, run_dir=run_dir, gallery_shards=gallery_shards
                )
                compatible = _task(
                    kfp_ops.compat_op,
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    candidate=continual.outputs["candidate"],
                    production=production.output,
                    accepted=accepted,
                )
                evaluation = _task(
                    kfp_ops.evaluate_op,
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    production=production.output,
                    compat_model=compatible.outputs["compat_model"],
                    eval_shards=plan.outputs["eval_shards"],
                )
                gate = _task(
                    kfp_ops.gate_op,
                    config=config,
                    run_dir=run_dir,
                    report=evaluation.outputs["report"],
                    validation=validation.outputs["summary"],
                    drift=drift.outputs["summary"],
                )
                candidate = _task(
                    kfp_ops.register_op,
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    model=compatible.outputs["compat_model"],
                    bootstrap=False,
                ).after(gate)
                with dsl.If(gate.outputs["Output"] == "pass", name="gate-passed"):
                    _rollout(config, run_dir, candidate.output, ingest)
                with dsl.Else(name="gate-blocked"):  # anything but a pass is a block (fail-closed)
                    _task(
                        kfp_ops.note_blocked_op,
                        run_dir=run_dir,
                        step="gate",
                        reason="the release gate blocked the candidate",
                    )
