"""The weekly schedule lived end to end through kfp's local runner: five runs on one workspace (served,
rejected, blue-green, staged, a damaged production copy, a halted rollout), and a blocked phase that stops
the run."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from _lineage import version_counts
from _pipelines import PERMISSIVE_POLICY, local_config, served_gallery

from components.deployment import Deployment

pytestmark = pytest.mark.usefixtures("task_host")


class WeeklyCycle:
    """Five runs on one workspace, as a weekly schedule lives them (shared by the ``test_weekly_*`` tests).

    Phase 0 is indexed and served; a gate block leaves production and the gallery alone and the next run
    moves on; a blue-green upgrade ships; a BCT upgrade ships on top of it (the shipped compat model is the
    next run's production: drift, Mod-X teacher and init, old side of compat training); a damaged production
    copy fails the next run, which says so, and once the copy is deleted as advised the schedule goes on; a
    rollout whose probes fall below the floors halts and is rolled back whole. Every run ends succeeded or
    rejected, the gallery holds one vector per item, search answers through the alias and lineage follows
    the index after every run.

    :meth:`reach` makes the runs not made yet, in this order, up to the one asked for, and returns what
    that run left, read right after it; once a run has failed its checks, no later one is made.
    """

    RUNS = ("served", "rejected", "blue_green", "staged", "damaged", "halted")

    def __init__(self, root: Path) -> None:
        from components.adapters.lineage import LineageStore
        from components.adapters.registry import Registry
        from pipelines.config import resolve

        self.root = root
        self.config = resolve(local_config(root, phases=5)).to_dict()
        self.registry = Registry(
            self.config["workspace"], tracking_uri=self.config["registry"]["tracking_uri"]
        )
        self.lineage = LineageStore(self.config["lineage"]["repo"])
        self.seen: dict[str, dict] = {}
        self.failed: str | None = None

    def reach(self, name: str) -> dict:
        for earlier in self.RUNS[: self.RUNS.index(name) + 1]:
            if earlier in self.seen:
                continue
            if self.failed is not None:
                pytest.fail(f"an earlier run failed its checks, so this one was not made: {self.failed}")
            try:
                self.seen[earlier] = getattr(self, f"_{earlier}")()
            except BaseException as exc:
                self.failed = f"{earlier}: {type(exc).__name__}: {exc}"[:2000]
                raise
        return self.seen[name]

    def gallery(self) -> dict:
        return served_gallery(self.config)

    def aliases(self) -> dict[str, str | None]:
        return {a: self.registry.alias_version(a) for a in ("production", "previous", "candidate")}

    def run(self, expected: str, phase: int) -> dict:
        """One run with the checks every run must pass; what it left."""
        from typer.testing import CliRunner

        from components.serving.search import search
        from pipelines.cli import app
        from pipelines.local_runner import run_local

        result = run_local(Deployment.coerce(self.config), echo=io.StringIO())
        log = (result.run_dir / "pipeline.log").read_text()[-3000:]
        assert (result.status, result.phase) == (expected, phase), log
        gallery = self.gallery()
        served = gallery["by_version"]
        assert sum(served.values()) == 40 * (phase + 1) == gallery["count"]  # one vector per item
        assert version_counts(self.lineage) == served
        checked = CliRunner().invoke(
            app, ["lineage", "--check", "--json", "--workspace", self.config["workspace"]]
        )
        assert checked.exit_code == 0, checked.output  # every item's online lineage names its index version
        assert json.loads(checked.stdout)["check"]["lineage"] == served
        (hits,) = search(["a small red circle"], k=5, workspace=self.config["workspace"])
        assert len(hits) == 5 and {h["model_version"] for h in hits} <= set(served)
        return {"result": result, "gallery": gallery, "aliases": self.aliases()}

    def read(self, seen: dict, *parts: str) -> dict:
        return json.loads(Path(seen["result"].run_dir, *parts).read_text())

    def _served(self) -> dict:
        return self.run("succeeded", 0)

    def _rejected(self) -> dict:
        return self.run("rejected", 1)

    def _blue_green(self) -> dict:
        # The production model's weights as an independent candidate (lr below float32 resolution, method
        # "none"): it declares its own embedding space, so the rollout goes blue-green (fill a new
        # collection, probe, move the alias).
        policy = self.root / "permissive.yaml"
        policy.write_text(PERMISSIVE_POLICY)
        self.config["gate"]["policy"] = str(policy)
        self.config["training"]["lr"] = 1e-12
        self.config["compat"].update(method="none", options={})
        return self.run("succeeded", 2)

    def _staged(self) -> dict:
        # A BCT upgrade on top of the shipped compat model: staged rollout in the space it keeps.
        self.config["compat"].update(method="bct", options={"lr": 1e-12})
        return self.run("succeeded", 3)

    def _damaged(self) -> dict:
        """Phase 4 with production's copy damaged: the failed run as the CLI, its files and ``compatflow
        status`` show it; then the copy is deleted, as advised (it is downloaded again)."""
        from typer.testing import CliRunner

        from components.runs import read_state
        from pipelines.cli import app

        copy = Path(self.config["workspace"]) / "models" / "v4"
        with open(copy / "new" / "model.safetensors", "ab") as fh:
            fh.write(b"\0")
        config_file = self.root / "config.yaml"
        config_file.write_text(yaml.safe_dump(self.config))
        cli = CliRunner().invoke(app, ["run", "--config", str(config_file)])
        outputs = [line.split()[-1] for line in cli.output.splitlines() if "outputs:" in line]
        assert outputs, cli.output
        failed_dir = Path(outputs[0])
        status = CliRunner().invoke(app, ["status", "--workspace", self.config["workspace"]])
        seen = {
            "copy": copy,
            "cli": cli,
            "failed_dir": failed_dir,
            "outcome": json.loads((failed_dir / "outcome.json").read_text()),
            "log_lines": (failed_dir / "pipeline.log").read_text().splitlines(),
            "report": (failed_dir / "report" / "report.md").read_text(),
            "phases": read_state(self.config["workspace"]).model_dump()["phases"],
            "status": status,
        }
        shutil.rmtree(copy)
        return seen

    def _halted(self) -> dict:
        # Probe floors no model reaches: the rollout halts at its first stage and is rolled back whole.
        from components.runs import read_state

        self.config["rollout"]["floors"] = {"R@1": 100.0}
        seen = self.run("rejected", 4)
        seen["serving"] = json.loads((Path(self.config["workspace"]) / "serving.json").read_text())
        seen["phases"] = read_state(self.config["workspace"]).model_dump()["phases"]
        return seen


@pytest.fixture(scope="module")
def weekly(tmp_path_factory) -> WeeklyCycle:
    return WeeklyCycle(tmp_path_factory.mktemp("weekly"))


def test_weekly_phase_0_is_indexed_and_served(weekly):
    first = weekly.reach("served")
    validation = weekly.read(first, "validate", "validation.json")
    assert validation["passed"] + validation["quarantined"] == validation["total"] > 0
    assert (first["result"].run_dir / "drift" / "drift.json").is_file()
    assert first["aliases"]["production"] == "1"
    assert first["gallery"]["by_version"] == {"1": 40}


def test_weekly_gate_block_leaves_production_alone_and_serves_the_new_items(weekly):
    # A 6-step candidate on 40 evaluation images: the shipped policy must refuse it.
    rejected = weekly.reach("rejected")
    gate = weekly.read(rejected, "gate", "gate.json")
    assert gate["decision"] == "block" and "eval_set_too_small" in {r["code"] for r in gate["reasons"]}
    assert weekly.read(rejected, "blocked.json")["step"] == "gate"
    assert not (rejected["result"].run_dir / "rollout").exists()
    assert rejected["aliases"]["production"] == "1" and rejected["aliases"]["candidate"] == "2"
    # The phase's new gallery items are served (by production) although its candidate was refused.
    assert rejected["gallery"]["by_version"] == {"1": 80}
    assert weekly.read(rejected, "ingest", "ingest.json")["n_new"] == 40
    # Compatibility training saw the phase and a validated shard of phase 0 (kept by phase 0's run).
    compat_model = weekly.read(rejected, "compat", "compat_model.json")
    assert [Path(s).parent.name for s in compat_model["replay_shards"]] == ["phase-000"]
    assert all(Path(s).is_file() for s in compat_model["replay_shards"])


def test_weekly_blue_green_upgrade_ships(weekly):
    blue_green = weekly.reach("blue_green")
    rollout = weekly.read(blue_green, "rollout", "rollout.json")
    assert rollout["rollout"]["status"] == "completed" and rollout["promoted"]
    assert rollout["rollout"]["mode"] == "blue_green"
    before = rollout["rollout"]["gallery"]["source_collection"]
    assert blue_green["gallery"]["collection"] == rollout["rollout"]["gallery"]["collection"] != before
    assert blue_green["aliases"]["production"] == "3" and blue_green["aliases"]["previous"] == "1"
    # phase 0 backfilled, phases 1 and 2 added then backfilled
    assert blue_green["gallery"]["by_version"] == {"3": 120}


def test_weekly_bct_upgrade_ships_on_top_of_the_shipped_compat_model(weekly):
    staged = weekly.reach("staged")
    rollout = weekly.read(staged, "rollout", "rollout.json")
    assert rollout["rollout"]["mode"] == "staged" and rollout["promoted"]
    metrics = weekly.read(staged, "continual", "metrics.json")
    blue_green = weekly.reach("blue_green")["result"]
    assert metrics["production"]["version"] == blue_green.run_id and metrics["production"]["method"] == "none"
    drift = weekly.read(staged, "drift", "drift.json")
    assert drift["production_model"].endswith("v3")
    assert staged["aliases"]["production"] == "4" and staged["aliases"]["previous"] == "3"
    assert staged["gallery"]["by_version"] == {"4": 160}


def test_weekly_damaged_production_copy_fails_the_run_and_says_what_to_do(weekly):
    # The run fails at the step that reads the copy and says so in outcome.json, the report and the CLI.
    damaged = weekly.reach("damaged")
    cli, outcome, report = damaged["cli"], damaged["outcome"], damaged["report"]
    assert cli.exit_code == 1, cli.output
    assert "phase 4 failed" in cli.output and "failed step: resolve-production" in cli.output
    assert (
        "CheckpointIntegrityError: checkpoint" in cli.output and "delete the named model folder" in cli.output
    )
    assert outcome["status"] == "failed" and outcome["failed_step"] == "resolve-production"
    assert outcome["error"]["type"] == "CheckpointIntegrityError" and outcome["log_line"] > 0
    assert "CheckpointIntegrityError" in damaged["log_lines"][outcome["log_line"] - 1]
    assert report.index("Step resolve-production failed: CheckpointIntegrityError") < report.index(
        "Release gate"
    )
    assert "did not run: step resolve-production failed before it" in report
    assert damaged["phases"]["4"]["status"] == "failed"
    status = damaged["status"].output
    assert "checksum    FAILED" in status and f"delete {damaged['copy']}" in status
    assert "    4  failed" in status and "step resolve-production: CheckpointIntegrityError" in status


def test_weekly_halted_rollout_is_rolled_back_whole_and_the_schedule_goes_on(weekly):
    # Run after the failed one, with the damaged copy deleted as advised: phase 4 runs again.
    halted = weekly.reach("halted")
    rollout = weekly.read(halted, "rollout", "rollout.json")
    assert rollout["rollout"]["status"] == "rolled_back" and not rollout["promoted"]
    assert rollout["rollout"]["rollback"]["from_status"] == "halted"
    assert "rolled back" in weekly.read(halted, "blocked.json")["reason"]
    assert halted["serving"]["query_model"]["version"] == "4" and halted["aliases"]["production"] == "4"
    # phase 4's items ingested by production, nothing else
    assert halted["gallery"]["by_version"] == {"4": 200}
    statuses = {k: v["status"] for k, v in halted["phases"].items()}
    assert statuses == {
        "0": "succeeded",
        "1": "rejected",
        "2": "succeeded",
        "3": "succeeded",
        "4": "rejected",
    }
    from pipelines.local_runner import run_local

    assert run_local(Deployment.coerce(weekly.config), echo=io.StringIO()).status == "nothing-to-do"


def test_blocked_phase_stops_the_run(tmp_path):
    import io
    import tarfile

    from pipelines.local_runner import ensure_stream, run_local

    config = Deployment.coerce(local_config(tmp_path, phases=1))
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
