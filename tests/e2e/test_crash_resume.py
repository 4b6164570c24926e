"""A run killed anywhere resumes: kill -9 during validation, training, compat, the gate and two backfill
stages, each time running it again.

Each attempt is a real ``compatflow run`` process (kfp.local tasks, milvus-lite, MLflow, Feast) killed
with SIGKILL as a whole process group, the way a node or the OOM killer ends it; its tasks are forked by the
session's warm task host, which kills a task as its launcher in that group dies. The next run of the phase
continues the same run: training from its last checkpoint, compat reused, the rollout from its cursor;
the phase ends succeeded with one vector per item and no orphaned registry version.

The attempts follow each other on one workspace (:class:`KilledRun`, shared by this module's tests): each
test makes its own kill after those before it (making them first when it runs alone) and checks what that
kill must leave, so no single test runs the whole sequence.
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
from typing import Any

import pytest
import yaml
from _pipelines import PERMISSIVE_POLICY, local_config, served_gallery

pytestmark = pytest.mark.usefixtures("task_host")

# Where phase 1's run is killed, in this order; one more attempt then finishes the phase.
KILLS = (
    "validation",
    "a training checkpoint",
    "compat training",
    "the gate",
    "backfill stage 1",
    "backfill stage 3",
)
CHECKPOINT_EVERY = 5


def _start(config_file: Path, log: Path, *, warm: bool = True) -> subprocess.Popen:
    """``compatflow run`` in a session of its own; ``warm`` False: every task a fresh Python, as in a pod."""
    exe = Path(sys.executable).with_name("compatflow")
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(exe), "run", "--config", str(config_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "COMPATFLOW_WARM_TASKS": "1" if warm else "0"},
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


def _registered(config: dict[str, Any]) -> tuple[list[str], dict[str, str | None]]:
    from components.adapters.registry import Registry

    registry = Registry(config["workspace"], tracking_uri=config["registry"]["tracking_uri"])
    versions = sorted(str(v.version) for v in registry.client.search_model_versions("name='compatflow-clip'"))
    return versions, {a: registry.alias_version(a) for a in ("production", "candidate")}


class KilledRun:
    """Phase 0 run to its end, then phase 1's run killed at each point of :data:`KILLS` in turn and run once
    more to its end. :meth:`kill` and :meth:`finish` make the attempts not made yet, up to the one asked
    for, and return what each left; once an attempt has failed, no later one is made."""

    def __init__(self, root: Path) -> None:
        from pipelines.config import resolve

        self.root = root
        config = resolve(local_config(root, phases=2)).to_dict()
        policy = root / "permissive.yaml"
        policy.write_text(PERMISSIVE_POLICY)
        config["gate"]["policy"] = str(policy)
        # Several checkpoints before the end; lr below float32 resolution keeps the weights production's.
        config["training"].update(steps=3 * CHECKPOINT_EVERY, checkpoint_every=CHECKPOINT_EVERY, lr=1e-12)
        config["compat"]["options"] = {"lr": 1e-12}
        config["drift"]["embeddings"] = False  # the drift report is not what these tests check
        config["rollout"]["batch_size"] = 8  # several batches per backfill stage: a kill can land inside one
        self.config = config
        self.config_file = root / "config.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.ws = Path(config["workspace"])
        self.seen: list[dict[str, Any]] = []  # what each kill left, in the order of KILLS
        self.finished: dict[str, Any] | None = None
        self.failed: str | None = None
        # phase 0 with a fresh process per task (kfp.local's own way, a pod's), the kills with warm tasks
        first = _start(self.config_file, root / "run-0.log", warm=False)
        assert first.wait(timeout=900) == 0, (root / "run-0.log").read_text()[-3000:]
        assert not (_run_dir(self.ws, 0) / "task-host.log").exists()  # no host served phase 0

    def log_of(self, attempt: int) -> Path:
        return self.root / f"run-1-{attempt}.log"

    def kill(self, point: str) -> dict[str, Any]:
        """What phase 1's run left when killed at ``point`` (killed there, and before, if not done yet)."""
        index = KILLS.index(point)
        while len(self.seen) <= index:
            self._attempt(self._next_kill)
        return self.seen[index]

    def finish(self) -> dict[str, Any]:
        """The attempt after every kill, which runs phase 1 to its end."""
        self.kill(KILLS[-1])
        if self.finished is None:
            self._attempt(self._last)
        assert self.finished is not None
        return self.finished

    def _attempt(self, make: Callable[[], None]) -> None:
        if self.failed is not None:
            pytest.fail(f"an earlier attempt failed, so this one was not made: {self.failed}")
        try:
            make()
        except BaseException as exc:
            self.failed = f"attempt {len(self.seen) + 1}: {type(exc).__name__}: {exc}"[:2000]
            raise

    def _next_kill(self) -> None:
        attempt = len(self.seen) + 1
        point = KILLS[attempt - 1]
        ready = {
            "validation": self._task_started("validate-op"),
            "a training checkpoint": self._checkpoint,
            "compat training": self._task_started("compat-op"),
            "the gate": self._task_started("gate-op"),
            "backfill stage 1": self._backfilling(1),
            "backfill stage 3": self._backfilling(3),
        }[point]
        _kill_when(_start(self.config_file, self.log_of(attempt)), ready, point)
        run_dir = _run_dir(self.ws, 1)  # one run of the phase: every attempt continues it
        assert run_dir is not None and not (run_dir / "outcome.json").exists()
        seen: dict[str, Any] = {"run_dir": run_dir, "run": json.loads((run_dir / "run.json").read_text())}
        assert seen["run"]["attempt"] == attempt and run_dir == (self.seen or [seen])[0]["run_dir"]
        if (run_dir / "continual" / "metrics.json").is_file():
            seen["training"] = json.loads((run_dir / "continual" / "metrics.json").read_text())["training"]
        if point.startswith("backfill"):
            seen["rollout"] = json.loads((self.ws / "rollout_state.json").read_text())
            seen["registered"] = _registered(self.config)
        seen["log"] = (run_dir / "pipeline.log").read_text(errors="replace")  # the killed attempt's
        seen["validated"] = (run_dir / "validate" / "validation.json").is_file()
        seen["checkpoints"] = sorted(p.name for p in run_dir.glob("continual/train/checkpoints/step-*"))
        seen["compat_kept"] = (run_dir / "compat" / "compat_model.json").is_file()
        self.seen.append(seen)

    def _last(self) -> None:
        from components.runs import read_state

        attempt = len(KILLS) + 1
        last = _start(self.config_file, self.log_of(attempt))
        assert last.wait(timeout=900) == 0, self.log_of(attempt).read_text()[-3000:]
        run_dir = _run_dir(self.ws, 1)
        assert run_dir is not None
        self.finished = {
            "run_dir": run_dir,
            "run": json.loads((run_dir / "run.json").read_text()),
            "phase": read_state(self.ws).phases["1"].model_dump(),
            "rollout": json.loads((run_dir / "rollout" / "rollout.json").read_text())["rollout"],
        }

    def _task_started(self, name: str) -> Callable[[], bool]:
        def ready() -> bool:
            run_dir = _run_dir(self.ws, 1)
            log = run_dir / "pipeline.log" if run_dir is not None else None  # each attempt starts a new one
            return log is not None and log.is_file() and f"'{name}'" in log.read_text(errors="replace")

        return ready

    def _checkpoint(self) -> bool:
        run_dir = _run_dir(self.ws, 1)
        return run_dir is not None and any((run_dir / "continual" / "train" / "checkpoints").glob("step-*"))

    def _backfilling(self, stage: int) -> Callable[[], bool]:
        def ready() -> bool:
            try:
                state = json.loads((self.ws / "rollout_state.json").read_text())
            except (OSError, ValueError):
                return False
            return state["new_version"] == "2" and state["status"] == "running" and state["stage"] >= stage

        return ready


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> KilledRun:
    return KilledRun(tmp_path_factory.mktemp("killed-run"))


