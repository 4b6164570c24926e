"""Locate and read the stage outputs of a run for the on-call report; a missing stage is "not run"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# file name -> stage directory names preferred when several files share the name
SOURCES = {
    "validation": ("validation.json", ("validate", "validation")),
    "drift": ("drift.json", ("drift",)),
    "metrics": ("metrics.json", ("continual", "train", "training")),
    "compat_report": ("compat_report.json", ("evaluate", "compat")),
    "gate": ("gate.json", ("gate",)),
    "rollout": ("rollout_state.json", ("rollout",)),
    "blocked": ("blocked.json", ()),  # written when a stage stopped the run
}


@dataclass
class Source:
    """One input document: where it was found, its content, or why it could not be read."""

    name: str
    path: Path | None = None
    data: dict[str, Any] | None = None
    error: str | None = None

    @property
    def present(self) -> bool:
        return self.data is not None


@dataclass
class RunInputs:
    run_dir: Path
    sources: dict[str, Source] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def __getitem__(self, name: str) -> Source:
        return self.sources[name]

    def data(self, name: str) -> dict[str, Any] | None:
        return self.sources[name].data


def find(run_dir: Path, filename: str, prefer: tuple[str, ...] = ()) -> Path | None:
    """The best ``filename`` under ``run_dir``: in a preferred stage directory, then shallowest, newest."""
    if not run_dir.is_dir():
        return None
    found = [p for p in run_dir.rglob(filename) if p.is_file()]
    if not found:
        return None

    def rank(path: Path) -> tuple[int, int, float]:
        preferred = 0 if path.parent.name in prefer else 1
        return preferred, len(path.relative_to(run_dir).parts), -path.stat().st_mtime

    return min(found, key=rank)


def load(run_dir: str | Path, *, workspace_root: str | Path | None = None) -> RunInputs:
    """Read every known input of the run in ``run_dir``.

    The rollout state falls back to ``<workspace>/rollout_state.json`` (``workspace_root``, or
    the workspace holding ``runs/<run_id>``) when the run directory has none.
    """
    run_dir = Path(run_dir).resolve()
    inputs = RunInputs(run_dir)
    for name, (filename, prefer) in SOURCES.items():
        path = find(run_dir, filename, prefer)
        if path is None and name == "rollout":
            root = Path(workspace_root) if workspace_root else run_dir.parent.parent
            candidate = root / filename
            path = candidate if run_dir.parent.name == "runs" or workspace_root else None
            path = path if path is not None and path.is_file() else None
        inputs.sources[name] = _read(name, path)
    return inputs


def _read(name: str, path: Path | None) -> Source:
    if path is None:
        return Source(name)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return Source(name, path, error=f"cannot read {path}: {err}")
    if not isinstance(doc, dict):
        return Source(name, path, error=f"{path} is not a JSON object")
    return Source(name, path, data=doc)
