"""A module of this repository as it was at an earlier commit, imported beside today's to compare the two."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def module_at(commit: str, path: str, work: Path) -> ModuleType:
    """``path`` (from the repository's root) as it was at ``commit``, copied into ``work`` and imported as
    ``<its stem>_before``."""
    show = ["git", "-C", str(ROOT), "show", f"{commit}:{path}"]
    source = subprocess.run(show, capture_output=True, text=True)
    if source.returncode != 0:
        raise SystemExit(f"cannot read {path} at {commit}: {source.stderr.strip()}")
    name = f"{Path(path).stem}_before"
    copy = work / f"{name}.py"
    copy.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
