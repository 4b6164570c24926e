"""The realistic stream shift: a shared core vocabulary, novelty per phase, the measured share of captions in
earlier words, determinism, and the disjoint stream unchanged byte for byte."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from compat.data.domains import BASE_DOMAINS, CORE_KINDS, GEOMETRIC, realistic_phase
from compat.data.manifest import load_manifest, phase_urls
from compat.data.shards import iter_raw_samples
from compat.data.shift import caption_words, earlier_word_shares
from compat.data.synth import StreamError, generate_stream

SMALL = dict(eval_per_domain=6, gallery_per_domain=4, samples_per_shard=100)


@pytest.fixture(scope="module")
def realistic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("realistic")
    generate_stream(out, phases=5, samples_per_phase=200, seed=2, shift="realistic", **SMALL)
    return out


def metas(stream: Path, phase: int, split: str = "train") -> list[dict]:
    return [
        json.loads(s.members["json"])
        for url in phase_urls(stream, phase, split)
        for s in iter_raw_samples(url)
    ]


def phase_words(stream: Path, phase: int) -> set[str]:
    return set().union(*(caption_words(c) for m in metas(stream, phase) for c in m["captions"]))


def test_every_phase_shares_the_core_vocabulary(realistic: Path) -> None:
    core = {c for c, _ in GEOMETRIC.colours} | set(GEOMETRIC.sizes) | set(CORE_KINDS)
    core |= {"top", "bottom", "left", "right", "center", "plain"}
    for phase in range(5):
        words = phase_words(realistic, phase)
        assert core <= words, (phase, sorted(core - words))
    manifest = load_manifest(realistic)
    assert manifest["generator"]["shift"] == "realistic" and manifest["generator"]["old_word_share"] == 0.6
    assert [p["domain"] for p in manifest["phases"]] == [
        "r00-geometric",
        "r01-signs",
        "r02-orchard",
        "r03-town",
        "r04-reef",
    ]


def test_each_phase_brings_new_items_and_earlier_ones_fade(realistic: Path) -> None:
    seen: set[str] = set()
    share_of_signs = []
    signs = {k.names[0] for k in BASE_DOMAINS[1].kinds}
    for phase in range(5):
        kinds = Counter(o["kind"] for m in metas(realistic, phase) for o in m["scene"]["objects"])
        words = phase_words(realistic, phase)
        if phase > 0:
            brought = {k.names[0] for k in BASE_DOMAINS[phase].kinds}
            assert brought <= set(kinds), (phase, brought - set(kinds))
            assert len(words - seen) >= 10
            assert any(
                m["scene"]["background"]["name"] in {b.name for b in BASE_DOMAINS[phase].backgrounds}
                for m in metas(realistic, phase)
            )
            share_of_signs.append(sum(kinds[k] for k in signs) / sum(kinds.values()))
        else:
            assert set(kinds) <= {k.names[0] for k in GEOMETRIC.kinds}
        seen |= words
    # signs' kinds: common in the phase that brings them, rarer with every later phase
    assert (
        share_of_signs == sorted(share_of_signs, reverse=True) and share_of_signs[0] > 2 * share_of_signs[-1]
    )
    assert realistic_phase(6).weight("kind", "star") < realistic_phase(2).weight("kind", "star")
    assert realistic_phase(6).weight("kind", "circle") == realistic_phase(1).weight("kind", "circle") == 1.0


def test_measured_share_of_earlier_words_is_the_configured_one(realistic: Path, tmp_path: Path) -> None:
    rows = earlier_word_shares(realistic)
    assert rows[0]["earlier_word_share"] is None and rows[0]["new_words"] == rows[0]["words"]
    shares = [r["earlier_word_share"] for r in rows[1:]]
    assert all(0.5 <= s <= 0.72 for s in shares), shares
    assert abs(sum(shares) / len(shares) - 0.6) < 0.06, shares
    novel = [m["scene"]["novel"] for p in range(1, 5) for m in metas(realistic, p)]
    assert abs(novel.count(False) / len(novel) - 0.6) < 0.06

    low = tmp_path / "low"
    generate_stream(
        low, phases=3, samples_per_phase=200, seed=2, shift="realistic", old_word_share=0.2, **SMALL
    )
    low_shares = [r["earlier_word_share"] for r in earlier_word_shares(low)[1:]]
    assert all(0.1 <= s <= 0.32 for s in low_shares), low_shares

    hard = tmp_path / "hard"
    generate_stream(hard, phases=3, samples_per_phase=60, seed=2, shift="disjoint", **SMALL)
    assert [r["earlier_word_share"] for r in earlier_word_shares(hard)] == [None, 0.0, 0.0]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_and_settings_are_kept(tmp_path: Path) -> None:
    args = dict(phases=3, samples_per_phase=30, seed=4, shift="realistic", **SMALL)
    generate_stream(tmp_path / "a", **args)
    generate_stream(tmp_path / "b", **args)
    generate_stream(tmp_path / "c", **{**args, "old_word_share": 0.5})
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    shard = "phase-02/train/shard-00000.tar"
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()
    with pytest.raises(StreamError, match="shift: 'realistic' there, 'disjoint' asked"):
        generate_stream(tmp_path / "a", **{**args, "shift": "disjoint"})
    with pytest.raises(ValueError, match="shift must be one of"):
        generate_stream(tmp_path / "d", **{**args, "shift": "gradual"})
    with pytest.raises(ValueError, match="old_word_share"):
        generate_stream(tmp_path / "d", **{**args, "old_word_share": 1.5})


# sha256 over "<sha256 of shard>  ./<path>" lines of every shard, written by the generator before the
# realistic shift existed (6 phases, 30 train / 8 eval / 8 gallery, 16 per shard, seed 7)
DISJOINT_DIGEST = "6b5769b0f0cc90eb594d1539abf720297ac4c987376e8e06d383ebdd940bd1c2"
PINNED = {
    "phases": 6,
    "samples_per_phase": 30,
    "seed": 7,
    "eval_per_domain": 8,
    "gallery_per_domain": 8,
    "samples_per_shard": 16,
}


def test_disjoint_stream_is_unchanged_byte_for_byte(tmp_path: Path) -> None:
    generate_stream(tmp_path, **PINNED)
    lines = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(tmp_path)}\n"
        for p in sorted(tmp_path.rglob("*.tar"))
    )
    assert hashlib.sha256(lines.encode()).hexdigest() == DISJOINT_DIGEST
    # a manifest written before the shift setting existed reads as disjoint and is completed, not refused
    manifest = json.loads((tmp_path / "stream.json").read_text())
    del manifest["generator"]["shift"]
    (tmp_path / "stream.json").write_text(json.dumps(manifest))
    generate_stream(tmp_path, **PINNED)


def test_data_info_reports_the_measured_shift(realistic: Path) -> None:
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(app, ["data", "info", str(realistic)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["shift"] == "realistic" and doc["old_word_share"] == 0.6
    assert [r["earlier_word_share"] for r in doc["vocabulary"]] == [
        r["earlier_word_share"] for r in earlier_word_shares(realistic)
    ]
