"""A run killed anywhere resumes: kill -9 during validation, training, compat, the gate and two backfill
stages, each time running it again.

Each attempt is a real ``compatflow run`` process (kfp.local tasks, milvus-lite, MLflow, Feast) killed
with SIGKILL as a whole process group, the way a node or the OOM killer ends it. The next run of the phase
continues the same run: training from its last checkpoint, compat reused, the rollout from its cursor;
the phase ends succeeded with one vector per item and no orphaned registry version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.test_pipeline import PERMISSIVE_POLICY, _local_config

pytestmark = pytest.mark.slow


def _start(config_file: Path, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("compatflow")
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(exe), "run", "--config", str(config_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_when(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_dir(ws: Path, phase: int) -> Path | None:
    runs = [p.parent for p in ws.glob("runs/*/run.json") if json.loads(p.read_text())["phase"] == phase]
    return runs[0] if len(runs) == 1 else None


@pytest.mark.timeout(2400)  # eight pipeline runs, six of them killed
def test_kill_9_anywhere_then_run_again_finishes_the_phase(tmp_path):
    from components.index import gallery_status
    from components.registry import Registry
    from components.runs import read_state
    from pipelines.config import resolve

    config = resolve(_local_config(tmp_path, phases=2)).to_dict()
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["gate"]["policy"] = str(policy)
    config["training"].update(steps=60, checkpoint_every=20, lr=1e-12)
    config["compat"]["options"] = {"lr": 1e-12}
    config["rollout"]["batch_size"] = 8
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    ws = Path(config["workspace"])

    first = _start(config_file, tmp_path / "run-0.log")
    assert first.wait(timeout=900) == 0, (tmp_path / "run-0.log").read_text()[-3000:]

    def log_of(attempt: int) -> Path:
        return tmp_path / f"run-1-{attempt}.log"

    def task_started(name: str) -> Callable[[], bool]:
        def ready() -> bool:
            run_dir = _run_dir(ws, 1)
            log = run_dir / "pipeline.log" if run_dir is not None else None  # each attempt starts a new one
            return log is not None and log.is_file() and f"'{name}'" in log.read_text(errors="replace")

        return ready

    def checkpoint() -> bool:
        run_dir = _run_dir(ws, 1)
        return run_dir is not None and any((run_dir / "continual" / "train" / "checkpoints").glob("step-*"))

    def backfilling(stage: int) -> Callable[[], bool]:
        def ready() -> bool:
            try:
                state = json.loads((ws / "rollout_state.json").read_text())
            except (OSError, ValueError):
                return False
            return state["model_version"] == "2" and state["state"] == "running" and state["stage"] >= stage

        return ready

    kills = [
        ("validation", task_started("validate-op")),
        ("a training checkpoint", checkpoint),
        ("compat training", task_started("compat-op")),
        ("the gate", task_started("gate-op")),
        ("backfill stage 1", backfilling(1)),
        ("backfill stage 3", backfilling(3)),
    ]
    rollout_ids = set()
    for attempt, (point, ready) in enumerate(kills, start=1):
        _kill_when(_start(config_file, log_of(attempt)), ready, point)
        run_dir = _run_dir(ws, 1)  # one run of the phase: every attempt continues it
        assert run_dir is not None and not (run_dir / "outcome.json").exists()
        if point == "compat training":
            training = json.loads((run_dir / "continual" / "metrics.json").read_text())["training"]
            assert training["resumed_from_step"] in (20, 40)  # from the killed attempt's checkpoint
        if point.startswith("backfill"):
            rollout_ids.add(json.loads((ws / "rollout_state.json").read_text())["rollout_id"])
    assert len(rollout_ids) == 1  # the second backfill kill interrupted the same rollout, resumed

    last = _start(config_file, log_of(len(kills) + 1))
    assert last.wait(timeout=900) == 0, log_of(len(kills) + 1).read_text()[-3000:]
    assert read_state(ws)["phases"]["1"] == {**read_state(ws)["phases"]["1"], "status": "succeeded"}
    assert json.loads((run_dir / "run.json").read_text())["attempt"] == len(kills) + 1
    rollout = json.loads((run_dir / "rollout" / "rollout.json").read_text())["rollout"]
    assert rollout["rollout_id"] in rollout_ids and rollout["state"] == "completed"  # resumed, not restarted
    gallery = gallery_status(config["index"]["uri"], config["index"]["alias"])
    assert gallery["by_version"] == {"2": 80} == {"2": gallery["count"]}  # one vector per item
    registry = Registry(config["workspace"], tracking_uri=config["registry"]["tracking_uri"])
    versions = sorted(str(v.version) for v in registry.client.search_model_versions("name='compatflow-clip'"))
    assert versions == ["1", "2"] and registry.alias_version("production") == "2"  # nothing orphaned
    assert not (run_dir / "continual" / "train" / "checkpoints").exists()  # cleaned when the run ended
