"""The rollout through the CLI: kill -9 mid-stage then resume on each backend, and index, run, search,
rollback with real models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _milvus import SERVER_BACKENDS, server_uri
from _rollouts import PROBE, UPGRADE, N, _assert_gallery, _index_old, _run_args

from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.rollout import workers
from components.serving.record import read_serving


def _cli(ws: Path, *extra: str) -> list[str]:
    cli = [sys.executable, "-m", "pipelines.cli"]
    return [*cli, *_run_args(ws, "--workspace", str(ws)), "--batch-size", "16", "--order", "random", *extra]


@pytest.mark.parametrize("backend", ["embedded", *SERVER_BACKENDS])
def test_kill_9_mid_stage_then_resume(tmp_path, backend, request) -> None:
    """SIGKILL a real rollout process mid-stage (some of its slices written); a rerun completes with one v2
    vector per item."""
    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    if backend in SERVER_BACKENDS:
        uri, alias = server_uri(request, backend), f"g{uuid.uuid4().hex[:10]}"
    else:
        uri, alias = str(ws / "milvus" / "gallery.db"), "gallery"
    with GalleryIndex(uri, alias) as index:
        _index_old(paths, index)
    (ws / "probe.json").write_text(json.dumps(PROBE.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        _cli(ws, "--option=delay_s=0.08"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    killed_at = None
    deadline = time.monotonic() + 120
    while killed_at is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            state = json.loads(paths.state.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            state = None
        if state and state["stage"] == 3 and state["cursor"]["ranges"]:
            (start, end), *_ = state["cursor"]["ranges"]
            cursor = workers.range_cursor(paths.work(state["rollout_id"]), 3, start, end)
            done = json.loads(cursor.read_text())["position"] if cursor.is_file() else start
            if start < done < end:  # some of the stage's slices written, not all
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = done
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert killed_at is not None, (
        f"the rollout was not caught mid-stage: {proc.stdout.read().decode()[-2000:]}"
    )
    assert proc.returncode == -signal.SIGKILL
    state = json.loads(paths.state.read_text())
    assert state["status"] == "running" and state["stage"] == 3
    g = state["gallery"]
    with GalleryIndex(uri, alias) as index:  # mid-stage: the source whole, the target part-written
        assert index.count_by_version(g["source_collection"]) == {"v1": N}
        assert 0 < index.count(g["collection"]) < N

    rerun = subprocess.run(_cli(ws, "--json"), env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    final = json.loads(rerun.stdout)
    assert final["status"] == "completed" and final["rollout_id"] == state["rollout_id"]
    assert [p["fraction"] for p in final["curve"]] == [0.0, 0.1, 0.25, 0.5, 1.0]
    with GalleryIndex(uri, alias) as index:
        _assert_gallery(index, UPGRADE.new_gallery, "v2")


def test_cli_with_real_models_end_to_end(tmp_path) -> None:
    """index -> run -> search -> rollback through the CLI with a real cf-tiny checkpoint and real shards.

    The new model has the old one's weights (no trained models ship with the repository): every probe
    equals its floor, so the rollout completes and each stage exercises the real encoders end to end.
    """
    from typer.testing import CliRunner

    from compat.data.shards import write_shard
    from compat.data.synth import make_sample
    from compat.models import build_model, save_checkpoint
    from pipelines.cli import app

    shard = tmp_path / "gallery-000.tar"
    write_shard(shard, (make_sample(0, 0, "gallery", i, 64) for i in range(96)))
    ckpt = tmp_path / "model"
    save_checkpoint(build_model("cf-tiny", seed=0), ckpt, version="v1")
    ws = tmp_path / "ws"
    run = CliRunner().invoke
    common = ["--workspace", str(ws)]
    result = run(
        app,
        [
            "rollout",
            "index",
            "--model",
            str(ckpt),
            "--version",
            "v1",
            "--space",
            "tiny",
            "--gallery",
            str(shard),
            "--probe-size",
            "48",
            *common,
        ],
    )
    assert result.exit_code == 0, result.output
    result = run(
        app,
        [
            "rollout",
            "run",
            "--new-version",
            "v2",
            "--new-model",
            str(ckpt),
            "--batch-size",
            "32",
            "--json",
            *common,
        ],
    )
    assert result.exit_code == 0, result.output
    state = json.loads(result.output[result.output.index("{") :])
    assert state["status"] == "completed" and state["query_model"]["uri"] == str(ckpt)
    probe = json.loads((ws / "rollout" / "probe.json").read_text())
    alias = read_serving(ws / "serving.json").alias  # the deployment's own
    with GalleryIndex(str(ws / "milvus" / "gallery.db"), alias) as index:
        assert index.count_by_version() == {"v2": 96}
        key = probe["positives"][0][0]
        row = index.fetch([key])[0]
        assert row["source_uri"] == f"{shard}#{key}" and row["rollout_id"] == state["rollout_id"]
    result = run(app, ["search", probe["texts"][0], "-k", "3", "--json", *common])
    assert result.exit_code == 0, result.output
    hits = json.loads(result.output[result.output.index("[") :])
    assert len(hits) == 3 and {h["model_version"] for h in hits} == {"v2"}
    result = run(app, ["rollout", "rollback", *common])
    assert result.exit_code == 0, result.output
    with GalleryIndex(str(ws / "milvus" / "gallery.db"), alias) as index:
        assert index.count_by_version() == {"v1": 96}
