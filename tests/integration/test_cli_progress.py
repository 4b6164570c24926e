"""The command line's version, shell completion and quiet import, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from compat import progress
from compat.progress import LINE_MARK

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_version_completion_and_quiet_import(tmp_path: Path) -> None:
    from importlib.metadata import version

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"compatflow {version('compatflow')}"
    assert "--install-completion" in cli("--help").stdout

    src = tmp_path / "src"
    src.mkdir()
    from PIL import Image

    for i in range(6):
        Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(src / f"{i}.png")
        (src / f"{i}.txt").write_text(f"picture {i}")
    env = {progress.EVERY_ENV: "0.0001"}
    loud = cli("data", "import", str(src), "--out", str(tmp_path / "a"), env=env)
    assert loud.returncode == 0, loud.stderr
    assert f"{LINE_MARK}reading 6 files: done, 6 items" in loud.stderr  # not a terminal: plain lines
    quiet = cli("-q", "data", "import", str(src), "--out", str(tmp_path / "b"), env=env)
    assert quiet.returncode == 0 and LINE_MARK not in quiet.stderr, quiet.stderr
