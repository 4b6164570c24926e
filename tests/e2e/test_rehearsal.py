"""``make rehearse`` at test size: the compiled cluster package's tasks, each its own process as the images'
user, against Milvus standalone and an MLflow server on loopback, with the config, the feature repo and the
stream read-only. Phase 0 (the first model) and phase 1 (an upgrade whose backfill fans out over two
``ParallelFor`` tasks per stage) ship on one rehearsal folder, the upgrade's processes killed once after
compat training and the run resubmitted (KFP's cache skips what it finished); then the operator commands.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from _milvus import milvus_binaries_cache


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    from components.adapters import milvus_server
    from pipelines.rehearsal import Rehearsal

    if os.geteuid() != 0 or not milvus_server.loopback_only():
        pytest.skip(
            "the rehearsal needs root in a loopback-only network namespace (the test session's, as root)"
        )
    # Outside pytest's own temp tree: that one is root-only (0700), and the tasks run as uid 10001.
    root = Path(tempfile.mkdtemp(prefix="compatflow-rehearsal-", dir="/tmp"))
    root.chmod(0o755)
    lock = tmp_path_factory.getbasetemp().parent / "milvus-standalone-start.lock"  # as conftest's server
    with contextlib.ExitStack() as stack:
        rehearsal = Rehearsal(root, milvus_binaries=milvus_binaries_cache(), echo=lambda line: None)
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            stack.enter_context(rehearsal.services())
        rehearsal.prepare()
        yield rehearsal
    shutil.rmtree(root, ignore_errors=True)


def _served(rehearsal) -> tuple[str, dict]:
    """The production alias on the MLflow server and the gallery's versions on Milvus (asked of the servers:
    this root process writes nothing in the tasks' workspace)."""
    from mlflow import MlflowClient

    from components.adapters.index import gallery_status
    from components.serving.record import read_serving

    config = yaml.safe_load(rehearsal.layout.config_file.read_text())
    name = config["registry"].get("model_name", "compatflow-clip")
    production = MlflowClient(rehearsal.tracking_uri).get_model_version_by_alias(name, "production").version
    alias = read_serving(rehearsal.layout.workspace / "serving.json").alias  # the deployment's own
    return str(production), gallery_status(rehearsal.index_uri, alias)["by_version"]


def _tasks(log: str) -> list[str]:
    """The task names kfp.local started, in order (its 'Executing task' lines)."""
    return re.findall(r"Executing task '([^']+)'", _plain(log))


def _failure(log: str) -> str:
    """The log from its first traceback on (a failed task's), else its tail."""
    text = _plain(log)
    at = text.find("Traceback")
    return text[at : at + 6000] if at >= 0 else text[-4000:]


def _plain(log: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", Path(log).read_text())


def test_the_first_phase_ships_from_the_compiled_package_as_the_images_user(rehearsal):
    step = rehearsal.ship()
    assert step.ok, _failure(step.log)
    assert step.detail == "phase 0: succeeded"
    assert _served(rehearsal) == ("1", {"1": 16})
    tasks = _tasks(step.log)
    assert "serve-first-model-op" in tasks and "compat-op" not in tasks
    ws = rehearsal.layout.workspace
    # everything went to the servers: no embedded registry or index was made in the workspace
    assert not (ws / "mlflow.db").exists() and not (ws / "milvus").exists()
    owners = {p.stat().st_uid for p in ws.rglob("*")}
    assert owners == {10001}, f"files in the workspace owned by {owners}: the tasks run as uid 10001 only"


def test_an_upgrade_whose_pods_are_killed_after_compat_training_changes_nothing_served(rehearsal):
    step = rehearsal.ship(stop_at="evaluate-op")
    assert step.ok and step.detail == "phase 1: stopped at evaluate-op", _failure(step.log)
    assert step.run_id.startswith("compatflow-continual-upgrade-")  # the KFP job name
    rehearsal.stopped_run = step.run_id
    production, by_version = _served(rehearsal)
    # production unchanged; the phase's new gallery items are served by it once ingest ran (before the kill
    # or not, as kfp.local orders the independent tasks)
    assert production == "1" and set(by_version) == {"1"} and by_version["1"] in (16, 32)


def test_the_run_resubmitted_skips_its_cached_steps_and_fans_its_backfill_out(rehearsal):
    step = rehearsal.ship(run_id=rehearsal.stopped_run)
    assert step.ok, _failure(step.log)
    assert step.detail == "phase 1: succeeded" and step.run_id == rehearsal.stopped_run
    assert _served(rehearsal) == ("2", {"2": 32})
    # the steps that finished before the kill are KFP-cached (kfp.local skips them without a word);
    # evaluate, killed as it started, ran again
    tasks = _tasks(step.log)
    assert not {"validate-op", "drift-op", "continual-op", "compat-op"} & set(tasks), tasks
    assert {"plan-op", "evaluate-op", "gate-op"} <= set(tasks), tasks
    # rollout.workers 2, fractions [1.0], batches of 8: the stage's 32 items in two rank-range tasks, between
    # the ranges task that hands them out and the one that probes the stage
    assert sum(t.startswith("rollout-range-op") for t in tasks) == 2
    assert sum(t.startswith("rollout-ranges-op") for t in tasks) == 2
    assert tasks[-1] == "finish-op"
    # the three ships handed their tasks to one warm host, which imported the steps' libraries once
    ships = (rehearsal.layout.workspace / "tmp" / "task-host" / "host.log").read_text()
    assert ships.count(f"tasks handed to the host at {rehearsal.task_socket} ") == 3, ships
    host = (rehearsal.layout.logs / "task-host.log").read_text()
    assert host.count("preloaded in") == 1 and "finish_op" in host


def test_the_operator_commands_reach_the_services_and_the_inputs_stay_read_only(rehearsal):
    checks = {check.name: check for check in rehearsal.check()}
    assert all(check.ok for check in checks.values()), {n: c.detail for n, c in checks.items()}
    assert checks["search"].detail == "3 hits for 'a red circle'"
    assert "production  v2" in Path(checks["status"].log).read_text()
    assert checks["lineage --check"].detail.endswith("they agree")
