"""The continual-upgrade pipeline (KFP v2).

One run takes the next data phase through every step::

    plan -> production? -> validate -> drift -> continual (Mod-X)
        first run:  register -> serve (index the gallery, lineage, production)
        upgrades:   compat -> evaluate -> gate -> register -> [pass] rollout (staged backfill,
                    lineage, production)

Validation and the gate are ``dsl.If``/``dsl.Else`` pairs: nothing downstream runs when the phase is
blocked or the candidate fails the gate (the candidate is still registered, tagged with the gate's
decision, so on-call can see what was refused). An exit handler writes the on-call report whatever
happened. The same definition runs locally (:mod:`pipelines.local_runner`) and on a cluster.
"""

from collections.abc import Mapping
from typing import Any

from kfp import dsl

from components import kfp_ops

PIPELINE_NAME = "compatflow-continual-upgrade"
PIPELINE_DESCRIPTION = "Validate, train, make compatible, gate, register and roll out the next data phase."


def _task(op: Any, **inputs: Any) -> dsl.PipelineTask:
    """Call ``op`` and apply its step's task settings (see :func:`pipelines.resources.configure`)."""
    from pipelines import resources

    return resources.configure(op(**inputs), op.name.replace("-", "_"), resources.compile_settings())


def _rollout(step: Any, version: Any, ingest: dsl.PipelineTask) -> None:
    """The rollout after a gate pass. With ``rollout.workers`` > 1, each backfill stage's rank ranges run as
    parallel GPU tasks between ``rollout_ranges_op`` calls (each probes the stage before and returns the
    next stage's ranges); ``rollout_op`` then finishes (and runs any stage a run-time config adds)."""
    from pipelines import resources

    rollout = getattr(resources.compile_settings().get("config"), "rollout", None)
    after = ingest
    if rollout is not None and rollout.workers > 1:
        after = step(kfp_ops.rollout_ranges_op, version=version).after(ingest)
        for stage in range(1, len(rollout.fractions) + 1):
            with dsl.ParallelFor(
                after.output, parallelism=rollout.workers, name=f"backfill-stage-{stage}"
            ) as rank:
                written = step(kfp_ops.rollout_range_op, rank_range=rank)
            after = step(kfp_ops.rollout_ranges_op, version=version, written=dsl.Collected(written.output))
    step(kfp_ops.rollout_op, version=version).after(after)


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
    """The pipeline's graph. ``config``: the resolved config as JSON; ``phase`` -1: the next pending one;
    ``run_id`` "": the KFP job name; the rest (:data:`components.runs.RUN_PARAMETERS`) override their
    config field for this run ("", 0, []: the config's)."""
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
        run_dir, phase = plan.outputs["run_dir"], plan.outputs["phase"]

        def step(op: Any, **inputs: Any) -> dsl.PipelineTask:
            """``op`` on the run's config (the plan's: the run parameters set) in its run folder."""
            return _task(op, config=plan.outputs["config"], run_dir=run_dir, **inputs)

        def blocked(at: str, reason: str) -> None:
            _task(kfp_ops.note_blocked_op, run_dir=run_dir, step=at, reason=reason)

        production = step(kfp_ops.resolve_production_op)
        validation = step(kfp_ops.validate_op, phase=phase, shards=plan.outputs["train_shards"])
        with dsl.If(validation.outputs["Output"] == True, name="phase-blocked"):  # noqa: E712 (KFP condition)
            blocked("validate", "data validation blocked the phase")
        with dsl.Else(name="phase-valid"):
            _train_and_ship(step, blocked, plan.outputs, production.output, validation.outputs)


def _train_and_ship(
    step: Any, blocked: Any, plan: Mapping[str, Any], production: Any, validation: Mapping[str, Any]
) -> None:
    """A valid phase: drift and continual training, then the first model served, or an upgrade made
    compatible, evaluated, gated, registered and (on a pass) rolled out; ``production`` "": none yet."""
    phase, accepted = plan["phase"], validation["accepted"]
    drift = step(
        kfp_ops.drift_op, reference_shards=plan["reference_shards"], current=accepted, production=production
    )
    continual = step(
        kfp_ops.continual_op,
        phase=phase,
        stream_dir=plan["stream_dir"],
        accepted=accepted,
        production=production,
    ).after(drift)
    candidate = continual.outputs["candidate"]
    with dsl.If(production == "", name="first-model"):
        first = step(kfp_ops.register_op, phase=phase, model=candidate, bootstrap=True)
        step(kfp_ops.serve_first_model_op, version=first.output, gallery_shards=plan["gallery_shards"])
    with dsl.Else(name="upgrade"):
        ingest = step(kfp_ops.ingest_op, gallery_shards=plan["gallery_shards"])
        compatible = step(
            kfp_ops.compat_op, phase=phase, candidate=candidate, production=production, accepted=accepted
        )
        compat_model = compatible.outputs["compat_model"]
        evaluation = step(
            kfp_ops.evaluate_op,
            phase=phase,
            production=production,
            compat_model=compat_model,
            eval_shards=plan["eval_shards"],
        )
        gate = step(
            kfp_ops.gate_op,
            report=evaluation.outputs["report"],
            validation=validation["summary"],
            drift=drift.outputs["summary"],
        )
        registered = step(kfp_ops.register_op, phase=phase, model=compat_model, bootstrap=False).after(gate)
        with dsl.If(gate.outputs["Output"] == "pass", name="gate-passed"):
            _rollout(step, registered.output, ingest)
        with dsl.Else(name="gate-blocked"):  # anything but a pass is a block (fail-closed)
            blocked("gate", "the release gate blocked the candidate")
