"""Run planning and bookkeeping: which phase a run takes, where its outputs go, how it ended.

The workspace's ``state.json`` records every phase's outcome. A run plans itself from it
(:func:`plan_run`: the lowest phase not yet succeeded, or an explicit one) and records its end
(:func:`finish_run`, the pipeline's exit handler), so a scheduled run on a cluster needs no
parameter but the config, and a local run continues where the last one stopped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compat.io import write_json_atomic

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
RUN_FILE = "run.json"
VALIDATED_DIR = "validated"
BLOCKED_FILE = "blocked.json"
FAILURE_FILE = "failure.json"
OUTCOME_FILE = "outcome.json"
_SAFE_RUN_ID = re.compile(r"[^A-Za-z0-9_.-]+")


class PlanError(ValueError):
    """The run cannot be planned (no stream, a phase out of range); the message says what to do."""


def read_state(workspace: Path) -> dict[str, Any]:
    path = Path(workspace) / STATE_FILE
    if not path.is_file():
        return {"schema_version": 1, "phases": {}}
    return json.loads(path.read_text())


def record_phase(workspace: Path, phase: int, status: str, run_id: str) -> dict[str, Any]:
    """Record a phase's outcome; returns the new state."""
    state = read_state(workspace)
    state["phases"][str(phase)] = {
        "status": status,
        "run_id": run_id,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json_atomic(Path(workspace) / STATE_FILE, state)
    return state


DONE_STATUSES = ("succeeded", "rejected")


def next_pending_phase(state: dict[str, Any], n_phases: int) -> int | None:
    """The lowest phase not yet done.

    Done: ``succeeded`` (the candidate shipped) or ``rejected`` (the gate or a rollout probe refused the
    candidate: the phase was learnt from and judged; the same seeds would only repeat the verdict, and
    the next phase's run starts again from production). Retried: ``blocked`` (data validation refused
    the phase: fix the shards) and ``failed``.
    """
    for phase in range(n_phases):
        if state["phases"].get(str(phase), {}).get("status") not in DONE_STATUSES:
            return phase
    return None


def run_dir_for(config: dict[str, Any], run_id: str) -> Path:
    safe = _SAFE_RUN_ID.sub("-", run_id).strip("-")
    if not safe:
        raise PlanError(f"run id {run_id!r} has no usable characters")
    return Path(config["workspace"]).resolve() / "runs" / safe


def new_run_id(phase: int) -> str:
    """``phase-PP-YYYYmmdd-HHMMSS-xxxx``: sortable by time, unique even for runs started in one second."""
    import secrets

    return f"phase-{phase:02d}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _shards(stream_dir: Path, manifest: dict[str, Any], phases: range | list[int], split: str) -> list[str]:
    return [str((stream_dir / rel).resolve()) for p in phases for rel in manifest["phases"][p][split]]


def validated_dir(workspace: str | Path, phase: int) -> Path:
    """Where the accepted training shards of ``phase`` are kept once its validation passed."""
    return Path(workspace).resolve() / VALIDATED_DIR / f"phase-{phase:03d}"


def keep_validated(workspace: str | Path, phase: int, accepted: Sequence[str | Path]) -> list[str]:
    """Copy a phase's accepted shards into the workspace (atomically replacing an earlier copy).

    Later runs replay and compare against these, never the raw stream, whose rejected samples stay in
    quarantine. Returns the kept paths.
    """
    final = validated_dir(workspace, phase)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for shard in accepted:
        shutil.copyfile(shard, tmp / Path(shard).name)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return sorted(str(p) for p in final.glob("*.tar"))


def train_shards_of(config: dict[str, Any], phase: int, manifest: dict[str, Any] | None = None) -> list[str]:
    """The validated training shards of a finished ``phase``; its raw stream shards (with a warning) when
    the workspace holds no validated copy (a workspace from before copies were kept)."""
    kept = sorted(str(p) for p in validated_dir(config["workspace"], phase).glob("*.tar"))
    if kept:
        return kept
    from compat.data.synth import load_manifest

    stream_dir = Path(config["stream"]["uri"])
    log.warning(
        "phase %d has no validated shards under %s: using its raw stream shards",
        phase,
        validated_dir(config["workspace"], phase),
    )
    return _shards(stream_dir, manifest or load_manifest(stream_dir), [phase], "train")


def replay_shards(config: dict[str, Any], phase: int, per_phase: int | None = None) -> list[list[str]]:
    """Validated training shards of every phase before ``phase`` (the first ``per_phase`` of each)."""
    return [train_shards_of(config, q)[:per_phase] for q in range(phase)]


def plan_run(config: dict[str, Any], phase: int = -1, run_id: str = "") -> dict[str, Any] | None:
    """The plan of a run: its phase, run directory and every shard list the stages read.

    ``phase`` -1 takes the next pending phase; ``run_id`` "" makes one from the phase and the time.
    Returns None when every phase has succeeded. Writes ``<run_dir>/run.json``.
    """
    from compat.data.synth import load_manifest

    stream_dir = Path(config["stream"]["uri"])
    manifest = load_manifest(stream_dir)
    n_phases = len(manifest["phases"])
    workspace = Path(config["workspace"]).resolve()
    if phase < 0:
        pending = next_pending_phase(read_state(workspace), n_phases)
        if pending is None:
            return None
        phase = pending
    if phase >= n_phases:
        raise PlanError(f"phase {phase} does not exist: {stream_dir}/stream.json lists {n_phases} phases")
    reference = 0 if phase == 0 or config["drift"]["reference_phase"] == "first" else phase - 1
    run_id = run_id or new_run_id(phase)
    plan = {
        "run_id": run_id,
        "run_dir": str(run_dir_for(config, run_id)),
        "phase": phase,
        "domain": manifest["phases"][phase]["domain"],
        "stream_dir": str(stream_dir.resolve()),
        "train_shards": _shards(stream_dir, manifest, [phase], "train"),
        "reference_shards": (
            train_shards_of(config, reference, manifest)
            if reference < phase
            else _shards(stream_dir, manifest, [reference], "train")
        ),
        "eval_shards": _shards(stream_dir, manifest, range(phase + 1), "eval"),
        "gallery_shards": _shards(stream_dir, manifest, range(phase + 1), "gallery"),
    }
    write_json_atomic(Path(plan["run_dir"]) / RUN_FILE, plan)
    return plan


def run_outcome(run_dir: Path, pipeline_state: str) -> str:
    """``succeeded``, ``blocked`` (validation stopped it), ``rejected`` (the gate or the rollout's probes
    refused the candidate) or ``failed``."""
    if pipeline_state.upper() not in ("SUCCEEDED", "SUCCESS"):
        return "failed"
    blocked = Path(run_dir) / BLOCKED_FILE
    if not blocked.is_file():
        return "succeeded"
    return "blocked" if json.loads(blocked.read_text()).get("stage") == "validate" else "rejected"


def finish_run(config: dict[str, Any], run_dir: Path, pipeline_state: str, error: str = "") -> dict[str, Any]:
    """Record the run's outcome in the workspace state and in ``<run_dir>/outcome.json``."""
    run_dir = Path(run_dir)
    plan_path = run_dir / RUN_FILE
    outcome = {
        "status": run_outcome(run_dir, pipeline_state),
        "pipeline_state": pipeline_state,
        "error": error or None,
    }
    failure = read_failure(run_dir) if outcome["status"] == "failed" else None
    if failure is not None:
        outcome.update(
            failed_step=failure["step"],
            error=failure["error"],
            next_action=failure["next_action"],
            pipeline_error=error or None,
        )
    write_json_atomic(run_dir / OUTCOME_FILE, outcome)
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        record_phase(Path(config["workspace"]).resolve(), plan["phase"], outcome["status"], plan["run_id"])
    return outcome


# --------------------------------------------------------------------------------------------- failures
_CHECKPOINT_ERRORS = (
    "ChecksumError",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CompatError",
    "ProductionModelError",
)


def next_action(step: str, error_type: str) -> str:
    """What on-call should do after ``step`` raised ``error_type`` (one sentence)."""
    if error_type in _CHECKPOINT_ERRORS:
        return (
            "a model file failed its integrity check: delete the named model folder under workspace/models "
            "(the next run downloads it again from the registry and verifies it), or `compatflow rollback` "
            "to the previous production model"
        )
    if step == "rollout":
        return (
            "run again: the rollout resumes from its cursor with its own configuration; or undo it with "
            "`compatflow rollout rollback`"
        )
    if step == "validate" or error_type in ("ValidationError", "ShardError"):
        return "fix the phase's shards named above, then run again (the phase is retried)"
    if error_type in ("ConfigError", "PlanError"):
        return "fix the configuration or the stream named above, then run again"
    return (
        "run again (the phase is retried); if it fails the same way, fix the cause named above, "
        "or `compatflow rollback` if production itself is at fault"
    )


def record_failure(run_dir: Path, step: str, error: BaseException) -> dict[str, Any]:
    """Write ``<run_dir>/failure.json``: the step that raised, the exception and what to do next.

    The first failure of a run is kept (a later step failing because of it would only hide the cause).
    """
    import traceback

    path = Path(run_dir) / FAILURE_FILE
    if path.is_file():
        return json.loads(path.read_text())
    error_type = type(error).__name__
    document = {
        "step": step,
        "error": {
            "type": error_type,
            "message": str(error),
            "traceback": traceback.format_exception(error)[-12:],
        },
        "next_action": next_action(step, error_type),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json_atomic(path, document)
    return document


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``failure.json`` (None when no step recorded a failure or the file is unreadable)."""
    path = Path(run_dir) / FAILURE_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def locate_in_log(log_path: Path, failure: dict[str, Any]) -> int | None:
    """The 1-based line of ``log_path`` where the failure's exception is printed (its last traceback line)."""
    if not log_path.is_file():
        return None
    needle = f"{failure['error']['type']}: "
    first_line = failure["error"]["message"].splitlines()[0] if failure["error"]["message"] else ""
    found = None
    with open(log_path, errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if needle in line and first_line in line:
                found = found or number
    return found
