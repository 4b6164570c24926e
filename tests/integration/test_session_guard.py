"""The test session keeps out of the checkout: it runs in a temporary current folder, and a test that reads
or changes the checkout's workspace (`make run`'s) fails the session, naming the test and the path."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Planted tests, run by a session of their own whose guarded workspace is a stand-in the test makes.
PLANTED = """
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

WORKSPACE = Path(os.environ["COMPATFLOW_TESTS_GUARDED_WORKSPACE"])


def test_reads_the_registry():
    db = sqlite3.connect(WORKSPACE / "mlflow.db")
    assert db.execute("select count(*) from versions").fetchone() == (1,)


def test_a_subprocess_writes_the_state():
    code = f"open({str(WORKSPACE / 'state.json')!r}, 'w').write('{{}}')"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keeps_to_its_own_folders(tmp_path):
    (tmp_path / "mlflow.db").write_text("")
    Path("mlflow.db").write_text("")  # the current folder is the session's own
"""


def test_the_session_runs_outside_the_checkout():
    cwd = Path.cwd().resolve()
    assert cwd != ROOT and ROOT not in cwd.parents


def test_a_planted_read_or_write_of_the_checkouts_workspace_fails_the_session(tmp_path):
    workspace = tmp_path / "checkout" / "workspace"
    workspace.mkdir(parents=True)
    with sqlite3.connect(workspace / "mlflow.db") as db:
        db.execute("create table versions (v int)")
        db.execute("insert into versions values (5)")
    db.close()
    (tmp_path / "planted").mkdir()
    planted = tmp_path / "planted" / "test_planted.py"
    planted.write_text(PLANTED)
    (tmp_path / "planted" / "pytest.ini").write_text("[pytest]\n")
    env = {
        **os.environ,
        "COMPATFLOW_TESTS_GUARDED_WORKSPACE": str(workspace),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", str(planted)]
    done = subprocess.run(
        argv, cwd=tmp_path / "planted", env=env, capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "3 passed, 2 errors" in out, out
    read = f"test_reads_the_registry touched the checkout's workspace {workspace}: sqlite3.connect"
    assert read in out, out
    assert "the tests read or changed the checkout's workspace" in out and "added: state.json" in out, out
    assert "test_keeps_to_its_own_folders touched" not in out, out
