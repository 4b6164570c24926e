"""Upgrades on top of upgrades: every kind of promoted model is next week's production model.

For every compatibility method (and the foundation scenario) two upgrades ship in a row through the
pipeline's own step functions (:mod:`components.steps`), then drift, continual training and
compatibility training run against the result. A shipped model must load, serve, teach and be the old
side of the next upgrade whatever method produced it (:mod:`compat.production`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _lineage import version_counts
from _pipelines import Cycle, assert_serves, chain_config, served_gallery


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory, stream_dir) -> Path:
    """A workspace that served phase 0 (the first model, its gallery, lineage and probes), made once: how a
    workspace was bootstrapped does not depend on the compatibility method its upgrades will use."""
    root = tmp_path_factory.mktemp("bootstrapped")
    Cycle(chain_config(root, stream_dir, "bct")).bootstrap()
    return root / "ws"


def _cycle_from(
    bootstrapped: Path, tmp_path: Path, stream_dir: Path, method: str, scenario: str = "continual"
) -> tuple[dict, Cycle]:
    """A copy of the bootstrapped workspace in ``tmp_path`` (a workspace works wherever it is copied, see
    :func:`test_a_copied_workspace_works_where_it_is_and_leaves_the_original_alone`) and its cycle."""
    shutil.copytree(bootstrapped, tmp_path / "ws", symlinks=True)
    config = chain_config(tmp_path, stream_dir, method, scenario)
    return config, Cycle(config)


@pytest.mark.parametrize(
    "method,scenario",
    [
        ("bct", "continual"),
        ("lambda_orth", "continual"),
        ("bt2", "continual"),
        ("xbt", "continual"),
        ("taca", "continual"),
        ("none", "continual"),
        ("xbt", "foundation"),
    ],
)
def test_two_shipped_upgrades_then_a_third_trains(bootstrapped, tmp_path, stream_dir, method, scenario):
    from compat.production import load_production

    config, cycle = _cycle_from(bootstrapped, tmp_path, stream_dir, method, scenario)
    assert_serves(config, "1", 16)
    for phase, version in ((1, "2"), (2, "3")):
        summary = cycle.ship(phase)
        assert summary["promoted"], summary["rollout"].get("halt_reason")
        assert_serves(config, version, 16 * (phase + 1))
    production = load_production(Path(config["workspace"]) / "models" / "v3")
    assert production.method == method and production.version.startswith("run-2")
    # Drift, continual training and compatibility training all run against the twice-upgraded model.
    plan, run_dir, compat = cycle.train(3)
    drift = json.loads((run_dir / "drift" / "drift.json").read_text())
    assert drift["production_model"].endswith("v3") and "embeddings" in json.dumps(drift)
    metrics = json.loads((run_dir / "continual" / "metrics.json").read_text())
    assert metrics["production"]["version"] == production.version
    if scenario == "continual":
        assert metrics["training"]["steps"] == 3 and metrics["start_domains"]
    sources = json.loads((Path(compat) / "compat.json").read_text())["training"]["sources"]
    assert sources["old"].endswith("v3")
    # Compatibility training was logged to the run's MLflow run step by step as it trained.
    from components import steps

    registry = steps.registry_of(config)
    run_id = registry.start_run(run_dir.name)
    logged = [k for k in registry.client.get_run(run_id).data.metrics if k.startswith("compat.")]
    trained = [k for k in logged if not k.startswith("compat.stage1.")]
    assert bool(trained) == (method != "none")  # "none" trains nothing
    for key in logged:
        expected = list(range(1, 6 if key.startswith("compat.stage1.") else 4))  # XBT's text-only stage: 5
        assert [m.step for m in registry.client.get_metric_history(run_id, key)] == expected, key
    shutil.rmtree(run_dir)


def test_a_halted_rollout_is_rolled_back_whole_and_the_next_upgrade_ships(bootstrapped, tmp_path, stream_dir):
    from components import steps

    config, cycle = _cycle_from(bootstrapped, tmp_path, stream_dir, "bct")
    config["rollout"]["floors"] = {"R@1": 100.0}  # no model reaches it: the first stage halts
    halted = cycle.ship(1, probes_can_halt=True)
    assert not halted["promoted"] and halted["rollout"]["status"] == "rolled_back"
    assert halted["rollout"]["rollback"]["from_status"] == "halted"
    assert_serves(config, "1", 32)  # production serves every item, the candidate nothing
    serving = json.loads((Path(config["workspace"]) / "serving.json").read_text())
    assert serving["query_model"]["version"] == "1"

    config["rollout"]["floors"] = {}
    shipped = cycle.ship(2)
    assert shipped["promoted"] and shipped["rollout"]["mode"] == "staged"
    assert_serves(config, "3", 48)
    assert steps.registry_of(config).alias_version("previous") == "1"
    assert served_gallery(config)["count"] == 48


def test_rollback_is_all_or_nothing_and_covers_items_added_after_the_rollout(
    bootstrapped, tmp_path, stream_dir
):
    """Blue-green v2 ships, phase 2's items are ingested by v2 into its collection; a rollback with an
    unreadable rollout state changes nothing; once readable, production, serving record, index (phase 2's
    items re-embedded by v1 into v1's collection) and lineage all return to v1."""
    from typer.testing import CliRunner

    from components import steps
    from components.adapters.lineage import LineageStore
    from pipelines.cli import app

    config, cycle = _cycle_from(bootstrapped, tmp_path, stream_dir, "none")
    assert cycle.ship(1)["rollout"]["mode"] == "blue_green"
    plan = steps.plan_step(config, 2, "ingest-2")
    steps.ingest_step(config, Path(plan["run_dir"]), plan["gallery_shards"])
    assert_serves(config, "2", 48)

    state_file = Path(config["workspace"]) / "rollout_state.json"
    saved = state_file.read_text()
    state_file.write_text(saved[: len(saved) // 2])
    refused = CliRunner().invoke(app, ["rollback", "--workspace", config["workspace"]])
    assert refused.exit_code == 1 and "refused, nothing changed" in refused.output
    assert "rollout_state.json: not valid JSON" in refused.output
    assert_serves(config, "2", 48)  # registry, serving record and index untouched

    state_file.write_text(saved)
    done = CliRunner().invoke(app, ["rollback", "--workspace", config["workspace"]])
    assert done.exit_code == 0, done.output
    assert_serves(config, "1", 48)
    assert version_counts(LineageStore(config["lineage"]["repo"])) == {"1": 48}
    serving = json.loads((Path(config["workspace"]) / "serving.json").read_text())
    assert serving["query_model"]["version"] == "1"


def _snapshot(root: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_copied_workspace_works_where_it_is_and_leaves_the_original_alone(
    bootstrapped, tmp_path, stream_dir
):
    """Copy a workspace that has served and shipped; upgrade, search and roll back in the copy with the
    original (and the workspace it was copied from in turn) moved away: the copy answers from its own files
    (gallery rows name their shards relative to the workspace) and the original's bytes do not change."""
    from typer.testing import CliRunner

    from pipelines.cli import app

    original, cycle = _cycle_from(bootstrapped, tmp_path / "a", stream_dir, "bct")
    cycle.ship(1)
    shutil.copytree(tmp_path / "a" / "ws", tmp_path / "b" / "ws", symlinks=True)
    before = _snapshot(tmp_path / "a" / "ws")

    moved = chain_config(tmp_path / "b", stream_dir, "bct")
    serving = json.loads((tmp_path / "b" / "ws" / "serving.json").read_text())
    assert not serving["uri"].startswith("/") and serving["query_model"]["uri"] == "models/v2"
    earlier = [tmp_path / "a" / "ws", bootstrapped]  # nothing of the copy may need either
    for folder in earlier:
        folder.rename(folder.with_name("away"))
    try:
        assert_serves(moved, "2", 32)
        assert Cycle(moved).ship(2)["promoted"]
        assert_serves(moved, "3", 48)
        status = CliRunner().invoke(app, ["status", "--workspace", moved["workspace"]])
        assert "checksum    ok" in status.output and str(tmp_path / "b" / "ws") in status.output
        assert CliRunner().invoke(app, ["rollback", "--workspace", moved["workspace"]]).exit_code == 0
        assert_serves(moved, "2", 48)
    finally:
        for folder in earlier:
            folder.with_name("away").rename(folder)

    assert _snapshot(tmp_path / "a" / "ws") == before
    assert_serves(original, "2", 32)
