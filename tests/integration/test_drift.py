"""Drift stage on real shards: a real domain shift is caught; a phase against a fresh sample of itself is
not, on the synthetic stream and on data with a long tail of rare caption words (as real captions have)."""

import json

import numpy as np
import pytest

from components.data.drift import SEVERITIES, compute_drift, run_drift, sample_phase, severity_for


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


@pytest.fixture(scope="module")
def production(stream, tmp_path_factory):
    from compat.models import build_model, save_checkpoint

    return save_checkpoint(
        build_model("cf-tiny", seed=0), tmp_path_factory.mktemp("prod"), version="v1"
    ).parent


def test_a_phase_against_a_fresh_sample_of_itself_reads_none(stream, production):
    """Two disjoint samples of phase 0, every signal (embeddings included): sampling noise is not drift."""
    from compat.production import load_encoder

    samples = sample_phase(str(stream / "phase-00/train/*.tar"), 120, seed=0)
    summary = compute_drift(samples[:60], samples[60:], load_encoder(production))
    assert summary["embeddings_measured"]
    assert summary["severity"] == "none", {k: v for k, v in summary["verdicts"].items() if v["drift"]}
    assert all(v["noise_floor"] is not None for v in summary["verdicts"].values())


def _long_tail_shards(root, seed: int, n: int) -> str:
    """Noise images of mixed sizes and modes, captions drawn from a Zipf vocabulary of 3000 words."""
    import io

    from PIL import Image

    from compat.data.shards import write_shard

    rng = np.random.default_rng(seed)
    words = [f"w{i:04d}" for i in range(3000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()

    def sample(i: int):
        size = (int(rng.integers(48, 160)), int(rng.integers(48, 160)))
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        image = Image.fromarray(pixels).convert(["RGB", "L"][i % 2])
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        caption = " ".join(rng.choice(words, size=int(rng.integers(5, 13)), p=weights))
        return f"s{seed}x{i:05d}", {"png": buffer.getvalue(), "txt": caption.encode()}

    path = root / f"tail-{seed}.tar"
    write_shard(path, (sample(i) for i in range(n)))
    return str(path)


def test_long_tail_captions_are_noise_not_drift(tmp_path):
    """Fresh samples of a long-tailed vocabulary always hold unseen words (raw rate well above the 1 % band);
    calibrated on the reference's own split halves, they read none."""
    reference = sample_phase(_long_tail_shards(tmp_path, 0, 160), 160, seed=0)
    current = sample_phase(_long_tail_shards(tmp_path, 1, 160), 160, seed=1)
    summary = compute_drift(reference, current)
    vocabulary = summary["verdicts"]["caption_vocabulary"]
    assert vocabulary["score"] > 0.05 and vocabulary["noise_floor"] >= vocabulary["score"] * 0.8
    assert summary["severity"] == "none", {k: v for k, v in summary["verdicts"].items() if v["drift"]}


# ------------------------------------------------------------------------------------ the Evidently adapter
def test_the_adapter_is_written_for_the_installed_evidently_series():
    """components/data/drift.py uses Evidently's public 0.7 API: an Evidently of another release series
    (before 1.0
    a minor release may break it) fails here, and in the drift step, with a sentence naming both versions."""
    from importlib.metadata import version
    from pathlib import Path

    from components.data.drift import EVIDENTLY_SERIES, check_evidently_version, evidently_version_problem

    installed = version("evidently")
    assert evidently_version_problem(installed) is None, evidently_version_problem(installed)
    check_evidently_version()
    base = Path(__file__).resolve().parents[2] / "requirements" / "base.txt"
    pins = [line for line in base.read_text().splitlines() if line.startswith("evidently==")]
    assert len(pins) == 1 and pins[0].startswith(f"evidently=={EVIDENTLY_SERIES}."), (
        f"{base} pins {pins}, but components/data/drift.py is written for Evidently {EVIDENTLY_SERIES}.x"
    )
    problem = evidently_version_problem("0.8.0")
    assert f"{EVIDENTLY_SERIES}.x" in problem and "0.8.0 is installed" in problem
    assert "requirements/base.txt" in problem and "EVIDENTLY_SERIES" in problem
    assert evidently_version_problem(f"{EVIDENTLY_SERIES}.99") is None


def _table(rng, n: int, shift: float = 0.0, hues=("red", "blue")):
    import pandas as pd

    frame = pd.DataFrame({"key": [f"k{i}" for i in range(n)], "image_brightness": rng.normal(0.5, 0.1, n)})
    frame["image_dominant_hue"] = [hues[i % len(hues)] for i in range(n)]
    for j in range(8):
        frame[f"e{j}"] = rng.normal(size=n)
    return frame


def test_evidently_scores_known_answers():
    """Identical sides score the no-drift value of each method; a shift by exactly 1 scores 1 / std(reference)
    (normalised Wasserstein), disjoint categories sqrt(ln 2) (Jensen-Shannon distance), separated embeddings a
    ROC AUC of 1."""
    from threadpoolctl import threadpool_limits

    from components.data.drift import evidently_scores

    rng = np.random.default_rng(0)
    reference = _table(rng, 150)
    embeddings = {"image_embedding": [f"e{j}" for j in range(8)]}
    with threadpool_limits(limits=1):  # as compute_drift runs it
        same = evidently_scores(reference, reference.copy(), ["image_brightness"], embeddings)
    assert same["image_brightness"] == 0.0 and same["image_dominant_hue"] == 0.0
    assert abs(same["image_embedding"] - 0.5) < 0.1

    shifted = reference.copy()
    shifted["image_brightness"] += 1.0
    shifted["image_dominant_hue"] = "green"
    shifted[embeddings["image_embedding"]] += 10.0
    with threadpool_limits(limits=1):
        moved = evidently_scores(reference, shifted, ["image_brightness"], embeddings)
    assert moved["image_brightness"] == pytest.approx(1.0 / np.std(reference["image_brightness"]))
    assert moved["image_dominant_hue"] == pytest.approx(np.sqrt(np.log(2.0)))
    assert moved["image_embedding"] == 1.0


def test_column_scores_are_the_reports_scores():
    """The noise floors' scorer gives each column exactly the score the Evidently report gives it, on halves
    that differ and on a shifted side."""
    from threadpoolctl import threadpool_limits

    from components.data.drift import column_scores, evidently_scores

    rng = np.random.default_rng(3)
    table = _table(rng, 120)
    table["image_contrast"] = rng.gamma(2.0, size=len(table))
    numeric = ["image_brightness", "image_contrast"]
    halves = table.iloc[:60].reset_index(drop=True), table.iloc[60:].reset_index(drop=True)
    shifted = halves[1].copy()
    shifted["image_brightness"] += 0.3
    shifted.loc[:20, "image_dominant_hue"] = "green"
    for reference, current in (halves, (halves[0], shifted)):
        with threadpool_limits(limits=1):
            report = evidently_scores(reference, current, numeric, {})
        assert column_scores(reference, current, numeric) == report
    assert report["image_brightness"] > 0.3 and report["image_dominant_hue"] > 0.0


def test_identical_sides_read_no_drift_and_a_shift_reads_drift(tmp_path):
    """The drift step end to end on pictures with a known answer: the same samples on both sides score no
    drift on every signal; the same pictures made brighter drift in brightness; the HTML report is written."""
    from types import SimpleNamespace

    from PIL import Image

    rng = np.random.default_rng(1)
    words = ["a", "red", "blue", "square", "circle", "small", "large", "photo"]

    def samples(lift: int) -> list:
        out = []
        for i in range(40):
            pixels = np.clip(rng.normal(80, 25, (32, 32, 3)) + lift, 0, 255).astype(np.uint8)
            caption = " ".join(rng.choice(words, 6))
            out.append(SimpleNamespace(key=f"k{i:03d}", caption=caption, image=Image.fromarray(pixels)))
        return out

    reference = samples(0)
    same = compute_drift(reference, list(reference))
    assert same["severity"] == "none" and same["drifted"] == []
    assert all(v["score"] == 0.0 for v in same["verdicts"].values()), same["verdicts"]

    rng = np.random.default_rng(1)  # the same pictures and captions, brighter
    brighter = samples(120)
    shifted = compute_drift(reference, brighter, html_path=tmp_path / "drift_report.html")
    assert "image_brightness" in shifted["drifted"]
    assert shifted["verdicts"]["image_brightness"]["severity"] == "high"
    assert shifted["verdicts"]["caption_vocabulary"]["score"] == 0.0
    assert (tmp_path / "drift_report.html").stat().st_size > 100_000


def test_every_caption_of_a_picture_counts_in_the_caption_vocabulary(stream):
    """A picture with several captions: each is counted, and a word only its second caption uses is new."""
    import dataclasses

    samples = sample_phase(str(stream / "phase-00/train/*.tar"), 40, seed=0)
    reference = [dataclasses.replace(s, captions=[s.caption]) for s in samples[:20]]
    current = [dataclasses.replace(s, captions=[s.caption, "a zebra beside a giraffe"]) for s in samples[20:]]
    summary = compute_drift(reference, current)
    assert summary["captions"] == {"reference": 20, "current": 40}
    assert {"zebra", "giraffe"} <= set(summary["verdicts"]["caption_vocabulary"]["examples"])
