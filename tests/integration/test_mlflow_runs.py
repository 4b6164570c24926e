"""A phase's MLflow run as its users read it, on the embedded sqlite registry: it carries the training and
compatibility settings as parameters, and it ends FINISHED, FAILED or KILLED with the phase (the exit
handler's ``finish_step``), never left RUNNING."""

from __future__ import annotations

import pytest


@pytest.fixture
def deployment(tmp_path):
    from pipelines.config import load_config, resolve

    return resolve(
        load_config("local").with_changes(
            workspace=str(tmp_path / "ws"),
            training={"lr": 0.001, "alpha": 2.0, "steps": 7, "batch_size": 16, "replay_rows": 8},
            compat={"method": "bct", "steps": 5, "options": {"synthesize_unmatched": False}},
        )
    )


def _phase(deployment, run_id: str, records: int = 1):
    """A run whose training step logged its curve (which starts the phase's MLflow run)."""
    from components.state.workspace import Workspace
    from components.steps.base import live_metrics

    run_dir = Workspace.of(deployment).run_dir(run_id)
    run_dir.mkdir(parents=True)
    with live_metrics(deployment, run_dir, "train.") as live:
        for step in range(records):
            live({"step": step, "loss": 1.0 / (step + 1)})
    return run_dir


def test_the_run_carries_the_settings_and_ends_with_the_phase(deployment, tmp_path, monkeypatch):
    from components.steps.base import registry_of
    from components.steps.outcome import finish_step

    registry = registry_of(deployment)
    _phase(deployment, "phase-00-ok")
    run = registry.client.get_run(registry.find_run("phase-00-ok"))
    assert run.info.status == "RUNNING"
    params = run.data.params
    assert params["training.lr"] == "0.001" and params["training.alpha"] == "2.0"
    assert params["training.steps"] == "7" and params["training.batch_size"] == "16"
    assert params["training.model_config"] == "cf-tiny" and params["training.method"] == "modx"
    assert params["compat.method"] == "bct" and params["compat.steps"] == "5"
    assert params["compat.options.synthesize_unmatched"] == "False"

    outcome = finish_step(deployment.to_json(), "phase-00-ok", "SUCCEEDED", "", tmp_path / "ok.html")
    assert outcome.status == "succeeded"
    assert registry.client.get_run(run.info.run_id).info.status == "FINISHED"

    _phase(deployment, "phase-01-failed")
    outcome = finish_step(deployment.to_json(), "phase-01-failed", "FAILED", "boom", tmp_path / "f.html")
    assert outcome.status == "failed"
    assert registry.client.get_run(registry.find_run("phase-01-failed")).info.status == "FAILED"

    _phase(deployment, "phase-02-cancelled")  # on a cluster whose ConfigMap names the KFP UI
    monkeypatch.setenv("COMPATFLOW_KFP_UI_URL", "https://kubeflow.example.com/pipeline/")
    outcome = finish_step(
        deployment.to_json(), "phase-02-cancelled", "CANCELED", "", tmp_path / "c.html", "", "k-9"
    )
    assert registry.client.get_run(registry.find_run("phase-02-cancelled")).info.status == "KILLED"
    assert outcome.kfp_run_url == "https://kubeflow.example.com/pipeline/#/runs/details/k-9"
    assert (
        '<a href="https://kubeflow.example.com/pipeline/#/runs/details/k-9">KFP run</a>'
        in (tmp_path / "c.html").read_text()
    )
    monkeypatch.delenv("COMPATFLOW_KFP_UI_URL")

    # A run resumed under the same id is RUNNING again until it ends; a run that logged nothing has no
    # MLflow run to end, and ending it creates none.
    registry.start_run("phase-01-failed")
    assert registry.client.get_run(registry.find_run("phase-01-failed")).info.status == "RUNNING"
    finish_step(deployment.to_json(), "phase-01-failed", "SUCCEEDED", "", tmp_path / "r.html")
    assert registry.client.get_run(registry.find_run("phase-01-failed")).info.status == "FINISHED"
    finish_step(deployment.to_json(), "phase-03-nothing", "SUCCEEDED", "", tmp_path / "n.html")
    assert registry.find_run("phase-03-nothing") is None
    with pytest.raises(ValueError, match="FINISHED / FAILED / KILLED"):
        registry.end_pipeline_run("phase-00-ok", "DONE")
