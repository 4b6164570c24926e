"""The console script: fast help, every stage reachable, offline defaults."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMPATFLOW = Path(sys.executable).with_name("compatflow")
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMPATFLOW), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not COMPATFLOW.exists(), reason="console script not installed in this environment")
def test_help_is_fast_and_lists_stages():
    _run("--help")  # warm the file cache
    start = time.perf_counter()
    result = _run("--help")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 1.5, f"compatflow --help took {elapsed:.2f} s"
    for command in ("run", "compile", "drift", "validate", "data"):
        assert command in result.stdout


def test_cli_module_imports_nothing_heavy():
    code = (
        "import sys, pipelines.cli; "
        "heavy = [m for m in ('torch', 'open_clip', 'kfp', 'great_expectations', 'evidently', 'mlflow', "
        "'feast', 'pymilvus', 'pandas') if m in sys.modules]; print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"heavy modules imported by the CLI at start-up: {result.stdout}"


def test_unknown_config_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", "--config", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COMPATFLOW_WORKSPACE": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "nope.yaml" in result.stderr and "neither a file nor a shipped config" in result.stderr


HEAVY = ("torch", "open_clip", "mlflow", "pymilvus", "pandas", "transformers")


def _modules_after(args: list[str], tmp_path: Path) -> tuple[int, list[str]]:
    """The exit code of ``compatflow ARGS`` run in a fresh interpreter, and the heavy modules it imported."""
    code = (
        f"import sys; from pipelines.cli import main; sys.argv = ['compatflow', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit as end:\n"
        f"    print(end.code, [m for m in {HEAVY!r} if m in sys.modules])"
    )
    env = {**os.environ, "COMPATFLOW_WORKSPACE": str(tmp_path / "ws"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    exit_code, modules = result.stdout.strip().splitlines()[-1].split(" ", 1)
    return int(exit_code), eval(modules)  # noqa: S307 - the list this test printed


def test_one_shot_commands_import_nothing_heavy(tmp_path):
    assert _modules_after(["search", "-k", "0", "a red circle"], tmp_path) == (2, [])  # refused first
    assert _modules_after(["status"], tmp_path) == (0, [])  # no registry, no gallery yet: nothing to open