def test_a_run_killed_in_validation_is_left_to_be_continued(killed):
    first = killed.kill("validation")
    assert first["run"]["attempt"] == 1 and first["run"]["phase"] == 1
    assert not first["validated"]  # killed before validation ended


def test_training_killed_after_a_checkpoint_resumes_from_it(killed):
    at_checkpoint = killed.kill("a training checkpoint")  # the same run, its second attempt
    assert at_checkpoint["checkpoints"]
    assert "training" not in at_checkpoint  # killed before training ended
    # The next attempt (killed once compat training started) trained on from the killed one's checkpoint.
    training = killed.kill("compat training")["training"]
    assert training["resumed_from_step"] in (CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY)


def test_a_run_killed_at_the_gate_is_left_to_be_continued(killed):
    at_gate = killed.kill("the gate")
    assert at_gate["run"]["attempt"] == KILLS.index("the gate") + 1
    assert at_gate["compat_kept"]  # compat training finished in this attempt, its model kept


def test_a_run_killed_in_its_backfill_had_registered_its_candidate_once(killed):
    stage_1 = killed.kill("backfill stage 1")
    # trained by the attempt killed at the gate, not again: the resumed run (same run id) hits KFP's cache,
    # which skips the task without a log line
    assert "'gate-op'" in stage_1["log"] and "'compat-op'" not in stage_1["log"], stage_1["log"][-3000:]
    assert stage_1["registered"] == (["1", "2"], {"production": "1", "candidate": "2"})


def test_a_rollout_killed_again_in_its_backfill_is_the_same_rollout_resumed(killed):
    stage_1, stage_3 = killed.kill("backfill stage 1"), killed.kill("backfill stage 3")
    # the second backfill kill interrupted the same rollout, resumed
    assert stage_3["rollout"]["rollout_id"] == stage_1["rollout"]["rollout_id"]
    # the resumed attempt found its weights registered by the killed one: no second version
    assert stage_3["registered"] == stage_1["registered"]


def test_the_run_after_every_kill_finishes_the_phase(killed, task_host):
    done = killed.finish()
    config = killed.config
    assert done["phase"]["status"] == "succeeded" and done["phase"]["run_id"] == done["run"]["run_id"]
    assert done["run_dir"] == killed.kill("validation")["run_dir"]
    assert done["run"]["attempt"] == len(KILLS) + 1
    handed = (Path(done["run_dir"]) / "task-host.log").read_text()  # every attempt's tasks were forked warm
    assert handed.count("tasks handed to the host at") == len(KILLS) + 1
    assert "finish_op" in task_host.read_text()
    rollout = done["rollout"]
    assert rollout["status"] == "completed"
    assert rollout["rollout_id"] == killed.kill("backfill stage 3")["rollout"]["rollout_id"]  # resumed
    gallery = served_gallery(config)
    assert gallery["by_version"] == {"2": 80} == {"2": gallery["count"]}  # one vector per item
    versions, aliases = _registered(config)
    assert versions == ["1", "2"] and aliases["production"] == "2"  # nothing orphaned
    assert not (done["run_dir"] / "continual" / "train" / "checkpoints").exists()  # cleaned when it ended
