"""Run the pipeline on this machine with ``kfp.local.SubprocessRunner`` (``compatflow run``, ``make run``).

The task logs go to ``<run_dir>/pipeline.log``; only task start/finish and progress lines are echoed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat.progress import LINE_MARK
from components.deployment import Deployment
from components.runs import RunFailure
from components.state.lock import workspace_lock
from components.state.run_dir import RunDir
from components.state.workspace import Workspace

logger = logging.getLogger(__name__)

_ECHO = re.compile(r"(Executing task|finished with status|Pipeline .* finished)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class RunResult:
    run_id: str
    phase: int
    run_dir: Path
    status: str  # "succeeded" | "rejected" | "blocked" | "failed" | "nothing-to-do" (components.runs)
    outputs: dict[str, str] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # failed runs: step, error, next_action, log, log_line


class _EchoingLog(io.TextIOBase):
    """Writes everything to the log file and echoes task start/finish and progress lines (on a terminal, in
    place). A log file that cannot be written fails nothing: its first error is kept in ``error``."""

    def __init__(self, log_file: io.TextIOBase, terminal: Any) -> None:
        self._log, self._terminal, self._pending = log_file, terminal, ""
        self._live, self._status = _isatty(terminal), False
        self.error: OSError | None = None

    def _to_file(self, write: Any) -> None:
        if self.error is not None:
            return
        try:
            write()
        except OSError as exc:
            self.error = exc

    def write(self, text: str) -> int:
        self._to_file(lambda: self._log.write(text))
        self._pending += text
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            progress = LINE_MARK in line
            if not progress and not _ECHO.search(line):
                continue
            shown = "  " + _ANSI.sub("", line.split(LINE_MARK, 1)[-1]).strip()
            if progress and self._live:  # one status line, rewritten in place
                self._terminal.write("\r\x1b[K" + shown[: shutil.get_terminal_size().columns - 1])
            else:
                self._terminal.write(("\r\x1b[K" if self._status else "") + shown + "\n")
            self._status = progress and self._live
            self._terminal.flush()
        return len(text)

    def flush(self) -> None:
        self._to_file(self._log.flush)

    def close_file(self) -> None:
        """Close the log file (what it could not write is lost with it, the error kept)."""
        self._to_file(self._log.close)
        with contextlib.suppress(OSError):
            self._log.close()


def _isatty(stream: Any) -> bool:
    with contextlib.suppress(AttributeError, ValueError):
        return bool(stream.isatty())
    return False


def ensure_stream(deployment: Deployment) -> Path:
    """The stream directory, generated with the config's defaults when missing and allowed."""
    from compat.data.synth import load_manifest
    from pipelines.config import generate_stream_of

    stream = deployment.stream
    stream_dir = Path(stream.uri)
    if not (stream_dir / "stream.json").is_file():
        if not stream.generate_if_missing:
            raise FileNotFoundError(
                f"{stream_dir / 'stream.json'} not found and stream.generate_if_missing is false: "
                "point stream.uri at a stream directory or run `compatflow data generate`"
            )
        logger.info("generating the default stream into %s", stream_dir)
        generate_stream_of(stream, stream_dir)
    load_manifest(stream_dir)
    return stream_dir


def run_local(deployment: Deployment, *, phase: int | None = None, echo: Any = None) -> RunResult:
    """Run the pipeline on the next pending phase (or ``phase``), holding the workspace lock throughout."""
    workspace = Workspace.of(deployment)
    with workspace_lock(workspace, f"compatflow run (phase {'next' if phase is None else phase})"):
        return _run_locked(deployment, workspace, phase, echo)


