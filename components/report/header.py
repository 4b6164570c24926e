"""The report's header: how the run ended, what it changed, where its records are, the one command that
undoes it (or what to do next), and the report's sha256."""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from components.report.inputs import RUN_FILES, RunInputs, read_source
from components.report.sections import Link
from components.state.run_dir import RunDir

SEAL_MARK = "report-sha256"  # the one line holding the hash; the hash covers every other line
SEAL_SLOT = "{{sha256}}"


@dataclass
class Header:
    outcome: str  # succeeded | blocked | rejected | failed | not finished
    facts: list[tuple[str, str]]
    links: list[Link] = field(default_factory=list)
    next: str = ""  # the undo command, or what to do next
    command: str = ""  # the command itself, when there is one to run


def build(inputs: RunInputs, base: Path) -> Header:
    """The header of the run in ``inputs``; local links relative to ``base``."""
    run = RunDir(inputs.run_dir)
    plan, outcome_doc, failure = (inputs[name].document for name in ("plan", "outcome", "failure"))
    outcome = outcome_doc.status if outcome_doc else "not finished"
    registered = _json(run.registered_file)
    rollout = _json(run.rollout_summary)
    report = inputs.data("compat_report") or {}
    gate = inputs.data("gate") or {}
    state = rollout.get("rollout") if isinstance(rollout.get("rollout"), Mapping) else {}
    first = bool(gate.get("bootstrap")) or (registered.get("tags") or {}).get("method") == "bootstrap"
    old = _version(state.get("previous_query_model")) or _version(report.get("old_model"))
    before = None if first else old
    shipped = str(rollout["version"]) if rollout.get("promoted") and rollout.get("version") else None
    served_after = _version(state.get("query_model")) or _version(rollout.get("query_model")) or shipped
    facts = [("outcome", outcome), ("run", inputs.run_id)]
    if plan:
        facts.append(("phase", str(plan.phase)))
    facts.append(("duration", _duration(run, outcome_doc)))
    facts.append(("production", _change(before, shipped or before, first)))
    facts.append(("serving", _change(before, served_after if shipped else before, first)))
    if registered.get("version"):
        facts.append(("candidate", f"v{registered['version']}"))
    facts += [(k.replace("_", " "), str(report[k])) for k in ("method", "scenario") if k in report]
    facts.append(("gate", str(gate.get("decision", "not run")).upper()))
    if failure:
        facts.append(("failed step", failure.step))
    # a damaged file of the run's own, named
    facts += [("unreadable", " ".join(inputs[n].error.split())) for n in RUN_FILES if inputs[n].error]
    header = Header(outcome, facts, _links(registered, outcome_doc, run, base))
    # the undo command of a run that shipped, else what to do next
    rerun = f"compatflow run --phase {plan.phase if plan else 'N'}"
    kept = f"production v{before} still serves" if before else "production is unchanged"
    if shipped and first:
        header.next = f"v{shipped} is the first production model: there is no earlier version to go back to."
    elif shipped:
        header.command = f"compatflow rollback --workspace {shlex.quote(str(_workspace(run).root))}"
        header.next = (
            f"Undo: production v{shipped} back to v{before or '?'} (registry, serving record, index alias "
            "and lineage together):"
        )
    elif outcome == "rejected":
        header.next = (
            f"Nothing shipped, nothing to undo: {kept}. Next: read why below (release gate or rollout); the "
            "next run moves on to the next phase, or run this one again after changing the method or steps:"
        )
        header.command = rerun
    elif outcome == "blocked":
        header.next = f"Nothing shipped: {kept}. Next: fix the phase's data (Data validation below), then:"
        header.command = rerun
    elif outcome == "failed":
        header.next = (
            f"Next: {failure.next_action if failure else 'see the log, then run again (the run resumes)'}."
        )
    else:
        header.next = "The run has not finished (no outcome recorded): see the pipeline's log."
    return header


def _links(registered: Mapping[str, Any], outcome: Any, run: RunDir, base: Path) -> list[Link]:
    """MLflow run and model version (the tracking server's pages, or local paths), the KFP run when known."""
    links: list[Link] = []
    tracking = str(registered.get("tracking_uri") or "").rstrip("/")
    run_id, version = registered.get("mlflow_run_id"), registered.get("version")
    name = registered.get("model_name") or "compatflow-clip"
    if tracking.startswith(("http://", "https://")):
        if run_id:
            links.append(Link(f"MLflow run {run_id}", f"{tracking}/#/runs/{run_id}"))
        if version:
            links.append(Link(f"model {name} v{version}", f"{tracking}/#/models/{name}/versions/{version}"))
    else:
        source = str(registered.get("source") or "")
        if run_id and source.startswith("file://"):
            links.append(_local(f"MLflow run {run_id} artifacts", Path(source[7:]).parent, base))
        if version:
            links.append(_local(f"model {name} v{version}", _workspace(run).model_dir(version), base))
    links.append(_local("run folder", run.path, base))
    return links + ([Link("KFP run", kfp)] if (kfp := outcome and outcome.kfp_run_url) else [])


def _workspace(run: RunDir) -> Any:
    """The workspace the run folder lies in (``<workspace>/runs/<run_id>``)."""
    from components.state.workspace import Workspace

    return Workspace(run.path.parent.parent)


def _local(text: str, path: Path, base: Path) -> Link:
    href = os.path.relpath(path, base).replace(os.sep, "/")
    return Link(f"{text}: {path}", href, path.exists())


def _version(ref: Any) -> str | None:
    return str(ref["version"]) if isinstance(ref, Mapping) and ref.get("version") is not None else None


def _change(before: str | None, after: str | None, first: bool) -> str:
    if first:
        return f"none -> v{after}" if after else "none"
    if before == after:
        return f"v{before} (unchanged)" if before else "unchanged"
    return f"v{before or '?'} -> v{after}"


def _duration(run: RunDir, outcome: Any) -> str:
    """From the first step's start (its usage record) to the outcome (or the last step's end)."""
    starts, ends = [], []
    for path in run.usage_dir.glob("*.json") if run.usage_dir.is_dir() else ():
        doc = _json(path)
        try:
            end = datetime.fromisoformat(str(doc["at"])).timestamp()
            starts.append(end - float(doc.get("wall_s") or 0))
            ends.append(end)
        except (KeyError, TypeError, ValueError):
            continue
    if outcome and run.outcome_file.is_file():
        ends.append(run.outcome_file.stat().st_mtime)
    if not starts:
        return "-"
    seconds = round(max(ends) - min(starts))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _json(path: Path) -> dict[str, Any]:
    """The JSON object at ``path``, empty when it is missing or unreadable."""
    return read_source(path.name, path).data or {}


def seal(text: str) -> str:
    """``text`` with its hash written into its ``SEAL_MARK`` line: the sha256 of every other line, as
    ``grep -v report-sha256 FILE | sha256sum`` computes it."""
    lines = text.split("\n")
    kept = "".join(line + "\n" for line in lines[:-1] if SEAL_MARK not in line) + lines[-1]
    return text.replace(SEAL_SLOT, hashlib.sha256(kept.encode("utf-8")).hexdigest())
