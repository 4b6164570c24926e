"""The continual stage end to end on a tiny stream: CLIP_0, Mod-X, fine-tuning, joint; outputs and errors."""

from __future__ import annotations

import json

import pytest

from components.deployment import TrainingSection
from components.training.continual import ContinualError, TrainingSettings, run_continual

TINY = {"steps": 4, "batch_size": 8, "checkpoint_every": 2, "device": "cpu", "eval_batch_size": 64}


def _settings(**kw) -> TrainingSettings:
    """Tiny training runs: a few steps of small batches on the CPU; Mod-X at the paper's alpha 20, no replay
    buffer unless given."""
    defaults = {**TINY, "replay_buffer_size": 0, "replay_rows": 0}
    return TrainingSettings.from_section(TrainingSection(alpha=20.0), **{**defaults, **kw})


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    from compat.data.synth import generate_stream

    root = tmp_path_factory.mktemp("stage")
    generate_stream(
        root / "stream",
        phases=3,
        samples_per_phase=64,
        seed=1,
        eval_per_domain=16,
        gallery_per_domain=0,
        samples_per_shard=32,
    )
    return root / "stream"


@pytest.fixture(scope="module")
def clip0(stream, tmp_path_factory):
    out = tmp_path_factory.mktemp("p0")
    doc = run_continual(stream, 0, out, _settings())
    return out, doc


def test_phase0_bootstraps_clip0(clip0):
    out, doc = clip0
    assert doc["method"] == "clip0" and doc["alpha"] == 0.0 and doc["production"] is None
    assert list(doc["domains"]) == ["geometric"]
    m = doc["domains"]["geometric"]
    assert m["n_images"] == 16 and m["n_captions"] == 80
    assert set(m["t2i"]) == {"R@1", "R@5", "R@10"} and set(m["i2t"]) == {"R@1", "R@5", "R@10"}
    assert doc["spatial_disorder"] is None and not (out / "spatial_disorder.json").exists()
    assert [p["step"] for p in doc["curve"]] == [1, 2, 3, 4]
    assert json.loads((out / "metrics.json").read_text()) == doc
    sidecar = json.loads((out / "model" / "model.json").read_text())
    assert sidecar["version"] == "phase-00-clip0" and sidecar["extra"]["parent"] is None


def test_modx_phase_evaluates_every_domain_and_writes_sd(stream, clip0, tmp_path):
    p0, _ = clip0
    doc = run_continual(stream, 1, tmp_path, _settings(), production=p0 / "model")
    assert doc["method"] == "modx" and doc["alpha"] == 20.0
    assert list(doc["domains"]) == ["geometric", "signs"] and list(doc["start_domains"]) == [
        "geometric",
        "signs",
    ]
    assert set(doc["forgetting_r1"]["geometric"]) == {"t2i", "i2t"}
    assert doc["curve"][0]["kl"] == pytest.approx(0.0, abs=1e-6) and doc["curve"][-1]["kl"] > 0
    sd = json.loads((tmp_path / "spatial_disorder.json").read_text())
    assert sd["domain"] == "signs" and sd["n_samples"] == 16
    for hist in (sd["ram"]["image"], sd["ram"]["text"], sd["sam"]["image"], sd["sam"]["text"]):
        assert len(hist) == 5 and sum(hist) == pytest.approx(100.0)
    assert sd["bins"]["ram"][0] == "[0,15]" and sd["bins"]["sam"][-1] == "(20,180]"
    sidecar = json.loads((tmp_path / "model" / "model.json").read_text())
    assert sidecar["extra"]["parent"]["version"] == "phase-00-clip0"
    ledger = [json.loads(x) for x in (tmp_path / "train" / "samples.jsonl").read_text().splitlines()]
    assert all(k.startswith("p01-train-") for e in ledger for k in e["keys"])


def test_modx_with_a_replay_buffer_trains_on_earlier_phases_too(stream, clip0, tmp_path):
    p0, _ = clip0
    doc = run_continual(
        stream, 1, tmp_path, _settings(replay_buffer_size=10, replay_rows=3), production=p0 / "model"
    )
    assert doc["training"]["replay"] == {"buffer_size": 10, "rows": 3}
    ledger = [json.loads(x) for x in (tmp_path / "train" / "samples.jsonl").read_text().splitlines()]
    for entry in ledger:  # 5 rows of the new phase, then 3 replayed from phase 0
        assert [k[:3] for k in entry["keys"]] == ["p01"] * 5 + ["p00"] * 3


