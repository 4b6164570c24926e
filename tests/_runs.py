"""A finished run over a small config, for the run-state tests."""

import json
import tarfile

from compat.data.synth import FORMAT, MANIFEST, VERSION


def _shard(path, names):
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 0
            tar.addfile(info)
    return path


def _config(tmp_path):
    stream = tmp_path / "stream"
    (stream / "p0").mkdir(parents=True)
    (stream / "p1").mkdir()
    phases = [
        {"train": ["p0/raw-0.tar", "p0/raw-1.tar"], "domain": "geometric"},
        {"train": ["p1/raw-0.tar"], "domain": "signs"},
    ]
    for rel in ("p0/raw-0.tar", "p0/raw-1.tar", "p1/raw-0.tar"):
        _shard(stream / rel, ["a.txt"])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "seed": 0,
        "image_size": 64,
        "phases": [
            {"phase": i, "eval": [], "gallery": [], "counts": {"train": 1, "eval": 0, "gallery": 0}, **entry}
            for i, entry in enumerate(phases)
        ],
    }
    (stream / MANIFEST).write_text(json.dumps(manifest))
    return {"workspace": str(tmp_path / "ws"), "stream": {"uri": str(stream)}}


def _finished_run(ws, run_id, phase, status):
    run_dir = ws / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "phase": phase}))
    if status:
        (run_dir / "outcome.json").write_text(json.dumps({"status": status}))
    return run_dir
