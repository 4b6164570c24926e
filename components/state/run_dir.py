"""The layout of one run's folder, ``<workspace>/runs/<run_id>/``: :class:`RunDir` names every file and step
folder a run holds, and the module's constants spell each file name once (a test greps the other modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The run's own files, at the top of its folder.
RUN_FILE = "run.json"
# The rollout state's file name: the live one at the workspace root (Workspace.rollout_state_path), the
# copies a rollout archives in its work folder and the one a run keeps for its report.
ROLLOUT_STATE_FILE = "rollout_state.json"
OUTCOME_FILE = "outcome.json"
FAILURE_FILE = "failure.json"
BLOCKED_FILE = "blocked.json"
PIPELINE_LOG = "pipeline.log"
TASK_HOST_LOG = "task-host.log"
USAGE_DIR = "usage"  # step-<name>.json per step: what it cost; no other file's name
ATTEMPTS_DIR = "attempts"  # earlier attempts of a resumed run: their outcome, failure and log

# What the steps write, in their own folder of the run and in their output artifacts alike.
VALIDATION_FILE = "validation.json"
DRIFT_FILE = "drift.json"
DRIFT_REPORT_FILE = "drift_report.html"
METRICS_FILE = "metrics.json"
SPATIAL_DISORDER_FILE = "spatial_disorder.json"
COMPAT_RECORD_FILE = "compat_model.json"
COMPAT_REPORT_FILE = "compat_report.json"
GATE_FILE = "gate.json"
REGISTERED_FILE = "registered.json"
INGEST_FILE = "ingest.json"
ROLLOUT_FILE = "rollout.json"
EXAMPLES_FILE = "examples.json"


def report_file_name(fmt: str) -> str:
    """``report.<fmt>``: the on-call report's file in one format (``html``, ``md``)."""
    return f"report.{fmt}"


def _at(*parts: str) -> property:
    """A :class:`RunDir` path: ``parts`` under the run's folder."""
    return property(lambda run: run.path.joinpath(*parts))


@dataclass(frozen=True)
class RunDir:
    """One run's folder; creates nothing. Each step writes into the folder named after it; who writes what:

    - ``run.json``, ``outcome.json``, ``failure.json``, ``blocked.json``: the plan, how the run ended, the
      first step that raised, the step that stopped the run (each read and written by its model, runs.py);
    - ``pipeline.log``: every task's output (the local runner);
    - ``task-host.log``: the warm task host's preloads and the tasks it forked (the local runner);
    - ``usage/step-<step>.json``: what each step cost (any step, ``record_usage``);
    - ``attempts/<n>/``: a resumed run's earlier outcome, failure and log (``plan_run``);
    - ``validate/validation.json``: the validation summary (validate);
    - ``drift/drift.json``, ``drift/drift_report.html``: drift summary and Evidently report (drift);
    - ``continual/metrics.json``, ``spatial_disorder.json``, ``train/``: curve, SD, checkpoints (continual);
    - ``compat/model/``, ``compat/compat_model.json``: the compatible model and its record (compat);
    - ``evaluate/compat_report.json``: compatibility matrix and margins (evaluate);
    - ``gate/gate.json``: the release decision (gate, or the first model's bootstrap record at register);
    - ``register/registered.json``: the registered version (register);
    - ``ingest/ingest.json``: the phase's new items indexed (ingest);
    - ``rollout/rollout.json``, ``rollout_state.json``, ``examples.json``: the rollout, its final state and
      retrieval examples (rollout, or the first model's indexing);
    - ``report/report.html``, ``report/report.md``: the on-call report (the exit handler).
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def coerce(cls, value: RunDir | str | Path) -> RunDir:
        """A :class:`RunDir` from a run dir or its path."""
        return value if isinstance(value, RunDir) else cls(Path(value))

    @property
    def run_id(self) -> str:
        """The run's id: its folder's name."""
        return self.path.name

    # the run's own files
    plan_file = _at(RUN_FILE)
    outcome_file = _at(OUTCOME_FILE)
    failure_file = _at(FAILURE_FILE)
    blocked_file = _at(BLOCKED_FILE)
    pipeline_log = _at(PIPELINE_LOG)
    task_host_log = _at(TASK_HOST_LOG)
    usage_dir = _at(USAGE_DIR)
    attempts_dir = _at(ATTEMPTS_DIR)
    # the steps' outputs
    validation_summary = _at("validate", VALIDATION_FILE)
    drift_dir = _at("drift")
    drift_summary = _at("drift", DRIFT_FILE)
    drift_report = _at("drift", DRIFT_REPORT_FILE)
    continual_dir = _at("continual")
    continual_metrics = _at("continual", METRICS_FILE)
    training_dir = _at("continual", "train")  # resumable checkpoints, removed when the run ends
    compat_model_dir = _at("compat", "model")
    compat_record = _at(
        "compat", COMPAT_RECORD_FILE
    )  # what trained compat_model_dir (a resumed run reuses it)
    compat_report = _at("evaluate", COMPAT_REPORT_FILE)
    gate_file = _at("gate", GATE_FILE)
    registered_file = _at("register", REGISTERED_FILE)
    ingest_summary = _at("ingest", INGEST_FILE)
    rollout_dir = _at("rollout")
    rollout_summary = _at("rollout", ROLLOUT_FILE)
    rollout_state = _at("rollout", ROLLOUT_STATE_FILE)
    examples_file = _at("rollout", EXAMPLES_FILE)
    report_dir = _at("report")

    def usage_file(self, step: str) -> Path:
        return self.usage_dir / f"step-{step}.json"

    @property
    def usage_files(self) -> list[Path]:
        """Every step's usage file present, in no particular order."""
        return list(self.usage_dir.glob("step-*.json")) if self.usage_dir.is_dir() else []

    def attempt_dir(self, number: int) -> Path:
        return self.attempts_dir / str(number)

    def report_file(self, fmt: str = "html") -> Path:
        return self.report_dir / report_file_name(fmt)

    def holds_a_run(self) -> bool:
        """Whether the folder holds a run's own files: its plan, outcome or log, or a step's output."""
        own = (self.plan_file, self.outcome_file, self.pipeline_log)
        steps = (self.validation_summary, self.gate_file, self.compat_report, self.rollout_state)
        return any(mark.is_file() for mark in (*own, *steps))
