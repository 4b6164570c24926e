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
import yaml

from components.runs import record_phase
from tests.test_pipeline import PERMISSIVE_POLICY

pytestmark = pytest.mark.slow


def chain_config(tmp_path: Path, stream: Path, method: str, scenario: str = "continual") -> dict:
    from pipelines.config import CONFIG_DIR, resolve

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(stream), generate_if_missing=False)
    config["drift"]["sample_size"] = 24
    config["training"].update(steps=3, batch_size=16, replay_buffer_size=16, replay_rows=4)
    # XBT pretrains its projection on text alone for 2000 steps by default (compat/methods/xbt.py); a few do
    # here: what is tested is that its model ships and upgrades, not how well the projection fits.
    options = {"stage1_steps": 5} if method == "xbt" else {}
    config["compat"].update(method=method, scenario=scenario, steps=3, batch_size=16, options=options)
    # The foundation scenario's own architecture, small here: what is tested is that a model trained from
    # its own initialisation and mapped into production's space becomes the next production model.
    config["compat"]["foundation_config"] = "cf-tiny"
    config["gate"]["policy"] = str(policy)
    config["rollout"]["batch_size"] = 16
    return resolve(config).to_dict()


class Cycle:
    """The pipeline's steps for one workspace, in the order the pipeline runs them."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def _validated(self, phase: int) -> tuple[dict, Path, Path]:
        from components import steps

        plan = steps.plan_step(self.config, phase, f"run-{phase}-{len(self.runs())}")
        run_dir = Path(plan["run_dir"])
        validated = run_dir / "_validated"
        steps.validate_step(
            self.config, run_dir, phase, plan["train_shards"], validated, run_dir / "_validation.json"
        )
        return plan, run_dir, validated

    def runs(self) -> list[Path]:
        root = Path(self.config["workspace"]) / "runs"
        return sorted(root.iterdir()) if root.is_dir() else []

    def bootstrap(self) -> None:
        from components import steps

        plan, run_dir, validated = self._validated(0)
        steps.continual_step(
            self.config, run_dir, 0, plan["stream_dir"], str(validated), "", run_dir / "_candidate"
        )
        version = steps.register_step(self.config, run_dir, 0, str(run_dir / "_candidate"), bootstrap=True)
        registry = steps.registry_of(self.config)  # the training curve was logged as training ran, once
        history = registry.client.get_metric_history(version["mlflow_run_id"], "train.loss")
        assert [m.step for m in history] == list(range(1, self.config["training"]["steps"] + 1))
        steps.serve_first_model_step(self.config, run_dir, version["version"], plan["gallery_shards"])
        # Retrieval examples for the report: the newest gallery captions searched as served, with pictures.
        examples = json.loads((run_dir / "rollout" / "examples.json").read_text())["queries"]
        assert len(examples) == 3 and all(len(q["hits"]) == 3 for q in examples)
        assert all(h["thumbnail"].startswith("data:image/jpeg;base64,") for q in examples for h in q["hits"])
        record_phase(Path(self.config["workspace"]), 0, "succeeded", run_dir.name)  # the exit handler's part

    def train(self, phase: int) -> tuple[dict, Path, str]:
        """Validate, drift, continual and compat training of ``phase`` against production."""
        from components import steps

        production = steps.resolve_production(self.config)
        assert production, "no production model"
        plan, run_dir, validated = self._validated(phase)
        steps.drift_step(
            self.config,
            run_dir,
            plan["reference_shards"],
            str(validated),
            production,
            run_dir / "_drift.html",
            run_dir / "_drift.json",
        )
        steps.continual_step(
            self.config,
            run_dir,
            phase,
            plan["stream_dir"],
            str(validated),
            production,
            run_dir / "_candidate",
        )
        steps.ingest_step(self.config, run_dir, plan["gallery_shards"])
        compat = steps.compat_step(
            self.config,
            run_dir,
            phase,
            str(run_dir / "_candidate" / "model"),
            production,
            str(validated),
            run_dir / "_compat",
        )
        return plan, run_dir, compat

    def ship(self, phase: int, *, probes_can_halt: bool = False) -> dict:
        """One upgrade through evaluate, gate, register and rollout; returns the rollout summary."""
        from components import steps
        from components.rollout import RolloutPaths

        plan, run_dir, compat = self.train(phase)
        production = steps.resolve_production(self.config)
        steps.evaluate_step(
            self.config, run_dir, production, compat, plan["eval_shards"], run_dir / "_evaluate", phase
        )
        decision = steps.gate_step(
            self.config,
            run_dir,
            str(run_dir / "_evaluate" / "compat_report.json"),
            str(run_dir / "_validation.json"),
            str(run_dir / "_drift.json"),
            run_dir / "_gate",
        )
        assert decision == "pass"
        version = steps.register_step(self.config, run_dir, phase, compat)["version"]
        # Every gallery item relevant to every probe query: the probes cannot halt this rollout. These
        # tests check that each kind of model loads, serves and upgrades; tests/test_rollout.py the probes.
        if not probes_can_halt:
            probe = RolloutPaths.for_workspace(self.config["workspace"]).probe
            doc = json.loads(probe.read_text())
            everything = sorted({p for positives in doc["positives"] for p in positives})
            probe.write_text(json.dumps({"texts": doc["texts"][:8], "positives": [everything] * 8}))
        summary = steps.rollout_step(self.config, run_dir, version)
        examples = json.loads((run_dir / "rollout" / "examples.json").read_text())["queries"]
        served = summary["version"] if summary["promoted"] else None
        assert examples and all(
            h["model_version"] == (served or h["model_version"]) for q in examples for h in q["hits"]
        )
        status = "succeeded" if summary["promoted"] else "rejected"
        record_phase(Path(self.config["workspace"]), phase, status, run_dir.name)
        return summary


def assert_serves(config: dict, version: str, n_items: int) -> None:
    """Production is ``version``, the gallery holds one vector per item, all written by it, and a text
    search through the serving alias answers with gallery items."""
    from components import steps
    from components.index import gallery_status
    from components.search import search

    registry = steps.registry_of(config)
    assert registry.alias_version("production") == version
    gallery = gallery_status(config["index"]["uri"], config["index"]["alias"])
    assert gallery["by_version"] == {version: n_items}
    (hits,) = search(["a red circle"], k=3, workspace=config["workspace"])
    assert len(hits) == 3 and all(hit["model_version"] == version for hit in hits)


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
def test_two_shipped_upgrades_then_a_third_trains(tmp_path, stream_dir, method, scenario):
    from compat.production import load_production

    config = chain_config(tmp_path, stream_dir, method, scenario)
    cycle = Cycle(config)
    cycle.bootstrap()
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


def test_a_halted_rollout_is_rolled_back_whole_and_the_next_upgrade_ships(tmp_path, stream_dir):
    from components import steps
    from components.index import gallery_status

    config = chain_config(tmp_path, stream_dir, "bct")
    cycle = Cycle(config)
    cycle.bootstrap()
    config["rollout"]["floors"] = {"R@1": 100.0}  # no model reaches it: the first stage halts
    halted = cycle.ship(1, probes_can_halt=True)
    assert not halted["promoted"] and halted["rollout"]["state"] == "rolled_back"
    assert halted["rollout"]["rollback"]["from_state"] == "halted"
    assert_serves(config, "1", 32)  # production serves every item, the candidate nothing
    serving = json.loads((Path(config["workspace"]) / "serving.json").read_text())
    assert serving["query_model"]["version"] == "1"

    config["rollout"]["floors"] = {}
    shipped = cycle.ship(2)
    assert shipped["promoted"] and shipped["rollout"]["mode"] == "staged"
    assert_serves(config, "3", 48)
    assert steps.registry_of(config).alias_version("previous") == "1"
    assert gallery_status(config["index"]["uri"], config["index"]["alias"])["count"] == 48


def test_rollback_is_all_or_nothing_and_covers_items_added_after_the_rollout(tmp_path, stream_dir):
    """Blue-green v2 ships, phase 2's items are ingested by v2 into its collection; a rollback with an
    unreadable rollout state changes nothing; once readable, production, serving record, index (phase 2's
    items re-embedded by v1 into v1's collection) and lineage all return to v1."""
    from typer.testing import CliRunner

    from components import steps
    from components.lineage import LineageStore
    from pipelines.cli import app

    config = chain_config(tmp_path, stream_dir, "none")
    cycle = Cycle(config)
    cycle.bootstrap()
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
    assert LineageStore(config["lineage"]["repo"]).version_counts() == {"1": 48}
    serving = json.loads((Path(config["workspace"]) / "serving.json").read_text())
    assert serving["query_model"]["version"] == "1"


def _snapshot(root: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_copied_workspace_works_where_it_is_and_leaves_the_original_alone(tmp_path, stream_dir):
    """Copy a workspace that has served and shipped; upgrade, search and roll back in the copy: the copy
    answers from its own files and the original's bytes do not change."""
    from typer.testing import CliRunner

    from pipelines.cli import app

    original = chain_config(tmp_path / "a", stream_dir, "bct")
    Cycle(original).bootstrap()
    Cycle(original).ship(1)
    shutil.copytree(tmp_path / "a" / "ws", tmp_path / "b" / "ws", symlinks=True)
    before = _snapshot(tmp_path / "a" / "ws")

    moved = chain_config(tmp_path / "b", stream_dir, "bct")
    serving = json.loads((tmp_path / "b" / "ws" / "serving.json").read_text())
    assert not serving["uri"].startswith("/") and serving["query_model"]["uri"] == "models/v2"
    assert_serves(moved, "2", 32)
    assert Cycle(moved).ship(2)["promoted"]
    assert_serves(moved, "3", 48)
    status = CliRunner().invoke(app, ["status", "--workspace", moved["workspace"]])
    assert "checksum    ok" in status.output and str(tmp_path / "b" / "ws") in status.output
    assert CliRunner().invoke(app, ["rollback", "--workspace", moved["workspace"]]).exit_code == 0
    assert_serves(moved, "2", 48)

    assert _snapshot(tmp_path / "a" / "ws") == before
    assert_serves(original, "2", 32)
