"""The tree passes ruff (lint and format) with the project's settings."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["compat", "components", "pipelines", "schemas", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PACKAGES], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, f"ruff {' '.join(command)} found problems:\n{result.stdout}{result.stderr}"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root)}
    )


def test_import_contracts_hold() -> None:
    """The layer table (README, Architecture) as import-linter contracts in pyproject.toml."""
    result = _lint_imports(ROOT)
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}{result.stderr}"
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") >= 4


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("compat/metrics/retrieval.py", "import components.adapters.index  # planted\n"),
        ("compat/io.py", "import mlflow  # planted\n"),
        ("components/adapters/index.py", "import components.rollout.engine  # planted\n"),
        ("components/state/workspace.py", "import components.steps.base  # planted\n"),
        ("compat/methods/model.py", "import compat.production  # planted\n"),
        (
            "components/adapters/registry/versions.py",
            "import components.rollout.production_rollback  # planted\n",
        ),
        ("components/state/lock.py", "import components.adapters.index  # planted\n"),
        ("components/data/drift.py", "import components.serving.record  # planted\n"),
        ("components/serving/app.py", "import components.rollout.state  # planted\n"),
        ("components/runs.py", "import components.rollout.plan  # planted\n"),
    ],
    ids=[
        "library-imports-components",
        "library-imports-a-service",
        "adapter-imports-engine",
        "step-import",
        "method-imports-the-production-contract",
        "registry-reaches-the-rollout",
        "state-imports-an-adapter",
        "engine-imports-a-sibling",
        "service-reaches-the-rollout",
        "run-planning-imports-its-sibling",
    ],
)
def test_a_planted_upward_import_is_refused(tmp_path, module: str, planted: str) -> None:
    import shutil

    copy = tmp_path / "tree"
    copy.mkdir()
    for name in ("pyproject.toml", *PACKAGES):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(source, copy / name)
    target = copy / module
    target.write_text(planted + target.read_text())
    result = _lint_imports(copy)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-2000:]
