"""Run planning and bookkeeping: which phase a run takes, where its outputs go, how it ended.

A run plans itself from the workspace's phase record (:func:`plan_run`) and records its end there
(:func:`finish_run`), so a scheduled run needs no parameter but the config.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints

from compat.io import read_json_object_or_none, utc_now, write_json_atomic
from components.deployment import Deployment
from components.state.run_dir import RUN_FILE, RunDir
from components.state.workspace import Workspace

log = logging.getLogger(__name__)

RESUMABLE = (None, "failed")  # outcomes of a run that the next run of its phase continues
_SAFE_RUN_ID = re.compile(r"[^A-Za-z0-9_.-]+")


class PlanError(ValueError):
    """The run cannot be planned (no stream, a phase out of range); the message says what to do."""


class StateError(ValueError):
    """The phase record is unreadable, breaks its schema, or is missing or lacks work the workspace holds."""


Status = Literal["succeeded", "rejected", "blocked", "failed"]


class PhaseEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Status
    run_id: str = Field(min_length=1)
    at: str = Field(description="local time the run ended")


class PhaseRecord(BaseModel):
    """The workspace's ``state.json``: the outcome of every phase, by phase number."""

    model_config = ConfigDict(extra="forbid", title="Workspace phase record")
    schema_version: Literal[1] = 1
    phases: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]+$")], PhaseEntry]

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.model_dump(mode="json"))


class _RunDocument(BaseModel):
    """One of a run's own files: read as its model, saved with the keys it was made or read with."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def read(cls, path: Path, lenient: bool = False) -> Self | None:
        """The document at ``path``; None when there is none or, ``lenient``, when it is damaged (logged);
        else a damaged file raises SchemaError naming it and each bad field."""
        from components.state.documents import read_document
        from schemas import SchemaError

        try:
            return read_document(cls, path, "restore it, or run the phase again") if path.is_file() else None
        except SchemaError as err:
            if not lenient:
                raise
            log.warning("%s", err)
            return None

    def write(self, path: Path) -> Path:
        return write_json_atomic(path, self.model_dump(mode="json", exclude_unset=True))


class RunPlan(_RunDocument):
    """``run.json``: a run's phase, folder and shards (:func:`plan_run`); an earlier one lacks the attempt."""

    run_id: str = Field(min_length=1)
    run_dir: str = ""
    job_name: str = ""
    resumed: bool = False
    attempt: int = Field(default=1, ge=1)
    phase: int = Field(ge=0)
    domain: str = ""
    stream_dir: str = ""
    train_shards: list[str] = []
    reference_shards: list[str] = []
    eval_shards: list[str] = []
    gallery_shards: list[str] = []


