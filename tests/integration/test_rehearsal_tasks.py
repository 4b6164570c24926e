"""A rehearsal task runs as uid 10001 with no capability: it reads Python and its rehearsal folder through
views of the folders others cannot search (here /root of a pyenv interpreter and pytest's 0700 folders),
and nothing else of them, /etc/shadow included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.rehearsal import Layout, make_views, task_launcher, unsearchable_folders

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a rehearsal runs as root")

PROBE = """
import sys
from pathlib import Path
import compat
print(Path(sys.argv[1]).read_text())
for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(("CapEff", "CapPrm", "CapAmb", "Uid")):
        print(line)
try:
    open("/etc/shadow").read()
except PermissionError:
    print("shadow refused")
for folder in sys.argv[2:]:
    print(folder, sorted(p.name for p in Path(folder).iterdir()))
"""


def test_a_task_reads_python_and_its_folder_and_nothing_else(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "rehearsal")
    layout.config_dir.mkdir(parents=True)
    layout.config_file.write_text("read me")
    for path in (layout.root, layout.config_dir, layout.config_file):
        path.chmod(0o755 if path.is_dir() else 0o644)
    blocked = unsearchable_folders(layout.root)
    assert tmp_path in blocked  # pytest's folders are 0700: a view each
    make_views(layout)
    probe = subprocess.run(
        [*task_launcher(layout), sys.executable, "-c", PROBE, str(layout.config_file), *map(str, blocked)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    lines = probe.stdout.splitlines()
    assert lines[0] == "read me" and "shadow refused" in lines
    assert all(line.split()[1] == "0000000000000000" for line in lines if line.startswith("Cap")), lines
    assert any(line.startswith("Uid:\t10001") for line in lines)
    for folder, names in blocked.items():  # each folder shows the task only the names that lead on
        assert f"{folder} {sorted(names)}" in lines