def test_foundation_candidate_is_a_fresh_architecture_on_every_phase(stream, clip0, tmp_path):
    p0, _ = clip0
    doc = run_continual(
        stream, 1, tmp_path, _settings(method="foundation", config_name="cf-small"), production=p0 / "model"
    )
    assert doc["method"] == "foundation" and doc["alpha"] == 0.0 and doc["model_config"] == "cf-small"
    assert doc["training"]["train_shards"] == 4  # phases 0 and 1
    assert list(doc["start_domains"]) == ["geometric", "signs"]  # production, for comparison
    assert doc["spatial_disorder"] is None  # 128-d candidate vs 64-d production: no rotation angles
    sidecar = json.loads((tmp_path / "model" / "model.json").read_text())
    assert sidecar["config_name"] == "cf-small" and sidecar["extra"]["parent"]["version"] == "phase-00-clip0"


def test_finetune_and_joint_baselines(stream, clip0, tmp_path):
    p0, _ = clip0
    ft = run_continual(stream, 2, tmp_path / "ft", _settings(method="finetune"), production=p0 / "model")
    assert ft["alpha"] == 0.0 and all(p["kl"] == 0.0 for p in ft["curve"])
    assert ft["training"]["train_shards"] == 2
    joint = run_continual(stream, 2, tmp_path / "joint", _settings(method="joint"), production=p0 / "model")
    assert joint["method"] == "joint" and joint["training"]["train_shards"] == 6  # phases 0, 1, 2
    assert list(joint["domains"]) == ["geometric", "signs", "orchard"]


def test_explicit_train_shards(stream, clip0, tmp_path):
    from compat.data.synth import phase_urls

    p0, _ = clip0
    accepted = phase_urls(stream, 1, "train")[1:]  # as if validation had quarantined the first shard
    doc = run_continual(
        stream, 1, tmp_path, _settings(method="finetune"), production=p0 / "model", train_urls=accepted
    )
    assert doc["training"]["train_shards"] == 1
    ledger = [json.loads(x) for x in (tmp_path / "train" / "samples.jsonl").read_text().splitlines()]
    assert all(32 <= int(k.rsplit("-", 1)[1]) < 64 for e in ledger for k in e["keys"])


def test_bad_arguments_are_explained(stream, clip0, tmp_path):
    p0, _ = clip0
    with pytest.raises(ContinualError, match="needs the production model"):
        run_continual(stream, 1, tmp_path, _settings())
    with pytest.raises(ContinualError, match="method must be one of"):
        run_continual(stream, 1, tmp_path, _settings(method="ewc"), production=p0 / "model")
    with pytest.raises(ContinualError, match="phases 0..2"):
        run_continual(stream, 7, tmp_path, _settings(), production=p0 / "model")
    with pytest.raises(ContinualError, match="alpha"):
        run_continual(stream, 1, tmp_path, _settings(method="finetune", alpha=5.0), production=p0 / "model")


def test_cli_reports_errors_with_exit_code_2(stream, tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(
        app, ["train", "continual", "--stream", str(stream), "--phase", "1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "needs the production model" in result.output
    result = CliRunner().invoke(
        app,
        ["train", "continual", "--stream", str(tmp_path / "nope"), "--phase", "0", "--out", str(tmp_path)],
    )
    assert result.exit_code == 2 and "stream.json" in result.output


def test_decoding_workers_change_nothing_in_training(stream, clip0, tmp_path):
    """training.loader_workers decodes in worker processes: the step trains on the same samples, in the same
    order, with the same random crops as with none, so it writes the same ledger and the same weights."""
    p0, _ = clip0
    for workers in (0, 2):
        run_continual(
            stream, 1, tmp_path / f"w{workers}", _settings(loader_workers=workers), production=p0 / "model"
        )
    ledgers = [(tmp_path / f"w{w}" / "train" / "samples.jsonl").read_text() for w in (0, 2)]
    assert ledgers[0] == ledgers[1] and len(ledgers[0].splitlines()) == 4
    from safetensors.torch import load_file

    weights = [load_file(tmp_path / f"w{w}" / "model" / "model.safetensors") for w in (0, 2)]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][name].equal(weights[1][name]) for name in weights[0])
