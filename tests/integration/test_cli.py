"""The console script: fast help, every stage reachable, offline defaults."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMPATFLOW = Path(sys.executable).with_name("compatflow")


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
