"""A real `compatflow train continual` process killed with SIGKILL mid-run resumes exactly: the same samples
in the same order (none repeated, none skipped) and the same final weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_SAMPLES = 96
BATCH = 8
STEPS = 24  # two epochs of the phase


@pytest.fixture(scope="module")
def stream_and_production(tmp_path_factory):
    from compat.data.synth import generate_stream
    from compat.models import build_model, save_checkpoint

    root = tmp_path_factory.mktemp("resume")
    generate_stream(
        root / "stream",
        phases=2,
        samples_per_phase=TRAIN_SAMPLES,
        seed=3,
        eval_per_domain=16,
        gallery_per_domain=0,
        samples_per_shard=32,
    )
    save_checkpoint(build_model("cf-tiny", seed=0), root / "production", version="p0")
    return root / "stream", root / "production"


def _command(stream: Path, production: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "-q",
        "train",
        "continual",
        "--stream",
        str(stream),
        "--phase",
        "1",
        "--production",
        str(production),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--checkpoint-every",
        "3",
        "--replay-buffer-size",  # what is resumed exactly here is the trainer's own state
        "0",
        "--replay-rows",
        "0",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train" / "samples.jsonl").read_text().splitlines()]


def test_sigkill_mid_run_resumes_exactly(stream_and_production, tmp_path):
    from safetensors.torch import load_file

    stream, production = stream_and_production
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = subprocess.run(
        _command(stream, production, full), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(
        _command(stream, production, cut),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ledger = cut / "train" / "samples.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if ledger.exists() and len(ledger.read_text().splitlines()) >= 8:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps_before_kill = len(ledger.read_text().splitlines())
    assert 8 <= steps_before_kill < STEPS
    assert not (cut / "metrics.json").exists()

    again = subprocess.run(
        _command(stream, production, cut), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]

    reference, resumed = _ledger(full), _ledger(cut)
    assert [e["step"] for e in reference] == list(range(1, STEPS + 1))
    assert resumed == reference
    keys = [k for e in reference for k in e["keys"]]
    per_epoch = TRAIN_SAMPLES // BATCH * BATCH
    for epoch in range(2):  # every epoch visits every train sample exactly once
        seen = keys[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert len(set(seen)) == TRAIN_SAMPLES and all(k.startswith("p01-train-") for k in seen)

    metrics = json.loads((cut / "metrics.json").read_text())
    assert metrics["training"]["resumed_from_step"] in range(3, steps_before_kill + 1, 3)
    assert [p["step"] for p in metrics["curve"]] == list(range(1, STEPS + 1))
    want = load_file(str(full / "model" / "model.safetensors"))
    got = load_file(str(cut / "model" / "model.safetensors"))
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
