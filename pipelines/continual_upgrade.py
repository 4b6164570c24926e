"""The continual-upgrade pipeline (KFP v2).

One run takes the next data phase through every stage::

    production? -> validate -> drift -> continual (Mod-X)
        first run:  register -> index the gallery -> production
        upgrades:   compat -> evaluate -> gate -> register -> [pass] rollout -> production

Validation and the gate are ``dsl.If`` conditions: nothing downstream runs when the phase is
blocked or the candidate fails the gate. An exit handler writes the on-call report whatever
happened. The same definition runs locally through ``kfp.local.SubprocessRunner``
(:mod:`pipelines.local_runner`) and on a cluster from the compiled YAML (``compatflow compile``).
"""

from kfp import dsl

from components import kfp_ops

PIPELINE_NAME = "compatflow-continual-upgrade"


@dsl.pipeline(
    name=PIPELINE_NAME,
    description="Validate, train, make compatible, gate, register and roll out the next data phase.",
)
def continual_upgrade(config: str, phase: int = -1, run_id: str = "") -> None:
    """``config``: the resolved config as JSON; ``phase`` -1: the next pending one; ``run_id`` "": the KFP job name."""
    finish = kfp_ops.finish_op(config=config, run_id=run_id, job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER)
    with dsl.ExitHandler(finish, name="record-and-report"):
        plan = kfp_ops.plan_op(
            config=config, phase=phase, run_id=run_id, job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER
        )
        run_dir, phase = plan.outputs["run_dir"], plan.outputs["phase"]
        stream_dir, train_shards = plan.outputs["stream_dir"], plan.outputs["train_shards"]
        reference_shards, eval_shards = plan.outputs["reference_shards"], plan.outputs["eval_shards"]
        production = kfp_ops.resolve_production_op(config=config).after(plan)
        validation = kfp_ops.validate_op(config=config, shards=train_shards, run_dir=run_dir)
        with dsl.If(validation.outputs["Output"] == True, name="phase-blocked"):  # noqa: E712 (KFP condition)
            kfp_ops.note_blocked_op(
                run_dir=run_dir, stage="validate", reason="data validation blocked the phase"
            )
        with dsl.If(validation.outputs["Output"] == False, name="phase-valid"):  # noqa: E712
            drift = kfp_ops.drift_op(
                config=config,
                run_dir=run_dir,
                reference_shards=reference_shards,
                current=validation.outputs["accepted"],
                production=production.output,
            )
            continual = kfp_ops.continual_op(
                config=config,
                run_dir=run_dir,
                phase=phase,
                stream_dir=stream_dir,
                accepted=validation.outputs["accepted"],
                production=production.output,
            ).after(drift)
            with dsl.If(production.output == "", name="first-model"):
                kfp_ops.register_op(
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    model=continual.outputs["candidate"],
                    bootstrap=True,
                )
            with dsl.If(production.output != "", name="upgrade"):
                compatible = kfp_ops.compat_op(
                    config=config,
                    run_dir=run_dir,
                    candidate=continual.outputs["candidate"],
                    production=production.output,
                    accepted=validation.outputs["accepted"],
                )
                evaluation = kfp_ops.evaluate_op(
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    production=production.output,
                    compat_model=compatible.outputs["compat_model"],
                    eval_shards=eval_shards,
                )
                gate = kfp_ops.gate_op(
                    config=config,
                    run_dir=run_dir,
                    report=evaluation.outputs["report"],
                    validation=validation.outputs["summary"],
                    drift=drift.outputs["summary"],
                )
                kfp_ops.register_op(
                    config=config,
                    run_dir=run_dir,
                    phase=phase,
                    model=compatible.outputs["compat_model"],
                    bootstrap=False,
                ).after(gate)
                with dsl.If(gate.outputs["Output"] == "block", name="gate-blocked"):
                    kfp_ops.note_blocked_op(
                        run_dir=run_dir, stage="gate", reason="the release gate blocked the candidate"
                    )
