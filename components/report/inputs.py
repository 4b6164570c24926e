"""Locate and read a run's step outputs and own files for the on-call report; a missing step is "not run"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.state import run_dir as files

# file name -> step directory names preferred when several files share the name (the step's own first, then
# the names of earlier versions)
SOURCES = {
    "validation": (files.VALIDATION_FILE, ("validate", "validation")),
    "drift": (files.DRIFT_FILE, ("drift",)),
    "metrics": (files.METRICS_FILE, ("continual", "train", "training")),
    "compat_report": (files.COMPAT_REPORT_FILE, ("evaluate", "compat")),
    "gate": (files.GATE_FILE, ("gate",)),
    "rollout": (files.ROLLOUT_STATE_FILE, ("rollout",)),
    "examples": (files.EXAMPLES_FILE, ("rollout",)),  # retrieval examples (components.steps.examples)
}
RUN_FILES = ("plan", "outcome", "failure", "blocked")  # the run's own files, read through their models


@dataclass
class Source:
    """One input document: where it was found, its content (``document``: the model of one of the run's own
    files, :mod:`components.runs`), or why it could not be read."""

    name: str
    path: Path | None = None
    data: dict[str, Any] | None = None
    error: str | None = None
    document: Any = None


@dataclass
class RunInputs:
    run_dir: Path
    sources: dict[str, Source] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def __getitem__(self, name: str) -> Source:
        """The input ``name`` (one not loaded is simply not there: "not run")."""
        return self.sources.get(name) or Source(name)

    def data(self, name: str) -> dict[str, Any] | None:
        return self[name].data


def find(run_dir: Path, filename: str, prefer: tuple[str, ...] = ()) -> Path | None:
    """The best ``filename`` under ``run_dir``: in a preferred step directory, then shallowest, newest."""

    def rank(path: Path) -> tuple[int, int, float]:
        preferred = 0 if path.parent.name in prefer else 1
        return preferred, len(path.relative_to(run_dir).parts), -path.stat().st_mtime

    return min((p for p in run_dir.rglob(filename) if p.is_file()), key=rank, default=None)


def load(run_dir: str | Path) -> RunInputs:
    """Read every known input of the run in ``run_dir`` (only this run's: a run that did not roll a model
    out shows no rollout, whatever the workspace's last rollout was)."""
    from components.runs import RunBlock, RunFailure, RunOutcome, RunPlan
    from schemas import SchemaError

    run_dir = Path(run_dir).resolve()
    inputs = RunInputs(run_dir)
    for name, (filename, prefer) in SOURCES.items():
        inputs.sources[name] = read_source(name, find(run_dir, filename, prefer))
    run = files.RunDir(run_dir)
    own = {
        "plan": (RunPlan, run.plan_file),
        "outcome": (RunOutcome, run.outcome_file),
        "failure": (RunFailure, run.failure_file),  # a step raised (components.runs.record_failure)
        "blocked": (RunBlock, run.blocked_file),  # a step stopped the run (components.steps.note_blocked)
    }
    for name in RUN_FILES:
        model, path = own[name]
        try:
            inputs.sources[name] = Source(name, path, document=model.read(path))
        except SchemaError as err:  # the report names it and shows the rest
            inputs.sources[name] = Source(name, path, error=str(err))
    return inputs


def read_source(name: str, path: Path | None) -> Source:
    """The JSON object at ``path``: its content, or why it cannot be read (not there: "not run")."""
    if path is None:
        return Source(name)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return Source(name, path, error=f"cannot read {path}: {err}")
    if not isinstance(doc, dict):
        return Source(name, path, error=f"{path} is not a JSON object")
    return Source(name, path, data=doc)
