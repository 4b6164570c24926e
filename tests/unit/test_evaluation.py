"""Evaluation: per-query hits agree with compat.metrics, the paired bootstrap covers a known margin, the ECC
verdict on constructed cases (pass for lambda-orth undoing a rotation, fail for an unrelated model), and
compat_report.json from real models and shards, through the library and through the CLI, valid against its
schema."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import one_thread, write_shards
from typer.testing import CliRunner

from compat.evaluation import (
    compatibility_hits,
    paired_bootstrap,
    report_from_hits,
    retrieval_hits,
)
from compat.methods.lambda_orth import LambdaOrthConfig, PairedFeatures, fit_adapters
from compat.metrics import caption_owners, cross_model_retrieval, recall_at_k
from compat.metrics.retrieval import query_hits
from compat.models import build_model, save_checkpoint
from schemas import schema_errors


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def test_query_hits_agree_with_recall_at_k_including_ties():
    torch.manual_seed(0)
    queries = F.normalize(torch.randn(50, 8), dim=-1)
    gallery = F.normalize(torch.randn(40, 8), dim=-1)
    gallery[7] = gallery[3]  # exact ties between a relevant and a non-relevant item
    positives = [[i % 40] if i % 3 else [i % 40, (i + 5) % 40] for i in range(50)]
    hits = query_hits(queries, gallery, positives, (1, 5, 10), query_chunk=7, gallery_chunk=13)
    expected = recall_at_k(queries, gallery, positives, (1, 5, 10))
    for j, k in enumerate((1, 5, 10)):
        assert 100 * hits[:, j].float().mean().item() == pytest.approx(expected[k])
    # multi-caption protocol, both directions, against compat.metrics
    images, texts = F.normalize(torch.randn(12, 8), dim=-1), F.normalize(torch.randn(30, 8), dim=-1)
    counts = [2, 3] * 6
    both = retrieval_hits(images, texts, images, texts, counts, (1, 5))
    ref = cross_model_retrieval(images, texts, images, texts, counts, (1, 5))
    for d in ("t2i", "i2t"):
        for j, k in enumerate((1, 5)):
            assert 100 * both[d][:, j].float().mean().item() == pytest.approx(ref[d][f"R@{k}"])
    assert len(caption_owners(counts, 12)) == both["t2i"].shape[0]


def test_paired_bootstrap_covers_the_true_margin():
    # queries hit under the old pair with p = 0.5 and the new pair with p = 0.6 (true margin +10 points),
    # positively correlated as real paired hits are
    gen = torch.Generator().manual_seed(0)
    covered, width = 0, []
    replications = 60
    for r in range(replications):
        u = torch.rand(2000, 1, generator=gen)
        noise = torch.rand(2000, 1, generator=gen)
        mix = torch.where(torch.rand(2000, 1, generator=gen) < 0.5, u, noise)
        old = (u < 0.5).float()
        new = (mix < 0.6).float()
        iv = paired_bootstrap(new, old, n_bootstrap=400, confidence=0.95, seed=r)[0]
        covered += iv["ci_low"] <= 10.0 <= iv["ci_high"]
        width.append(iv["ci_high"] - iv["ci_low"])
        assert iv["ci_low"] <= iv["margin"] <= iv["ci_high"]
    assert covered / replications >= 0.85  # nominal 95 %
    assert 2.0 < sum(width) / len(width) < 6.0  # sd of the mean difference ~ 0.9 points -> 95 % width ~ 3.5
    # deterministic for a seed; paired: identical inputs give a zero-width interval at zero
    a = (torch.rand(300, 3, generator=gen) < 0.4).float()
    assert paired_bootstrap(a, a, 100, seed=1) == paired_bootstrap(a, a, 100, seed=1)
    assert all(iv["ci_low"] == iv["ci_high"] == iv["margin"] == 0 for iv in paired_bootstrap(a, a, 100))
    with pytest.raises(ValueError, match="n_bootstrap >= 1"):
        paired_bootstrap(a, a, 0)


def _synthetic_models(n: int, seed: int, basis: torch.Tensor, rotation: torch.Tensor, captions: int = 2):
    """Old embeddings = noisy views of a latent; new = less noisy views, rotated by ``rotation``."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, basis.shape[1], generator=gen) @ basis.T

    def view(noise: float, repeat: int = 1) -> torch.Tensor:
        x = latent.repeat_interleave(repeat, 0)
        return F.normalize(x + noise * torch.randn(x.shape, generator=gen), dim=-1)

    return view(1.2), view(1.2, captions), view(0.3) @ rotation.T, view(0.3, captions) @ rotation.T