class StepError(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    message: str
    traceback: list[str] = []


class RunFailure(_RunDocument):
    """``failure.json``: the first step that raised, its error and what to do (:func:`record_failure`)."""

    step: str
    error: StepError
    next_action: str
    at: str | None = None


class RunBlock(_RunDocument):
    """``blocked.json``: the step that stopped the run and why (:func:`components.steps.note_blocked`)."""

    step: str = Field(validation_alias=AliasChoices("step", "stage"))  # "stage": before 0.2
    reason: str = ""


class RunOutcome(_RunDocument):
    """``outcome.json``: how the run ended (:func:`finish_run`), a failed one's step, error and log line."""

    status: Status
    pipeline_state: str = ""
    error: StepError | str | None = Field(default=None, description="the failed step's, else the pipeline's")
    failed_step: str | None = None
    next_action: str | None = None
    pipeline_error: str | None = None
    kfp_run_url: str | None = None
    log: str | None = None
    log_line: int | None = None


def runs_of(ws: Workspace) -> Iterator[tuple[RunDir, RunPlan, RunOutcome | None]]:
    """Every planned run's folder, plan and outcome (None: not finished, or damaged); a run whose plan is
    damaged is skipped (each damaged file logged)."""
    for path in ws.runs_dir.glob(f"*/{RUN_FILE}"):
        run = RunDir(path.parent)
        if plan := RunPlan.read(path, lenient=True):
            yield run, plan, RunOutcome.read(run.outcome_file, lenient=True)


def read_state(workspace: Workspace | str | Path) -> PhaseRecord:
    """The workspace's phase record (an empty one when there is none); errors name it and what to do."""
    from components.state.documents import validated

    path = Workspace.coerce(workspace).state_path
    if not path.is_file():
        return PhaseRecord(phases={})
    try:
        return validated(PhaseRecord, json.loads(path.read_bytes()), str(path))
    except (OSError, ValueError) as err:  # SchemaError too
        raise StateError(
            f"{path} is unreadable or malformed ({err}); rebuild it from the run folders with "
            "`compatflow state rebuild`"
        ) from None


def _refuse_another_index(ws: Workspace) -> None:
    """Refuse a configured index other than the one the workspace's gallery is served from."""
    from components.serving.record import ServingError, check_index_agrees, read_serving

    try:
        check_index_agrees(ws.configured_index_uri, read_serving(ws.serving_path), ws.serving_path)
    except ServingError as error:
        raise PlanError(str(error)) from None


SERVICE_CONNECT_S = 5.0  # a server that accepts no connection within this is refused before any step runs
_DEFAULT_PORTS = {"http": 80, "https": 443, "tcp": 19530, "grpc": 19530}


def connect(uri: str, timeout: float) -> None:
    """Open and close a TCP connection to the server ``uri`` names (OSError if none); a path is left alone."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme in _DEFAULT_PORTS and parts.hostname:
        address = (parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme])
        socket.create_connection(address, timeout=timeout).close()


def _refuse_unreachable_services(deployment: Deployment) -> None:
    """Each configured server must accept a connection now, not after minutes of validation and training."""
    for field, uri in (
        ("index.uri", deployment.index.uri),
        ("registry.tracking_uri", deployment.registry.tracking_uri),
    ):
        try:
            connect(uri or "", SERVICE_CONNECT_S)
        except OSError as error:
            raise PlanError(
                f"{field} {uri} is unreachable ({error}): start that service or correct {field} in the "
                "config; no step has run"
            ) from None


def _refuse_lost_state(deployment: Deployment, state: PhaseRecord) -> None:
    """Refuse a phase record that misses the workspace's work: a finished run of a phase it does not record,
    or a production model while it records nothing. A killed run is not finished: the next run resumes it."""
    ws = Workspace.of(deployment)
    path = ws.state_path
    recorded = state.phases
    unrecorded = sorted(
        {plan.phase for _, plan, outcome in runs_of(ws) if outcome} - {int(k) for k in recorded}
    )
    how = "rebuild it with `compatflow state rebuild`"
    if unrecorded:
        what = "is missing but" if not path.is_file() else "does not record what"
        raise StateError(
            f"{path} {what} the workspace holds: finished runs in {ws.runs_dir} of phase(s) "
            f"{', '.join(map(str, unrecorded))}; starting over would rewrite the history the registry and "
            f"the gallery already hold; {how}"
        )
    if recorded or any(ws.runs_dir.glob(f"*/{RUN_FILE}")):
        return
    from components.adapters.registry import Registry

    registry = Registry(ws, model_name=deployment.registry.model_name)
    production = registry.alias_version("production") if registry.exists() else None
    if production is not None:
        raise StateError(
            f"{path} {'is missing' if not path.is_file() else 'records no phase'} but the registry "
            f"{registry.tracking_uri} serves production version {production}: starting over at phase 0 "
            f"would rewrite that history; restore the run folders under {ws.runs_dir} and {how}, or "
            "run in a new workspace"
        )


def rebuild_state(workspace: Workspace | str | Path) -> PhaseRecord:
    """The phase record rebuilt from each phase's newest finished run folder, written atomically."""
    ws = Workspace.coerce(workspace)
    newest: dict[int, PhaseEntry] = {}
    ended = [(run.outcome_file.stat().st_mtime, plan, end) for run, plan, end in runs_of(ws) if end]
    for when, plan, end in sorted(ended, key=lambda run: run[0]):  # a phase's newest run last
        newest[plan.phase] = _phase_entry(end.status, plan.run_id, when)
    state = PhaseRecord(phases={str(k): v for k, v in sorted(newest.items())})
    state.write(ws.state_path)
    return state


def record_phase(workspace: Workspace | str | Path, phase: int, status: str, run_id: str) -> None:
    """Record a phase's outcome in the workspace's phase record."""
    ws = Workspace.coerce(workspace)
    state = read_state(ws)
    state.phases[str(phase)] = _phase_entry(status, run_id)
    state.write(ws.state_path)


def _phase_entry(status: str, run_id: str, when: float | None = None) -> PhaseEntry:
    """A phase record's entry, ``at`` in local time (``when``: a file's mtime, else now)."""
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when))
    return PhaseEntry(status=status, run_id=run_id, at=at)


