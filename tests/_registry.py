"""Registered versions for the registry tests: small safetensors checkpoints and gate decisions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from components.adapters.registry import Registry
from components.state.rollout_document import RolloutState

PASS = {
    "decision": "pass",
    "reasons": [],
    "checks": [],
    "report_sha256": "a" * 64,
    "decided_at": "2026-11-22T00:00:00+00:00",
}
BLOCK = {
    "decision": "block",
    "reasons": [{"code": "ecc_margin", "message": "i2t R@1: -2.00 pp"}],
    "checks": [{"name": "ecc", "status": "fail", "code": "ecc_margin", "message": "i2t R@1: -2.00 pp"}],
    "report_sha256": "b" * 64,
    "decided_at": "2026-11-22T00:00:00+00:00",
}


def done(version: str) -> RolloutState:
    """A completed rollout of ``version``: the fields :meth:`Registry.promote` reads (the rollout tests run
    real ones)."""
    return RolloutState.model_construct(status="completed", new_version=str(version))


def make_checkpoint(directory: Path, seed: int) -> dict[str, str]:
    """A small safetensors checkpoint; returns sha256 of each file, computed independently."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file(
        {"visual.proj": rng.standard_normal((8, 4)).astype(np.float32)}, str(directory / "model.safetensors")
    )
    (directory / "config.json").write_text(json.dumps({"embed_dim": 4, "seed": seed}))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def candidate(
    registry: Registry, tmp: Path, name: str, seed: int, gate: dict, phase: int
) -> tuple[str, dict]:
    run_id = registry.start_run(name, params={"training": {"method": "modx", "steps": 10}})
    registry.log_metrics(run_id, {"t2i": {"R@1": 30.0 + seed}}, step=phase)
    digests = make_checkpoint(tmp / name, seed)
    info = registry.register_candidate(run_id, tmp / name, data_phase=phase, method="bct", gate=gate)
    return info["version"], digests
