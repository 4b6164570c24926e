"""The KFP pipeline: compiled YAML is current, and a real kfp.local run goes through the stages."""

import json
import shutil
from pathlib import Path

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

    def inner(component: str) -> set[str]:
        """Names of the tasks in a branch's DAG, through the groups an If/Else pair compiles to."""
        names = set()
        for task in spec["components"][component]["dag"]["tasks"].values():
            name = task["taskInfo"]["name"]
            names |= inner(task["componentRef"]["name"]) if name.startswith("condition-branches-") else {name}
        return names

    def guarded(branch: str, by: str, otherwise: bool = False) -> set[str]:
        """Names of the tasks inside the ``dsl.If`` (``otherwise``: ``dsl.Else``) branch, checking what
        its condition reads."""
        condition = tasks[branch].get("triggerPolicy", {}).get("condition", "")
        assert by in condition and condition.startswith("!(") == otherwise, f"{by} must guard {branch}"
        return inner(tasks[branch]["componentRef"]["name"])

    assert {"drift-op", "continual-op", "first-model", "upgrade"} <= guarded(
        "phase-valid", "validate-op-Output", otherwise=True
    )
    assert guarded("gate-passed", "gate-op-Output") == {"rollout-op"}
    assert "ingest-op" in guarded("upgrade", "resolve-production-op-Output", otherwise=True)
    assert guarded("gate-blocked", "gate-op-Output", otherwise=True) == {"note-blocked-op-2"}
    assert guarded("first-model", "resolve-production-op-Output") == {"register-op", "serve-first-model-op"}
    assert guarded("phase-blocked", "validate-op-Output") == {"note-blocked-op"}


def test_local_runner_takes_the_else_branch(tmp_path):
    """kfp.local runs exactly one branch of a ``dsl.If``/``dsl.Else`` pair (the pipeline's three pairs)."""
    from kfp import dsl, local

    @dsl.component
    def verdict(passes: bool) -> str:
        return "pass" if passes else "block"

    @dsl.component
    def mark(path: str, name: str) -> None:
        import pathlib

        pathlib.Path(path, name).write_text(name)

    @dsl.pipeline
    def branches(path: str, passes: bool):
        decision = verdict(passes=passes)
        with dsl.If(decision.output == "pass", name="gate-passed"):
            mark(path=path, name="passed")
        with dsl.Else(name="gate-blocked"):
            mark(path=path, name="blocked")

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    for passes, taken in ((True, "passed"), (False, "blocked")):
        out = tmp_path / taken
        out.mkdir()
        branches(path=str(out), passes=passes)
        assert [p.name for p in out.iterdir()] == [taken]


def _local_config(tmp_path, phases=2):
    from pipelines.config import CONFIG_DIR

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(
        uri=str(tmp_path / "ws" / "stream"),
        phases=phases,
        samples_per_phase=160,
        eval_per_domain=20,
        gallery_per_domain=40,
    )
    config["drift"]["sample_size"] = 80
    config["training"].update(steps=6, batch_size=16, replay_buffer_size=40, replay_rows=4)
    config["compat"].update(steps=6, batch_size=16)
    return config


# Clears any candidate: for checking what runs after a pass, not the gate's judgement (tests/test_gate.py).
PERMISSIVE_POLICY = """
min_margin: -100.0
require_ci_lower_above_zero: false
min_eval_images: 1
min_eval_captions: 1
retention: {floor: 0.0}
"""


