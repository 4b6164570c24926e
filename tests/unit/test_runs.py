"""Run bookkeeping: the validated-shard store that later runs replay and compare against."""

import json
from pathlib import Path

import pytest
from _runs import _config, _finished_run, _shard

from components.deployment import Deployment
from components.runs import keep_validated, replay_shards, train_shards_of
from components.state.workspace import Workspace


def test_kept_shards_replace_the_raw_ones_and_a_rerun_replaces_the_copy(tmp_path):
    config = Deployment.coerce(_config(tmp_path))
    raw = train_shards_of(config, 0)
    assert [p.rsplit("/", 1)[1] for p in raw] == ["raw-0.tar", "raw-1.tar"]  # nothing kept yet

    accepted = [_shard(tmp_path / f"accepted-{i}.tar", ["x.txt"]) for i in range(3)]
    kept = keep_validated(config.workspace, 0, accepted)
    assert [p.rsplit("/", 1)[1] for p in kept] == ["accepted-0.tar", "accepted-1.tar", "accepted-2.tar"]
    assert train_shards_of(config, 0) == kept
    assert replay_shards(config, 2, per_phase=1) == [
        kept[:1],
        [str(tmp_path / "stream" / "p1" / "raw-0.tar")],
    ]
    assert replay_shards(config, 0) == []

    keep_validated(config.workspace, 0, accepted[:1])  # the phase validated again: only its new output
    assert [p.rsplit("/", 1)[1] for p in train_shards_of(config, 0)] == ["accepted-0.tar"]
    assert not any(
        p.name.startswith(".") for p in Workspace(config.workspace).validated_dir(0).parent.iterdir()
    )


def test_keep_validated_leaves_the_previous_copy_when_a_shard_is_missing(tmp_path):
    good = [_shard(tmp_path / "a.tar", ["x.txt"])]
    kept = keep_validated(tmp_path / "ws", 1, good)
    with pytest.raises(FileNotFoundError):
        keep_validated(tmp_path / "ws", 1, [tmp_path / "missing.tar"])
    assert sorted(str(p) for p in Workspace(tmp_path / "ws").validated_dir(1).glob("*.tar")) == kept


def test_state_file_errors_name_the_file_and_a_lost_state_is_refused(tmp_path):
    from components.runs import StateError, plan_run, read_state, rebuild_state

    config = {**_config(tmp_path), "drift": {"reference_phase": "previous"}}
    config["registry"] = {"tracking_uri": f"sqlite:///{tmp_path}/ws/mlflow.db"}
    ws = tmp_path / "ws"
    ws.mkdir()
    for text in ('{"schema_version": 1}', '{"schema_version": 1, "phases": {"0": {"stat'):
        (ws / "state.json").write_text(text)
        with pytest.raises(StateError, match=r"(?s)state\.json is unreadable or malformed.*state rebuild"):
            read_state(ws)
    (ws / "state.json").unlink()
    _finished_run(ws, "phase-00-a", 0, "succeeded")
    _finished_run(ws, "phase-01-a", 1, "failed")
    _finished_run(ws, "phase-01-b", 1, "rejected")
    with pytest.raises(StateError, match="missing but the workspace holds: finished runs"):
        plan_run(Deployment.coerce(config))
    (ws / "state.json").write_text('{"schema_version": 1, "phases": {}}')  # present, but emptied
    with pytest.raises(StateError, match=r"(?s)does not record what the workspace holds.*state rebuild"):
        plan_run(Deployment.coerce(config))
    (ws / "state.json").write_text(
        '{"schema_version": 1, "phases": {"0": {"status": "succeeded", "run_id": "phase-00-a", "at": "x"}}}'
    )
    with pytest.raises(StateError, match=r"finished runs in .* of phase\(s\) 1"):  # stale: phase 1 lost
        plan_run(Deployment.coerce(config))
    rebuilt = rebuild_state(ws)
    assert {k: v.status for k, v in rebuilt.phases.items()} == {"0": "succeeded", "1": "rejected"}
    assert read_state(ws) == rebuilt
    assert plan_run(Deployment.coerce(config)) is None  # both phases done: nothing pending


def test_the_next_run_of_a_phase_continues_its_killed_or_failed_run(tmp_path):
    from components.runs import plan_run, record_phase

    config = {**_config(tmp_path), "drift": {"reference_phase": "previous"}}
    config["registry"] = {"tracking_uri": f"sqlite:///{tmp_path}/ws/mlflow.db"}
    first = plan_run(Deployment.coerce(config)).model_dump()
    assert first["phase"] == 0 and not first["resumed"] and first["attempt"] == 1
    run_dir = tmp_path / "ws" / "runs" / first["run_id"]
    (run_dir / "pipeline.log").write_text("killed\n")  # no outcome.json: the run was killed
    again = plan_run(Deployment.coerce(config)).model_dump()
    assert again["run_id"] == first["run_id"] and again["resumed"] and again["attempt"] == 2
    assert (run_dir / "attempts" / "1" / "pipeline.log").read_text() == "killed\n"
    (run_dir / "outcome.json").write_text(json.dumps({"status": "failed"}))
    (run_dir / "failure.json").write_text("{}")
    record_phase(tmp_path / "ws", 0, "failed", first["run_id"])
    third = plan_run(Deployment.coerce(config)).model_dump()
    assert third["run_id"] == first["run_id"] and third["attempt"] == 3
    assert not (run_dir / "failure.json").exists() and (run_dir / "attempts" / "2" / "failure.json").is_file()
    (run_dir / "outcome.json").write_text(json.dumps({"status": "blocked"}))  # blocked: a new run
    assert plan_run(Deployment.coerce(config)).run_id != first["run_id"]


