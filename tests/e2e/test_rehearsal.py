"""``make rehearse`` at test size: the compiled cluster package's tasks, each its own process as the images'
user, against Milvus standalone and an MLflow server on loopback, with the config, the feature repo and the
stream read-only. Phase 0 (the first model) and phase 1 (an upgrade whose backfill fans out over two
``ParallelFor`` tasks per stage) ship in two tests on one rehearsal folder, then the operator commands run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from _milvus import milvus_binaries_cache


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    from components import milvus_server
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


def _served(rehearsal) -> tuple[str | None, dict]:
    from components.index import gallery_status
    from components.registry import Registry

    registry = Registry(rehearsal.layout.workspace, tracking_uri=rehearsal.tracking_uri)
    return registry.alias_version("production"), gallery_status(rehearsal.index_uri)["by_version"]


def _tasks(log: str) -> list[str]:
    """The task names kfp.local started, in order (its 'Executing task' lines)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", Path(log).read_text())
    return re.findall(r"Executing task '([^']+)'", text)


def test_the_first_phase_ships_from_the_compiled_package_as_the_images_user(rehearsal):
    step = rehearsal.ship()
    assert step.ok, Path(step.log).read_text()[-4000:]
    assert step.detail == "phase 0: succeeded"
    assert _served(rehearsal) == ("1", {"1": 16})
    tasks = _tasks(step.log)
    assert "serve-first-model-op" in tasks and "compat-op" not in tasks
    ws = rehearsal.layout.workspace
    # everything went to the servers: no embedded registry or index was made in the workspace
    assert not (ws / "mlflow.db").exists() and not (ws / "milvus").exists()
    owners = {p.stat().st_uid for p in ws.rglob("*")}
    assert owners == {10001}, f"files in the workspace owned by {owners}: the tasks run as uid 10001 only"


def test_an_upgrade_fans_its_backfill_out_and_the_operator_commands_reach_the_services(rehearsal):
    step = rehearsal.ship()
    assert step.ok, Path(step.log).read_text()[-4000:]
    assert step.detail == "phase 1: succeeded"
    assert _served(rehearsal) == ("2", {"2": 32})
    tasks = _tasks(step.log)
    # rollout.workers 2, fractions [0.5, 1.0]: two rank-range tasks per stage, between the stage planners
    assert tasks.count("rollout-range-op") == 4 and tasks.count("rollout-ranges-op") == 3
    assert tasks[-1] == "finish-op"

    checks = {check.name: check for check in rehearsal.check()}
    assert all(check.ok for check in checks.values()), {n: c.detail for n, c in checks.items()}
    assert checks["search"].detail == "3 hits for 'a red circle'"
    assert "production  v2" in Path(checks["status"].log).read_text()