@pytest.mark.slow
@pytest.mark.timeout(2400)  # seven pipeline runs
def test_weekly_cycle_serves_rejects_ships_twice_halts_and_continues(tmp_path):
    """Five runs on one workspace, as a weekly schedule lives them. Phase 0 is indexed and served; a gate
    block leaves production and the gallery alone and the next run moves on; a blue-green upgrade ships;
    a BCT upgrade ships on top of it (the shipped compat model is the next run's production: drift, Mod-X
    teacher and init, old side of compat training); a rollout whose probes fall below the floors halts and
    is rolled back whole. Every run ends succeeded or rejected, the gallery holds one vector per item,
    search answers through the alias and lineage follows the index after every run."""
    import io

    from components.index import gallery_status
    from components.lineage import LineageStore
    from components.registry import Registry
    from components.runs import read_state
    from components.search import search
    from pipelines.config import resolve
    from pipelines.local_runner import run_local

    config = resolve(_local_config(tmp_path, phases=5)).to_dict()
    registry = Registry(config["workspace"], tracking_uri=config["registry"]["tracking_uri"])
    lineage = LineageStore(config["lineage"]["repo"])

    def gallery() -> dict:
        return gallery_status(config["index"]["uri"], config["index"]["alias"])

    def run(expected: str, phase: int):
        result = run_local(config, echo=io.StringIO())
        log = (result.run_dir / "pipeline.log").read_text()[-3000:]
        assert (result.status, result.phase) == (expected, phase), log
        served = gallery()["by_version"]
        assert sum(served.values()) == 40 * (phase + 1) == gallery()["count"]  # one vector per item
        assert lineage.version_counts() == served
        (hits,) = search(["a small red circle"], k=5, workspace=config["workspace"])
        assert len(hits) == 5 and {h["model_version"] for h in hits} <= set(served)
        return result

    first = run("succeeded", 0)
    validation = json.loads((first.run_dir / "validate" / "validation.json").read_text())
    assert validation["passed"] + validation["quarantined"] == validation["total"] > 0
    assert (first.run_dir / "drift" / "drift.json").is_file()
    assert registry.alias_version("production") == "1"
    assert gallery()["by_version"] == {"1": 40}

    # A 6-step candidate on 40 evaluation images: the shipped policy must refuse it.
    rejected = run("rejected", 1)
    gate = json.loads((rejected.run_dir / "gate" / "gate.json").read_text())
    assert gate["decision"] == "block" and "eval_set_too_small" in {r["code"] for r in gate["reasons"]}
    assert json.loads((rejected.run_dir / "blocked.json").read_text())["step"] == "gate"
    assert not (rejected.run_dir / "rollout").exists()
    assert registry.alias_version("production") == "1" and registry.alias_version("candidate") == "2"
    # The phase's new gallery items are served (by production) although its candidate was refused.
    assert gallery()["by_version"] == {"1": 80}
    assert json.loads((rejected.run_dir / "ingest" / "ingest.json").read_text())["n_new"] == 40
    # Compatibility training saw the phase and a validated shard of phase 0 (kept by phase 0's run).
    compat_model = json.loads((rejected.run_dir / "compat" / "compat_model.json").read_text())
    assert [Path(s).parent.name for s in compat_model["replay_shards"]] == ["phase-000"]
    assert all(Path(s).is_file() for s in compat_model["replay_shards"])

    # The production model's weights as an independent candidate (lr below float32 resolution, method
    # "none"): it declares its own embedding space, so the rollout goes blue-green (fill a new collection,
    # probe, move the alias).
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["gate"]["policy"] = str(policy)
    config["training"]["lr"] = 1e-12
    config["compat"].update(method="none", options={})
    blue_green = run("succeeded", 2)
    rollout = json.loads((blue_green.run_dir / "rollout" / "rollout.json").read_text())
    assert rollout["rollout"]["state"] == "completed" and rollout["promoted"]
    assert rollout["rollout"]["mode"] == "blue_green"
    before = rollout["rollout"]["gallery"]["source_collection"]
    assert gallery()["collection"] == rollout["rollout"]["gallery"]["collection"] != before
    assert registry.alias_version("production") == "3" and registry.alias_version("previous") == "1"
    assert gallery()["by_version"] == {"3": 120}  # phase 0 backfilled, phases 1 and 2 added then backfilled

    # A BCT upgrade on top of the shipped compat model: staged rollout in the space it keeps.
    config["compat"].update(method="bct", options={"lr": 1e-12})
    staged = run("succeeded", 3)
    rollout = json.loads((staged.run_dir / "rollout" / "rollout.json").read_text())
    assert rollout["rollout"]["mode"] == "staged" and rollout["promoted"]
    metrics = json.loads((staged.run_dir / "continual" / "metrics.json").read_text())
    assert metrics["production"]["version"] == blue_green.run_id and metrics["production"]["method"] == "none"
    drift = json.loads((staged.run_dir / "drift" / "drift.json").read_text())
    assert drift["production_model"].endswith("v3")
    assert registry.alias_version("production") == "4" and registry.alias_version("previous") == "3"
    assert gallery()["by_version"] == {"4": 160}

    # A damaged production copy: the run fails at the step that reads it and says so in outcome.json, the
    # report and the CLI. Following the advice (delete the copy: it is downloaded again) the schedule goes on.
    copy = Path(config["workspace"]) / "models" / "v4"
    with open(copy / "new" / "model.safetensors", "ab") as fh:
        fh.write(b"\0")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    from typer.testing import CliRunner

    from pipelines.cli import app

    cli = CliRunner().invoke(app, ["run", "--config", str(config_file)])
    assert cli.exit_code == 1, cli.output
    assert "phase 4 failed" in cli.output and "failed step: resolve-production" in cli.output
    assert (
        "CheckpointIntegrityError: checkpoint" in cli.output and "delete the named model folder" in cli.output
    )
    failed_dir = Path(next(line.split()[-1] for line in cli.output.splitlines() if "outputs:" in line))
    outcome = json.loads((failed_dir / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["failed_step"] == "resolve-production"
    assert outcome["error"]["type"] == "CheckpointIntegrityError" and outcome["log_line"] > 0
    log_lines = (failed_dir / "pipeline.log").read_text().splitlines()
    assert "CheckpointIntegrityError" in log_lines[outcome["log_line"] - 1]
    report = (failed_dir / "report" / "report.md").read_text()
    assert report.index("Step resolve-production failed: CheckpointIntegrityError") < report.index(
        "Release gate"
    )
    assert "did not run: step resolve-production failed before it" in report
    assert read_state(tmp_path / "ws")["phases"]["4"]["status"] == "failed"
    status = CliRunner().invoke(app, ["status", "--workspace", config["workspace"]])
    assert "checksum    FAILED" in status.output and f"delete {copy}" in status.output
    assert (
        "    4  failed" in status.output
        and "step resolve-production: CheckpointIntegrityError" in status.output
    )
    shutil.rmtree(copy)

    # Probe floors no model reaches: the rollout halts at its first stage and is rolled back whole.
    config["rollout"]["floors"] = {"R@1": 100.0}
    halted = run("rejected", 4)
    rollout = json.loads((halted.run_dir / "rollout" / "rollout.json").read_text())
    assert rollout["rollout"]["state"] == "rolled_back" and not rollout["promoted"]
    assert rollout["rollout"]["rollback"]["from_state"] == "halted"
    assert "rolled back" in json.loads((halted.run_dir / "blocked.json").read_text())["reason"]
    serving = json.loads((Path(config["workspace"]) / "serving.json").read_text())
    assert serving["query_model"]["version"] == "4" and registry.alias_version("production") == "4"
    assert gallery()["by_version"] == {"4": 200}  # phase 4's items ingested by production, nothing else

    state = read_state(tmp_path / "ws")
    statuses = {k: v["status"] for k, v in state["phases"].items()}
    assert statuses == {
        "0": "succeeded",
        "1": "rejected",
        "2": "succeeded",
        "3": "succeeded",
        "4": "rejected",
    }
    assert run_local(config, echo=io.StringIO()).status == "nothing-to-do"


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
    assert json.loads((result.run_dir / "blocked.json").read_text())["step"] == "validate"
    assert not (result.run_dir / "drift").exists()