DONE_STATUSES = ("succeeded", "rejected")  # a run of the phase again would only repeat the verdict


def run_dir_for(deployment: Deployment, run_id: str) -> Path:
    """The run folder of ``run_id`` (characters a folder name cannot hold replaced)."""
    safe = _SAFE_RUN_ID.sub("-", run_id).strip("-")
    if not safe:
        raise PlanError(f"run id {run_id!r} has no usable characters")
    return Workspace.of(deployment).run_dir(safe)


def interrupted_run(deployment: Deployment, phase: int) -> str | None:
    """The newest run of ``phase`` that never finished (killed) or failed: the next run continues it."""
    found = [
        (run.plan_file.stat().st_mtime, plan.run_id)
        for run, plan, outcome in runs_of(Workspace.of(deployment))
        if plan.phase == phase and (outcome.status if outcome else None) in RESUMABLE
    ]
    return max(found)[1] if found else None


def _archive_attempt(run_dir: Path) -> int:
    """Move the run's last outcome, failure and log into ``attempts/<n>/``; returns n (0: first attempt)."""
    run = RunDir(run_dir)
    previous = [p for p in (run.outcome_file, run.failure_file, run.pipeline_log) if p.is_file()]
    if not previous:
        return 0
    attempts = run.attempts_dir
    n = len(list(attempts.glob("*"))) + 1 if attempts.is_dir() else 1
    run.attempt_dir(n).mkdir(parents=True)
    for path in previous:
        path.rename(run.attempt_dir(n) / path.name)
    return n


def new_run_id(phase: int) -> str:
    """``phase-PP-YYYYmmdd-HHMMSS-xxxxxxxx``: sortable by time, unique within a second (32 random bits)."""
    import secrets

    return f"phase-{phase:02d}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def _shards(stream_dir: Path, manifest: dict[str, Any], phases: range | list[int], split: str) -> list[str]:
    return [str((stream_dir / rel).resolve()) for p in phases for rel in manifest["phases"][p][split]]


def keep_validated(
    workspace: Workspace | str | Path,
    phase: int,
    accepted: Sequence[str | Path],
    splits: dict[str, Sequence[str | Path]] | None = None,
) -> list[str]:
    """Copy a phase's accepted shards into the workspace, atomically replacing an earlier copy, so later
    runs never read quarantined samples; ``splits`` go into folders of their name. Returns train shards."""
    final = Workspace.coerce(workspace).validated_dir(phase)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, shards in {"": accepted, **(splits or {})}.items():
        (tmp / split).mkdir(exist_ok=True)
        for shard in shards:
            shutil.copyfile(shard, tmp / split / Path(shard).name)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return sorted(str(p) for p in final.glob("*.tar"))


def validated_shards(deployment: Deployment, shards: Sequence[str], split: str) -> list[str]:
    """Raw ``shards`` of ``split``, each phase's replaced by what its validation kept (if it kept any)."""
    from compat.data.manifest import load_manifest, phase_urls

    ws, stream_dir = Workspace.of(deployment), Path(deployment.stream.uri)
    manifest = load_manifest(stream_dir)
    wanted = [str(s) for s in shards]
    out: list[str] = []
    claimed: set[str] = set()
    for phase in range(len(manifest["phases"])):
        raw = [s for s in phase_urls(stream_dir, phase, split, manifest) if s in wanted]
        if not raw:
            continue
        claimed.update(raw)
        kept = ws.validated_dir(phase) / split
        if kept.is_dir():
            out += sorted(str(p) for p in kept.glob("*.tar"))
        else:
            log.warning(
                "phase %d has no validated %s shards under %s: using its raw shards", phase, split, kept
            )
            out += raw
    return out + [s for s in wanted if s not in claimed]


def train_shards_of(deployment: Deployment, phase: int, manifest: dict[str, Any] | None = None) -> list[str]:
    """The validated training shards of a finished ``phase``, else its raw ones (with a warning)."""
    kept_dir = Workspace.of(deployment).validated_dir(phase)
    kept = sorted(str(p) for p in kept_dir.glob("*.tar"))
    if kept:
        return kept
    from compat.data.synth import load_manifest

    stream_dir = Path(deployment.stream.uri)
    log.warning("phase %d has no validated shards under %s: using its raw stream shards", phase, kept_dir)
    return _shards(stream_dir, manifest or load_manifest(stream_dir), [phase], "train")


