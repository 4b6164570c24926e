"""Run state against the MLflow registry: an emptied state over a production model is refused."""

import numpy as np
import pytest
from _runs import _config, _finished_run

from components.deployment import Deployment


def test_an_emptied_state_over_a_production_model_is_refused(tmp_path):
    """``{"schema_version": 1, "phases": {}}`` while the registry serves a production model and no run
    folder is left: refused like a missing state.json, not phase 0 again."""
    from safetensors.numpy import save_file

    from components.adapters.registry import Registry
    from components.runs import StateError, plan_run

    config = {**_config(tmp_path), "drift": {"reference_phase": "previous"}}
    config["registry"] = {"tracking_uri": f"sqlite:///{tmp_path}/ws/mlflow.db", "model_name": "clip-state"}
    registry = Registry(
        tmp_path / "ws", tracking_uri=config["registry"]["tracking_uri"], model_name="clip-state"
    )
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(model / "model.safetensors"))
    run_id = registry.start_run("phase-00-x")
    version = registry.register_candidate(
        run_id, model, data_phase=0, method="bootstrap", gate={"decision": "pass"}
    )
    registry.promote(version["version"], rollout=None)
    (tmp_path / "ws" / "state.json").write_text('{"schema_version": 1, "phases": {}}')
    with pytest.raises(StateError, match=r"records no phase but .* serves production version 1.*rebuild"):
        plan_run(Deployment.coerce(config))
    _finished_run(
        tmp_path / "ws", "phase-00-x", 0, None
    )  # killed before its outcome: the next run resumes it
    assert plan_run(Deployment.coerce(config)).run_id == "phase-00-x"