def test_ecc_verdict_on_constructed_cases():
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(32, 8, generator=gen) / 3
    skew = torch.randn(32, 32, generator=gen)
    rotation = torch.linalg.matrix_exp(0.05 * (skew - skew.T))  # a small rotation
    train = PairedFeatures(*_synthetic_models(2000, 1, basis, rotation, captions=1))
    adapters, _ = fit_adapters(train, LambdaOrthConfig(steps=300, batch_size=256), 32, 32)
    old_i, old_t, new_i, new_t = _synthetic_models(300, 2, basis, rotation)

    def through_b(queries, gallery):  # lambda-orth, rule as_is: B(new) against the raw old vectors
        with torch.no_grad():
            return F.normalize(adapters.queries(queries), dim=-1), F.normalize(gallery, dim=-1)

    compatible = report_from_hits(
        compatibility_hits(old_i, old_t, new_i, new_t, [2] * 300, through_b), n_bootstrap=300
    )
    unrelated = torch.linalg.qr(torch.randn(32, 32, generator=gen))[0]
    independent = report_from_hits(
        compatibility_hits(old_i, old_t, new_i @ unrelated, new_t @ unrelated, [2] * 300), n_bootstrap=300
    )
    # the better new model, rotated back by a strict B, reads the old gallery better than the old model
    assert compatible["ecc_passed"]
    for d in ("t2i", "i2t"):
        assert compatible["margins"][d]["R@1"]["ci_low"] > 0
        assert compatible["retrieval"][d]["new/new"]["R@1"] > compatible["retrieval"][d]["old/old"]["R@1"]
    # an unrelated space (new vectors under a random orthogonal map): ECC fails everywhere, surely so
    assert not independent["ecc_passed"]
    for d in ("t2i", "i2t"):
        assert not any(independent["ecc"][d].values())
        assert independent["margins"][d]["R@1"]["ci_high"] < 0


# ------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat-eval")
    write_shards(root / "train", "train", 64, per_shard=32)
    write_shards(root / "eval", "eval", 40, per_shard=20)
    save_checkpoint(build_model("cf-tiny", seed=0), root / "old", version="v1")
    save_checkpoint(build_model("cf-tiny", seed=1), root / "new", version="v2")
    return root


def test_report_from_models_and_shards_is_schema_valid(workspace):
    from components.training.evaluate import evaluate

    report = evaluate(
        workspace / "old",
        workspace / "new",
        str(workspace / "eval" / "*.tar"),
        workspace / "plain",
        independent=workspace / "new",
        n_bootstrap=200,
    )
    assert schema_errors(report, "compat_report") == []
    on_disk = json.loads((workspace / "plain" / "compat_report.json").read_text())
    assert on_disk["retrieval"] == report["retrieval"]
    assert report["method"] == "none" and report["serving_contract"]["keeps_space"] is False
    assert report["eval_sizes"]["images"] == 40 and report["eval_sizes"]["captions"] == 200
    assert report["eval_sizes"]["domains"]
    assert report["old_model"]["version"] == "v1" and report["new_model"]["version"] == "v2"
    # a plain new model is its own independent model: identical new/new
    for d in ("t2i", "i2t"):
        assert report["independent_new_new"][d] == report["retrieval"][d]["new/new"]
        assert set(report["margins"][d]) == {"R@1", "R@5", "R@10"}
        for metric, interval in report["margins"][d].items():
            delta = report["retrieval"][d]["new/old"][metric] - report["retrieval"][d]["old/old"][metric]
            assert interval["margin"] == pytest.approx(delta, abs=1e-3)
            assert report["ecc"][d][metric] == (delta > 0)


def test_cli_trains_a_compatible_model_and_evaluates_it(workspace):
    from pipelines.cli import app

    runner = CliRunner()
    out = workspace / "lo"
    result = runner.invoke(
        app,
        [
            "compat",
            "train",
            "--method",
            "lambda_orth",
            "--old",
            str(workspace / "old"),
            "--new",
            str(workspace / "new"),
            "--shards",
            str(workspace / "train" / "*.tar"),
            "--out",
            str(out),
            "--steps",
            "30",
            "--batch-size",
            "16",
            "--set",
            "lam=6",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "serving contract: space 'v1', dim 64, old vectors forward_adapter" in result.output
    doc = json.loads((out / "compat.json").read_text())
    assert doc["method"] == "lambda_orth" and doc["config"]["lam"] == 6.0 and doc["config"]["version"] == "v2"

    report_dir = workspace / "lo-report"
    result = runner.invoke(
        app,
        [
            "evaluate",
            "--old",
            str(workspace / "old"),
            "--new",
            str(out),
            "--eval-shards",
            str(workspace / "eval" / "*.tar"),
            "--out",
            str(report_dir),
            "--bootstrap",
            "100",
            "--independent",
            str(workspace / "new"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "t2i   R@1" in result.output and "ECC" in result.output
    report = json.loads((report_dir / "compat_report.json").read_text())
    assert schema_errors(report, "compat_report") == []
    assert (
        report["method"] == "lambda_orth"
        and report["serving_contract"]["old_vector_rule"] == "forward_adapter"
    )
    assert report["trainable_parameters"] == 64 * 63 // 2 + 64 * 65

    # bad input: a clear error naming the problem, nothing written
    result = runner.invoke(
        app,
        [
            "evaluate",
            "--old",
            str(workspace / "old"),
            "--new",
            str(out),
            "--eval-shards",
            str(workspace / "missing-*.tar"),
            "--out",
            str(workspace / "bad"),
        ],
    )
    assert result.exit_code == 2 and "matches no shard" in result.output
    assert not (workspace / "bad" / "compat_report.json").exists()
    result = runner.invoke(
        app,
        [
            "compat",
            "train",
            "--method",
            "lambda_orth",
            "--old",
            str(workspace / "old"),
            "--new",
            str(workspace / "new"),
            "--shards",
            str(workspace / "train" / "*.tar"),
            "--out",
            str(workspace / "x"),
            "--set",
            "lamda=3",
        ],
    )
    assert result.exit_code == 2 and "unknown setting(s) ['lamda']" in result.output