def replay_shards(deployment: Deployment, phase: int, per_phase: int | None = None) -> list[list[str]]:
    """Validated training shards of every phase before ``phase`` (the first ``per_phase`` of each)."""
    return [train_shards_of(deployment, q)[:per_phase] for q in range(phase)]


# Pipeline parameters an operator sets per run: name -> (config section, field); empty keeps the config's.
RUN_PARAMETERS: dict[str, tuple[str, str]] = {
    "training_method": ("training", "method"),
    "training_steps": ("training", "steps"),
    "compat_method": ("compat", "method"),
    "compat_steps": ("compat", "steps"),
    "rollout_fractions": ("rollout", "fractions"),
}


def run_parameters(deployment: Deployment) -> dict[str, Any]:
    """The config's value of every run parameter (the compiled pipeline's defaults)."""
    return {name: getattr(getattr(deployment, s), f) for name, (s, f) in RUN_PARAMETERS.items()}


def with_run_parameters(deployment: Deployment, values: Mapping[str, Any]) -> Deployment:
    """``deployment`` with the run parameters in ``values`` that are not empty (checked as at load)."""
    changes: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if value not in ("", 0, [], None):
            section, key = RUN_PARAMETERS[name]
            changes.setdefault(section, {})[key] = value
    return deployment.with_changes(**changes) if changes else deployment


def plan_run(deployment: Deployment, phase: int = -1, run_id: str = "", job_name: str = "") -> RunPlan | None:
    """The run's plan (phase, run folder, shard lists), written to ``<run_dir>/run.json``; None when every
    phase is done. ``phase`` -1: the next pending one. ``run_id`` "": the phase's interrupted run, else
    ``job_name``, else a new id."""
    from compat.data.synth import load_manifest

    stream_dir = Path(deployment.stream.uri)
    manifest = load_manifest(stream_dir)
    n_phases = len(manifest["phases"])
    state = read_state(Workspace.of(deployment))
    _refuse_lost_state(deployment, state)  # a missing, emptied or stale phase record
    _refuse_another_index(Workspace.of(deployment))
    _refuse_unreachable_services(deployment)
    if phase < 0:  # the lowest phase not done
        done = {int(k) for k, entry in state.phases.items() if entry.status in DONE_STATUSES}
        pending = [p for p in range(n_phases) if p not in done]
        if not pending:
            return None
        phase = pending[0]
    if phase >= n_phases:
        raise PlanError(f"phase {phase} does not exist: {stream_dir}/stream.json lists {n_phases} phases")
    reference = 0 if phase == 0 or deployment.drift.reference_phase == "first" else phase - 1
    resumed = not run_id and interrupted_run(deployment, phase)
    run_id = run_id or resumed or job_name or new_run_id(phase)
    run_dir = run_dir_for(deployment, run_id)
    earlier = RunPlan.read(RunDir(run_dir).plan_file) or RunPlan(run_id=run_id, phase=phase)
    if resumed:
        attempt = _archive_attempt(run_dir) + 1
        log.info("resuming run %s of phase %d (attempt %d)", run_id, phase, attempt)
    else:  # the pipeline's plan step re-plans the run its runner planned: keep the attempt it recorded
        resumed, attempt = earlier.resumed, earlier.attempt
    plan = RunPlan(
        run_id=run_id,
        run_dir=str(run_dir),
        job_name=job_name or earlier.job_name,
        resumed=bool(resumed),
        attempt=attempt,
        phase=phase,
        domain=manifest["phases"][phase]["domain"],
        stream_dir=str(stream_dir.resolve()),
        train_shards=_shards(stream_dir, manifest, [phase], "train"),
        reference_shards=(
            train_shards_of(deployment, reference, manifest)
            if reference < phase
            else _shards(stream_dir, manifest, [reference], "train")
        ),
        eval_shards=_shards(stream_dir, manifest, range(phase + 1), "eval"),
        gallery_shards=_shards(stream_dir, manifest, range(phase + 1), "gallery"),
    )
    plan.write(RunDir(run_dir).plan_file)
    return plan


