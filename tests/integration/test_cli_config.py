"""The command line refuses a bad config within seconds, naming the field."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _pipelines import write_local_config


def test_compatflow_run_refuses_a_bad_config_within_seconds(tmp_path):
    compatflow = Path(sys.executable).with_name("compatflow")
    if not compatflow.is_file():
        pytest.skip(f"no compatflow console script beside {sys.executable}")

    def change(document):
        document["workspace"] = str(tmp_path / "ws")
        document["stream"]["uri"] = str(tmp_path / "ws" / "stream")
        document["rollout"]["fractions"] = [0.5, 0.25, 1.0]
        document["compat"]["options"] = {}  # method options are checked by importing torch (seconds)

    path = write_local_config(tmp_path / "bad.yaml", change)
    start = time.monotonic()
    result = subprocess.run(
        [str(compatflow), "run", "--config", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"{path}: rollout.fractions must increase strictly within (0, 1]" in result.stderr, result.stderr
    assert elapsed < 5, f"the bad config took {elapsed:.1f} s to refuse"
    assert not (tmp_path / "ws").exists()  # nothing ran
