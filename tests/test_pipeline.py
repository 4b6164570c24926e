"""The KFP pipeline: compiled YAML is current, and a real kfp.local run goes through the stages."""

import json
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

    def guarded(branch: str, by: str) -> set[str]:
        """Names of the tasks inside the ``dsl.If`` branch, checking what its condition reads."""
        assert by in tasks[branch].get("triggerPolicy", {}).get("condition", ""), f"{by} must guard {branch}"
        inner = spec["components"][tasks[branch]["componentRef"]["name"]]["dag"]["tasks"].values()
        return {t["taskInfo"]["name"] for t in inner}

    assert {"drift-op", "continual-op", "first-model", "upgrade"} <= guarded(
        "phase-valid", "validate-op-Output"
    )
    assert guarded("gate-passed", "gate-op-Output") == {"rollout-op"}
    assert "ingest-op" in guarded("upgrade", "resolve-production-op-Output")
    assert guarded("gate-blocked", "gate-op-Output") == {"note-blocked-op-2"}
    assert guarded("first-model", "resolve-production-op-Output") == {"register-op", "serve-first-model-op"}


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
def test_local_run_serves_rejects_rolls_out_and_continues(tmp_path):
    """Phase 0 is indexed and served; a gate block leaves production and the gallery alone and the next
    run moves on; a gate pass indexes the new gallery items, rolls the candidate out (staged backfill)
    and promotes it."""
    import io

    from components.index import gallery_status
    from components.lineage import LineageStore
    from components.registry import Registry
    from components.runs import read_state
    from pipelines.config import resolve
    from pipelines.local_runner import run_local

    config = resolve(_local_config(tmp_path, phases=3))
    registry = Registry(config["workspace"], tracking_uri=config["registry"]["tracking_uri"])
    lineage = LineageStore(config["lineage"]["repo"])

    def gallery() -> dict:
        return gallery_status(config["index"]["uri"], config["index"]["alias"])

    first = run_local(config, echo=io.StringIO())
    assert first.status == "succeeded", (first.run_dir / "pipeline.log").read_text()[-3000:]
    assert first.phase == 0
    validation = json.loads((first.run_dir / "validate" / "validation.json").read_text())
    assert validation["passed"] + validation["quarantined"] == validation["total"] > 0
    assert (first.run_dir / "drift" / "drift.json").is_file()
    assert registry.alias_version("production") == "1"
    assert gallery()["by_version"] == {"1": 40}
    assert lineage.version_counts() == {"1": 40}

    # A 6-step candidate on 40 evaluation images: the shipped policy must refuse it.
    rejected = run_local(config, echo=io.StringIO())
    assert rejected.status == "rejected" and rejected.phase == 1
    gate = json.loads((rejected.run_dir / "gate" / "gate.json").read_text())
    assert gate["decision"] == "block" and "eval_set_too_small" in {r["code"] for r in gate["reasons"]}
    assert json.loads((rejected.run_dir / "blocked.json").read_text())["stage"] == "gate"
    assert not (rejected.run_dir / "rollout").exists()
    assert registry.alias_version("production") == "1" and registry.alias_version("candidate") == "2"
    # The phase's new gallery items are served (by production) although its candidate was refused.
    assert gallery()["by_version"] == {"1": 80}
    assert lineage.version_counts() == {"1": 80}
    assert json.loads((rejected.run_dir / "ingest" / "ingest.json").read_text())["n_new"] == 40
    # Compatibility training saw the phase and a validated shard of phase 0 (kept by phase 0's run).
    compat_model = json.loads((rejected.run_dir / "compat" / "compat_model.json").read_text())
    assert [Path(s).parent.name for s in compat_model["replay_shards"]] == ["phase-000"]
    assert all(Path(s).is_file() for s in compat_model["replay_shards"])

    # The production model's weights as an independent candidate (lr ~ 0, method "none"): it declares its
    # own embedding space, so the rollout goes blue-green (fill a new collection, probe, move the alias).
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["gate"]["policy"] = str(policy)
    config["training"]["lr"] = 1e-12
    config["compat"].update(method="none", options={})
    passed = run_local(config, echo=io.StringIO())
    assert passed.status == "succeeded" and passed.phase == 2, (passed.run_dir / "pipeline.log").read_text()[
        -3000:
    ]
    assert json.loads((passed.run_dir / "ingest" / "ingest.json").read_text())["n_new"] == 40
    rollout = json.loads((passed.run_dir / "rollout" / "rollout.json").read_text())
    assert rollout["rollout"]["state"] == "completed" and rollout["promoted"]
    assert rollout["rollout"]["mode"] == "blue_green"
    before, after = (
        rollout["rollout"]["gallery"]["source_collection"],
        rollout["rollout"]["gallery"]["collection"],
    )
    assert gallery()["collection"] == after != before
    assert registry.alias_version("production") == "3" and registry.alias_version("previous") == "1"
    assert gallery()["by_version"] == {"3": 120}  # phase 0 backfilled, phases 1 and 2 added then backfilled
    assert lineage.version_counts() == {"3": 120}

    # On-call undoes it: production, the serving alias and the lineage go back to version 1.
    registry.rollback()
    assert registry.alias_version("production") == "1"
    assert gallery()["collection"] == before and gallery()["by_version"] == {"1": 120}
    assert lineage.version_counts() == {"1": 120}

    state = read_state(tmp_path / "ws")
    statuses = {k: v["status"] for k, v in state["phases"].items()}
    assert statuses == {"0": "succeeded", "1": "rejected", "2": "succeeded"}
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
    assert json.loads((result.run_dir / "blocked.json").read_text())["stage"] == "validate"
    assert not (result.run_dir / "drift").exists()
