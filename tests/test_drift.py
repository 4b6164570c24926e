"""Drift stage on real shards: a real domain shift is caught, a phase against itself is not."""

import json

import pytest

from components.drift import SEVERITIES, compute_drift, run_drift, sample_phase, severity_for


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    from compat.data.synth import generate_stream

    root = tmp_path_factory.mktemp("stream")
    generate_stream(root, phases=2, samples_per_phase=120, seed=3, eval_per_domain=10, gallery_per_domain=10)
    return root


def test_severity_bands():
    assert severity_for(0.0, "wasserstein") == "none"
    assert severity_for(0.15, "wasserstein") == "low"
    assert severity_for(0.3, "jensenshannon") == "medium"
    assert severity_for(0.99, "model") == "high"
    assert severity_for(0.5, "model") == "none"


def test_domain_shift_is_reported(stream, tmp_path):
    out = tmp_path / "drift"
    summary = run_drift(
        str(stream / "phase-00/train/*.tar"), str(stream / "phase-01/train/*.tar"), out, sample_size=100
    )
    assert summary["sizes"] == {"reference": 100, "current": 100}
    # phase 1 brings new vocabulary: captions use words phase 0 never used
    assert summary["verdicts"]["caption_vocabulary"]["drift"] is True
    assert SEVERITIES.index(summary["severity"]) >= SEVERITIES.index("medium")
    written = json.loads((out / "drift.json").read_text())
    assert written["severity"] == summary["severity"]
    html = (out / "drift_report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") or "<html" in html[:500].lower()


def test_same_phase_shows_no_caption_drift(stream):
    samples = sample_phase(str(stream / "phase-00/train/*.tar"), 120, seed=0)
    summary = compute_drift(samples[:60], samples[60:])
    assert summary["verdicts"]["caption_vocabulary"]["severity"] in ("none", "low")
    assert not summary["embeddings_measured"]


def test_embedding_drift_under_the_production_model(stream, tmp_path):
    from compat.models import build_model, save_checkpoint

    checkpoint = save_checkpoint(build_model("cf-tiny", seed=0), tmp_path / "prod", version="v1")
    summary = run_drift(
        str(stream / "phase-00/train/*.tar"),
        str(stream / "phase-01/train/*.tar"),
        tmp_path / "drift",
        production_checkpoint=checkpoint.parent,
        sample_size=60,
    )
    assert summary["embeddings_measured"]
    assert {"image_embedding", "text_embedding"} <= set(summary["verdicts"])
    assert summary["verdicts"]["image_embedding"]["method"] == "model"


def test_glob_matching_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nothing|no "):
        run_drift(str(tmp_path / "missing/*.tar"), str(tmp_path / "missing/*.tar"), tmp_path / "out")