def _run_locked(deployment: Deployment, workspace: Any, phase: int | None, echo: Any) -> RunResult:
    from kfp import local

    from components.runs import plan_run, read_state
    from pipelines.compile import build_pipeline
    from pipelines.resources import task_settings
    from pipelines.warm_tasks import on_host, warm_task_host

    echo = echo or sys.stderr
    ensure_stream(deployment)
    plan = plan_run(deployment, -1 if phase is None else phase)
    if plan is None:
        return RunResult("", -1, workspace.root, "nothing-to-do")
    run_dir = Path(plan.run_dir)
    tmp = workspace.tmp_dir
    tmp.mkdir(exist_ok=True)
    # the tasks' temp files (kfp's program folder among them) stay in the workspace
    env = {"TMPDIR": str(tmp)}
    if _isatty(echo):  # tasks write progress lines (their output is a pipe); a terminal shows them live
        from compat.progress import EVERY_ENV

        env[EVERY_ENV] = os.environ.get(EVERY_ENV, "2")
    echo.write(f"compatflow: run {plan.run_id} on phase {plan.phase} ({plan.domain})\n")

    # The warm task host starts importing now, while this process builds the pipeline.
    with warm_task_host(tmp / "task-host", RunDir(run_dir).task_host_log) as host:
        # Caching as on the cluster (pipelines.resources.CACHEABLE): a resumed run keeps its run id, so the
        # steps its killed attempt finished are skipped (cache under <workspace>/kfp/.kfp_cache).
        local.init(
            runner=local.SubprocessRunner(use_venv=False),
            pipeline_root=str(workspace.kfp_dir),
            workspace_root=str(tmp),
            raise_on_error=True,
            enable_caching=True,
        )
        pipeline = on_host(build_pipeline(task_settings(deployment, runner="local")), host, env)
        log_path = RunDir(run_dir).pipeline_log
        # line-buffered: the exit handler's report reads the failed task's traceback while the file is open
        log = _EchoingLog(open(log_path, "w", buffering=1), echo)
        broke: OSError | None = None  # kfp's own files (the pipeline root) could not be written
        failed_task: str | None = None  # the task kfp.local names as failed
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(log):
                warnings.filterwarnings("ignore", message=".*non-Python base image.*")
                warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
                try:
                    pipeline(config=deployment.to_json(), phase=plan.phase, run_id=plan.run_id)
                except RuntimeError as err:  # kfp.local raises when a task fails; the exit handler has run
                    log.write(f"\npipeline failed: {err}\n")
                    failed_task = str(err)
                except OSError as err:
                    broke = err
                    log.write(f"\npipeline failed: {err}\n")
        finally:
            log.close_file()
    recorded = read_state(workspace).phases.get(str(plan.phase))
    status = recorded.status if recorded and recorded.run_id == plan.run_id else "failed"
    report = RunDir(run_dir).report_file("html")
    outputs = {"log": str(log_path), "run_dir": str(run_dir), "report": str(report)}
    unwritten = broke or log.error
    failure = None
    if status == "failed" or broke is not None:
        status, failure = "failed", _failure_of(run_dir, log_path, unwritten, failed_task)
    elif unwritten is not None:
        echo.write(f"compatflow: the run's log {log_path} is incomplete: {unwritten}\n")
    return RunResult(plan.run_id, plan.phase, run_dir, status, outputs, failure)


def _failure_of(
    run_dir: Path, log_path: Path, unwritten: OSError | None = None, failed_task: str | None = None
) -> dict[str, Any]:
    """The failed step and its error, with the log line to look at (also written into ``outcome.json``).
    ``unwritten``: what kept the run's files from being written; ``failed_task``: kfp.local's failure."""
    from components.runs import RunOutcome, StepError, disk_full, locate_in_log, next_action

    run = RunDir(run_dir)
    recorded = RunFailure.read(run.failure_file, lenient=True)
    failure = recorded or _unrecorded_failure(log_path, failed_task or "")
    if unwritten is not None and failure.step == "unknown":
        failure.error = StepError(type=type(unwritten).__name__, message=str(unwritten))
    if disk_full(unwritten):
        failure.next_action = next_action(failure.step, "", unwritten)
    at = {"log": str(log_path), "log_line": locate_in_log(log_path, failure)}
    try:
        if outcome := RunOutcome.read(run.outcome_file):
            outcome.model_copy(update=at).write(run.outcome_file)
    except (OSError, ValueError) as exc:  # a full disk (or a damaged outcome): the failure is still printed
        logger.warning("could not update %s: %s", run.outcome_file, exc)
    unwritten_at = {"unwritten": f"{log_path.parent}: {unwritten}"} if unwritten is not None else {}
    return {**failure.model_dump(), **unwritten_at, **at}


def _unrecorded_failure(log_path: Path, failed_task: str) -> RunFailure:
    """A failure no step recorded: the step kfp.local names (else ``unknown``), and why, if the log says."""
    found = re.search(r"Inner task failed: \W*'([\w-]+)'", _ANSI.sub("", failed_task))
    step = re.sub(r"-op(-\d+)?$", "", found.group(1)) if found else "unknown"
    try:
        host_died = "the warm task host ended while task" in log_path.read_text(errors="replace")
    except OSError:
        host_died = False
    if host_died:
        error = {"type": "TaskHostDied", "message": f"the warm task host ended while {step} ran: see the log"}
    elif found:
        error = {"type": "TaskFailed", "message": f"{step} ended without recording its error: see the log"}
    else:
        error = {"type": "PipelineError", "message": "no step recorded a failure: see the log"}
    return RunFailure(step=step, error=error, next_action="read the log, then run again")