def run_dir_of_job(deployment: Deployment, run_id: str, job_name: str) -> Path:
    """``run_id``'s run folder, else the one that recorded ``job_name`` (a resumed run keeps its id)."""
    if run_id:
        return run_dir_for(deployment, run_id)
    found = (run.path for run, plan, _ in runs_of(Workspace.of(deployment)) if plan.job_name == job_name)
    return next(found, None) or run_dir_for(deployment, job_name)


def run_outcome(run_dir: Path, pipeline_state: str) -> str:
    """``succeeded``, ``blocked`` (by validation), ``rejected`` (by the gate or the probes) or ``failed``."""
    if pipeline_state.upper() not in ("SUCCEEDED", "SUCCESS"):
        return "failed"
    blocked = RunBlock.read(RunDir(run_dir).blocked_file)
    if blocked is None:
        return "succeeded"
    return "blocked" if blocked.step == "validate" else "rejected"


def finish_run(deployment: Deployment, run_dir: Path, pipeline_state: str, error: str = "") -> RunOutcome:
    """Record the run's outcome in the workspace state and in ``<run_dir>/outcome.json``."""
    run = RunDir(run_dir)
    status = run_outcome(run_dir, pipeline_state)
    outcome = RunOutcome(status=status, pipeline_state=pipeline_state, error=error or None)
    if outcome.status == "failed" and (failure := RunFailure.read(run.failure_file, lenient=True)):
        outcome.failed_step, outcome.next_action = failure.step, failure.next_action
        outcome.error, outcome.pipeline_error = failure.error, error or None
    outcome.write(run.outcome_file)
    if outcome.status not in RESUMABLE:  # nothing left to resume: drop the training checkpoints
        shutil.rmtree(run.training_dir / "checkpoints", ignore_errors=True)
    if plan := RunPlan.read(run.plan_file):
        record_phase(Workspace.of(deployment), plan.phase, outcome.status, plan.run_id)
    return outcome


_CHECKPOINT_ERRORS = (
    "ChecksumError",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CompatError",
    "ProductionModelError",
)


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or what it was raised from) is a full disk or an exceeded quota."""
    import errno

    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


def next_action(step: str, error_type: str, error: BaseException | None = None) -> str:
    """What on-call should do after ``step`` raised ``error_type`` (one sentence)."""
    if disk_full(error):
        return (
            "the disk is full: free space on the filesystem that holds the workspace (df -h names it), then "
            "run again: the run resumes where it stopped, nothing written before is lost"
        )
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


def record_failure(run_dir: Path, step: str, error: BaseException) -> RunFailure:
    """Write ``<run_dir>/failure.json`` (step, exception, what to do next); a run's first failure is kept."""
    import traceback

    path = RunDir(run_dir).failure_file
    if earlier := RunFailure.read(path, lenient=True):  # a damaged one is replaced
        return earlier
    kind, trace = type(error).__name__, traceback.format_exception(error)[-12:]
    failure = RunFailure(
        step=step,
        error=StepError(type=kind, message=str(error), traceback=trace),
        next_action=next_action(step, kind, error),
        at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    try:
        failure.write(path)
    except OSError as exc:  # a full disk: the step's own error goes on up, not this one chained to it
        log.warning("could not record the failure of step %s in %s: %s", step, path, exc)
    return failure


def locate_in_log(log_path: Path, failure: RunFailure) -> int | None:
    """The 1-based line of ``log_path`` where the failure's exception is first printed."""
    if not log_path.is_file():
        return None
    needle = f"{failure.error.type}: "
    first_line = failure.error.message.splitlines()[0] if failure.error.message else ""
    with open(log_path, errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if needle in line and first_line in line:
                return number
    return None


def record_usage(run_dir: Path, step: str, usage: dict[str, Any]) -> Path | None:
    """Write one step's usage to the run's usage folder (a resumed step's replaced); failures are logged."""
    document = {"step": step, "at": utc_now(), "pid": os.getpid(), **usage}
    path = RunDir(run_dir).usage_file(step)
    try:
        return write_json_atomic(path, document)
    except (OSError, ValueError) as exc:  # a full disk must not turn a finished step into a failed one
        log.warning("could not record %s's resource usage in %s: %s", step, path, exc)
        return None


def read_usage(run_dir: Path) -> list[dict[str, Any]]:
    """Every recorded step's usage in the run, in the order the steps ended (unreadable files skipped)."""
    files = sorted(RunDir(run_dir).usage_files, key=lambda p: p.stat().st_mtime)
    return [d for d in map(read_json_object_or_none, files) if d]
