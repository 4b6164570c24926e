"""A killed import (kill -9) resumes without rewriting the shards it finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _image_folders import image_folder, picture, tree_bytes

from compat.data.importer import PENDING, REPORT, ImportSettings, import_images

# Run in a child process: the import kills itself (SIGKILL) while the third shard's writer holds its first
# sample, so the shards before it are finished and that one is left as a temporary file.
KILLED_IMPORT = """
import os, signal, sys
import compat.data.shards as shards
from compat.data.importer import ImportSettings, import_images

real, started = shards.write_shard, []

def write_shard(path, samples):
    started.append(path)

    def feed():
        for n, sample in enumerate(samples):
            if len(started) == 3 and n == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            yield sample

    return real(path, feed())

shards.write_shard = write_shard
import_images(sys.argv[1], sys.argv[2], ImportSettings(samples_per_shard=2), progress=False)
"""


def test_a_killed_import_resumes_without_rewriting_finished_shards(tmp_path: Path) -> None:
    """The import is killed for real (SIGKILL) while it writes a shard, then run again."""
    src = image_folder(tmp_path / "src", 20)
    picture(777, (30, 30), "RGB").save(src / "zzz.png")
    (src / "zzz.txt").write_text("a picture read last")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_IMPORT, str(src), str(out)], capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()
    assert not (out / REPORT).exists() and (out / PENDING).exists()
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.tar"))
    assert written and list(out.rglob(".*.tmp"))  # finished shards, and the one cut off as a temporary file
    kept = {rel: os.stat(out / rel).st_ino for rel in written}
    settings = ImportSettings(samples_per_shard=2)
    resumed = import_images(src, out, settings, progress=False)
    assert resumed.reused_shards == len(written) and resumed.written_shards >= 1
    assert {rel: os.stat(out / rel).st_ino for rel in written} == kept  # not rewritten
    assert not list(out.rglob(".*.tmp")) and not (out / PENDING).exists()
    fresh = import_images(src, tmp_path / "fresh", settings, progress=False)
    assert fresh.report["imported"] == 21 and tree_bytes(out) == tree_bytes(tmp_path / "fresh")
    # A pending plan of other input (the source changed between the kill and the restart) starts over.
    (out / REPORT).unlink()
    (out / PENDING).write_text(json.dumps({"digest": "0" * 64, "settings": {}}))
    total = resumed.written_shards + resumed.reused_shards
    assert import_images(src, out, settings, progress=False).written_shards == total
    assert tree_bytes(out) == tree_bytes(tmp_path / "fresh")
