"""The KFP pipeline: compiled YAML is current, and a real kfp.local run goes through the stages."""

import json

import pytest
import yaml

from pipelines.compile import COMPILED_DIR, COMPILED_NAME, compile_pipeline


def test_compiled_pipeline_is_current(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPATFLOW_IMAGE", raising=False)
    fresh = compile_pipeline(tmp_path).read_text()
    committed = COMPILED_DIR / COMPILED_NAME
    assert committed.is_file(), "run `compatflow compile` and commit pipelines/compiled/"
    assert fresh == committed.read_text(), (
        "pipelines/compiled/continual_upgrade.yaml is stale: run `compatflow compile` and commit it"
    )


def test_compiled_pipeline_gates_downstream_stages():
    spec = next(yaml.safe_load_all((COMPILED_DIR / COMPILED_NAME).read_text()))  # then the platform spec
    dags = [spec["root"]["dag"]] + [c["dag"] for c in spec["components"].values() if "dag" in c]
    tasks = {task["taskInfo"]["name"]: task for dag in dags for task in dag["tasks"].values()}

    def guarded(branch: str, by: str) -> set[str]:
        """Names of the tasks inside the ``dsl.If`` branch, checking what its condition reads."""
        assert by in tasks[branch].get("triggerPolicy", {}).get("condition", ""), f"{by} must guard {branch}"
        inner = spec["components"][tasks[branch]["componentRef"]["name"]]["dag"]["tasks"].values()
        return {t["taskInfo"]["name"] for t in inner}

    assert {"drift-op", "continual-op", "first-model", "upgrade"} <= guarded("phase-valid", "validate-op-Output")
    assert guarded("gate-passed", "gate-op-Output") == {"rollout-op"}
    assert guarded("gate-blocked", "gate-op-Output") == {"note-blocked-op-2"}
    assert guarded("first-model", "resolve-production-op-Output") == {"register-op", "serve-first-model-op"}


def _local_config(tmp_path, phases=2):
    from pipelines.config import CONFIG_DIR

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(tmp_path / "ws" / "stream"), phases=phases, samples_per_phase=160,
                            eval_per_domain=20, gallery_per_domain=40)
    config["drift"]["sample_size"] = 80
    config["training"].update(steps=6, batch_size=16)
    config["compat"].update(steps=6, batch_size=16)
    return config


@pytest.mark.slow
def test_local_run_goes_through_the_stages_and_continues(tmp_path, capsys):
    import io

    from components.runs import read_state
    from pipelines.local_runner import run_local

    config = _local_config(tmp_path)
    first = run_local(config, echo=io.StringIO())
    assert first.status == "succeeded", (first.run_dir / "pipeline.log").read_text()[-3000:]
    assert first.phase == 0
    validation = json.loads((first.run_dir / "validate" / "validation.json").read_text())
    assert validation["passed"] + validation["quarantined"] == validation["total"] > 0
    assert (first.run_dir / "drift" / "drift.json").is_file()

    second = run_local(config, echo=io.StringIO())
    assert second.status == "succeeded" and second.phase == 1
    state = read_state(tmp_path / "ws")
    assert {k: v["status"] for k, v in state["phases"].items()} == {"0": "succeeded", "1": "succeeded"}
    third = run_local(config, echo=io.StringIO())
    assert third.status == "nothing-to-do"


@pytest.mark.slow
def test_blocked_phase_stops_the_run(tmp_path):
    import io
    import tarfile

    from pipelines.local_runner import ensure_stream, run_local

    config = _local_config(tmp_path, phases=1)
    stream_dir = ensure_stream(config)
    shard = next((stream_dir / "phase-00" / "train").glob("*.tar"))
    with tarfile.open(shard, "a") as tar:  # ten samples whose captions are blank
        for i in range(20):
            data = b"   "
            info = tarfile.TarInfo(f"bad-{i:03d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = run_local(config, echo=io.StringIO())
    assert result.status == "blocked"
    assert json.loads((result.run_dir / "blocked.json").read_text())["stage"] == "validate"
    assert not (result.run_dir / "drift").exists()