def test_training_budget_by_steps_or_epochs_warns_when_a_small_phase_repeats():
    from components.deployment import TrainingSection
    from components.report.inputs import RunInputs, Source
    from components.report.sections import build
    from components.steps import training_budget

    fixed = training_budget(TrainingSection(steps=300, batch_size=64, epochs=None), 289)
    assert fixed["steps"] == 300 and fixed["from"] == "steps" and fixed["epochs"] == 66.44
    assert "passes over this phase's 289 samples 66.44 times" in fixed["warning"]
    sized = training_budget(TrainingSection(steps=300, batch_size=64, epochs=5), 289)
    assert sized["steps"] == 23 and sized["from"] == "epochs" and sized["warning"] is None  # ceil(5*289/64)
    unknown = training_budget(TrainingSection(steps=300, batch_size=64, epochs=5), None)
    assert unknown["steps"] == 300 and unknown["warning"] is None  # no count: the steps budget

    inputs = RunInputs(Path("."), {name: Source(name) for name in ("validation", "drift", "compat_report")})
    inputs.sources.update(
        metrics=Source("metrics", data={"budget": fixed}),
        gate=Source("gate"),
        rollout=Source("rollout"),
        blocked=Source("blocked"),
        failure=Source("failure"),
    )
    training = next(s for s in build(inputs) if s.key == "training")
    assert training.status == "warning" and "memorise" in training.items[0].text


def test_a_run_dirs_files_are_where_existing_workspaces_keep_them(tmp_path):
    """RunDir names the paths runs have always written: a workspace from before it keeps working."""
    from components.state.run_dir import RunDir

    run = Workspace(tmp_path / "ws").run("phase-00-x")
    root = tmp_path / "ws" / "runs" / "phase-00-x"
    assert run == RunDir(root) == RunDir.coerce(str(root)) and run.run_id == "phase-00-x"
    assert {
        "plan": run.plan_file,
        "outcome": run.outcome_file,
        "failure": run.failure_file,
        "blocked": run.blocked_file,
        "log": run.pipeline_log,
        "usage": run.usage_file("gate"),
        "attempt": run.attempt_dir(2),
        "validation": run.validation_summary,
        "drift": run.drift_summary,
        "drift_html": run.drift_report,
        "metrics": run.continual_metrics,
        "train": run.training_dir,
        "compat_model": run.compat_model_dir,
        "compat_record": run.compat_record,
        "compat_report": run.compat_report,
        "gate": run.gate_file,
        "registered": run.registered_file,
        "ingest": run.ingest_summary,
        "rollout": run.rollout_summary,
        "rollout_state": run.rollout_state,
        "examples": run.examples_file,
        "report": run.report_file("md"),
    } == {
        key: root / rel
        for key, rel in {
            "plan": "run.json",
            "outcome": "outcome.json",
            "failure": "failure.json",
            "blocked": "blocked.json",
            "log": "pipeline.log",
            "usage": "usage/step-gate.json",
            "attempt": "attempts/2",
            "validation": "validate/validation.json",
            "drift": "drift/drift.json",
            "drift_html": "drift/drift_report.html",
            "metrics": "continual/metrics.json",
            "train": "continual/train",
            "compat_model": "compat/model",
            "compat_record": "compat/compat_model.json",
            "compat_report": "evaluate/compat_report.json",
            "gate": "gate/gate.json",
            "registered": "register/registered.json",
            "ingest": "ingest/ingest.json",
            "rollout": "rollout/rollout.json",
            "rollout_state": "rollout/rollout_state.json",
            "examples": "rollout/examples.json",
            "report": "report/report.md",
        }.items()
    }
    assert not root.exists()  # naming a path creates nothing
    with pytest.raises(ValueError, match="invalid run id"):
        Workspace(tmp_path / "ws").run("../elsewhere")


def test_run_parameters_override_their_config_field_and_are_checked_like_the_config():
    """The pipeline's run parameters (the KFP UI's per-run settings) set their field for one run; an empty one
    ("", 0, []) keeps the config's; a bad value is refused naming the field, before any step runs."""
    from components.deployment import ConfigError
    from components.runs import RUN_PARAMETERS, run_parameters, with_run_parameters

    config = Deployment()
    assert set(run_parameters(config)) == set(RUN_PARAMETERS)
    assert with_run_parameters(config, dict.fromkeys(RUN_PARAMETERS, "")) == config
    empty = {
        "training_method": "",
        "training_steps": 0,
        "compat_method": "",
        "compat_steps": 0,
        "rollout_fractions": [],
    }
    assert with_run_parameters(config, empty) == config
    run = with_run_parameters(
        config, {**empty, "training_steps": 600, "compat_method": "xbt", "rollout_fractions": [0.5, 1.0]}
    )
    assert (run.training.steps, run.compat.method, run.rollout.fractions) == (600, "xbt", [0.5, 1.0])
    assert (run.training.method, run.compat.steps) == (config.training.method, config.compat.steps)
    with pytest.raises(ConfigError, match="compat.method"):
        with_run_parameters(config, {"compat_method": "magic"})
