"""The synthetic captioned-image stream: layout contract, determinism, resumption, metadata, domains, CLI."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from compat.data import synth
from compat.data.domains import BASE_DOMAINS, domain_for_phase
from compat.data.synth import StreamError, generate_stream, load_manifest, phase_urls
from schemas import schema_errors

SMALL = dict(eval_per_domain=10, gallery_per_domain=12, samples_per_shard=16)


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stream")
    generate_stream(out, phases=5, samples_per_phase=40, seed=3, **SMALL)
    return out


def read_shard(path: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for info in tar:
            key, ext = info.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    return samples


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_and_manifest_contract(stream: Path) -> None:
    manifest = load_manifest(stream)
    assert manifest["format"] == "compatflow-stream" and manifest["version"] == 1
    assert manifest["seed"] == 3 and manifest["image_size"] == 64
    assert [p["phase"] for p in manifest["phases"]] == [0, 1, 2, 3, 4]
    assert [p["domain"] for p in manifest["phases"]] == [d.name for d in BASE_DOMAINS]
    all_keys: set[str] = set()
    for entry in manifest["phases"]:
        pp = entry["phase"]
        assert entry["counts"] == {"train": 40, "eval": 10, "gallery": 12}
        assert isinstance(entry["description"], str) and entry["description"]
        assert len(entry["train"]) == 3 and len(entry["eval"]) == 1 and len(entry["gallery"]) == 1
        for split in ("train", "eval", "gallery"):
            keys = []
            for n, rel in enumerate(entry[split]):
                assert rel == f"phase-{pp:02d}/{split}/shard-{n:05d}.tar"
                keys += list(read_shard(stream / rel))
            assert len(keys) == entry["counts"][split]
            assert keys == [f"p{pp:02d}-{split}-{i:06d}" for i in range(len(keys))]
            all_keys |= set(keys)
        assert phase_urls(stream, pp, "eval", manifest) == [
            str((stream / r).resolve()) for r in entry["eval"]
        ]
    assert len(all_keys) == 5 * (40 + 10 + 12)
    assert not list(stream.rglob("*.tmp*")) and not (stream / synth.PENDING).exists()


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, 11), (b, 11), (c, 12)):
        generate_stream(
            out,
            phases=2,
            samples_per_phase=12,
            seed=seed,
            eval_per_domain=5,
            gallery_per_domain=5,
            samples_per_shard=8,
        )
    assert tree_bytes(a) == tree_bytes(b)
    shard = "phase-00/train/shard-00000.tar"
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
    with tarfile.open(a / shard) as tar:
        for info in tar.getmembers():
            assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (
                0,
                0,
                0,
                "",
                "",
                0o644,
            )


def test_interrupted_generation_completes_and_complete_stream_is_untouched(
    tmp_path: Path, monkeypatch
) -> None:
    args = dict(
        phases=2, samples_per_phase=20, seed=5, eval_per_domain=4, gallery_per_domain=4, samples_per_shard=6
    )
    reference = tmp_path / "ref"
    generate_stream(reference, **args)

    out = tmp_path / "out"
    real_write = synth.write_shard
    calls = {"n": 0}

    def failing_write(path, samples):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("power cut")
        return real_write(path, samples)

    monkeypatch.setattr(synth, "write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        generate_stream(out, **args)
    monkeypatch.setattr(synth, "write_shard", real_write)
    assert not (out / "stream.json").exists() and (out / synth.PENDING).exists()
    assert len(list(out.rglob("*.tar"))) == 3

    with pytest.raises(StreamError, match="other settings"):
        generate_stream(out, **{**args, "seed": 6})
    (out / "phase-00/train/.shard-00002.tar.4242.deadbeef.tmp").write_bytes(b"cut")  # a SIGKILLed write's
    generate_stream(out, **args)
    assert tree_bytes(out) == tree_bytes(reference)

    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert generate_stream(out, **args) == load_manifest(out)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps

    (out / "phase-01/train/shard-00002.tar").unlink()
    generate_stream(out, **args)
    assert tree_bytes(out) == tree_bytes(reference)


def test_extending_keeps_existing_phases_and_refuses_other_settings(tmp_path: Path) -> None:
    args = dict(samples_per_phase=6, seed=1, eval_per_domain=3, gallery_per_domain=3, samples_per_shard=4)
    generate_stream(tmp_path, phases=1, **args)
    before = tree_bytes(tmp_path / "phase-00")
    manifest = generate_stream(tmp_path, phases=2, **args)
    assert [p["domain"] for p in manifest["phases"]] == ["geometric", "signs"]
    assert tree_bytes(tmp_path / "phase-00") == before
    with pytest.raises(StreamError, match="only ever extended"):
        generate_stream(tmp_path, phases=1, **args)
    with pytest.raises(StreamError, match="image_size: 64 there, 32 asked"):
        generate_stream(tmp_path, phases=2, **{**args, "image_size": 32})
    with pytest.raises(ValueError, match="samples_per_phase"):
        generate_stream(tmp_path / "new", phases=1, **{**args, "samples_per_phase": 0})


def test_load_manifest_errors_name_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match=r"stream\.json not found.*compatflow data generate"):
        load_manifest(tmp_path)
    (tmp_path / "stream.json").write_text("{not json")
    with pytest.raises(StreamError, match="not valid JSON"):
        load_manifest(tmp_path)
    (tmp_path / "stream.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(StreamError, match="'format'"):
        load_manifest(tmp_path)
    doc = {
        "format": "compatflow-stream",
        "version": 1,
        "seed": 0,
        "image_size": 64,
        "phases": [
            {
                "phase": 0,
                "domain": "x",
                "train": [],
                "eval": [],
                "gallery": "nope",
                "counts": {"train": 0, "eval": 0, "gallery": 0},
            }
        ],
    }
    (tmp_path / "stream.json").write_text(json.dumps(doc))
    with pytest.raises(StreamError, match=r"phases\[0\]\.gallery"):
        load_manifest(tmp_path)


def iter_samples(stream: Path, phase: int, split: str):
    for url in phase_urls(stream, phase, split):
        for key, members in read_shard(Path(url)).items():
            yield key, members, json.loads(members["json"])


def test_metadata_is_valid_and_consistent_with_members(stream: Path) -> None:
    for phase in range(5):
        for split in ("train", "eval", "gallery"):
            for key, members, meta in iter_samples(stream, phase, split):
                assert set(members) == {"jpg", "txt", "json"}
                assert schema_errors(meta, "sample") == []
                assert meta["key"] == key and meta["phase"] == phase and meta["split"] == split
                assert meta["domain"] == domain_for_phase(phase).name
                assert meta["sha256"] == hashlib.sha256(members["jpg"]).hexdigest()
                image = Image.open(io.BytesIO(members["jpg"]))
                assert image.format == "JPEG" and image.size == (meta["width"], meta["height"]) == (64, 64)
                assert members["txt"].decode("utf-8") == meta["caption"] == meta["captions"][0]
                assert len(meta["captions"]) == 5 == len(set(meta["captions"]))
                assert meta["scene"]["count"] == len(meta["scene"]["objects"]) in (1, 2, 3)


def test_captions_name_the_rendered_attributes(stream: Path) -> None:
    for phase in range(5):
        domain = domain_for_phase(phase)
        kinds = {k.names[0]: k for k in domain.kinds}
        for _, _, meta in iter_samples(stream, phase, "eval"):
            scene = meta["scene"]
            captions = meta["captions"]  # eval captions keep template order
            for obj in scene["objects"]:
                names = kinds[obj["kind"]].names + kinds[obj["kind"]].plural
                for caption in captions:
                    assert obj["colour"] in caption
                    assert any(n in caption for n in names), (obj["kind"], caption)
                for t in (0, 1, 3, 4):
                    assert obj["size"] in captions[t] and obj["position"] in captions[t]
            assert all(scene["background"]["tone"] in c for c in captions)
            assert scene["style"] in captions[1] and scene["style"] in captions[4]
            n = scene["count"]
            assert ("one", "two", "three")[n - 1] + " " in captions[1]


def test_rendered_pixels_match_the_scene(stream: Path) -> None:
    """Plain-background flat drawings: the object's centre has its colour, a free corner the tone."""
    checked = 0
    for split in ("train", "eval", "gallery"):
        for _, members, meta in iter_samples(stream, 0, split):
            scene = meta["scene"]
            if scene["style"] != "flat" or scene["count"] != 1:
                continue
            arr = np.asarray(Image.open(io.BytesIO(members["jpg"])).convert("RGB"), dtype=np.float32)
            obj = scene["objects"][0]
            x0, y0, x1, y1 = (int(round(c * 64)) for c in obj["box"])
            cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
            assert np.abs(arr[cy - 1 : cy + 2, cx - 1 : cx + 2].mean((0, 1)) - obj["rgb"]).max() < 30
            corner = (0, 0) if obj["cell"] != [0, 0] else (60, 60)
            patch = arr[corner[1] : corner[1] + 4, corner[0] : corner[0] + 4].mean((0, 1))
            assert np.abs(patch - scene["background"]["rgb"]).max() < 20
            checked += 1
    assert checked >= 5


def test_captions_discriminate_between_images(stream: Path) -> None:
    for phase in range(5):
        firsts = [meta["captions"][0] for _, _, meta in iter_samples(stream, phase, "gallery")]
        firsts += [meta["captions"][0] for _, _, meta in iter_samples(stream, phase, "eval")]
        assert len(set(firsts)) == len(firsts)


def words(stream: Path, phase: int) -> set[str]:
    out: set[str] = set()
    for split in ("train", "eval"):
        for _, _, meta in iter_samples(stream, phase, split):
            for c in meta["captions"]:
                out |= set(re.findall(r"[a-z-]+", c))
    return out


def test_phases_shift_domain(stream: Path) -> None:
    vocab = [words(stream, p) for p in range(5)]
    for p in range(5):
        for q in range(p + 1, 5):
            a, b = BASE_DOMAINS[p], BASE_DOMAINS[q]
            assert not {k.names[0] for k in a.kinds} & {k.names[0] for k in b.kinds}
            assert not {c for c, _ in a.colours} & {c for c, _ in b.colours}
            assert not {t.texture for t in a.backgrounds} & {t.texture for t in b.backgrounds}
            assert not {s.effect for s in a.styles} & {s.effect for s in b.styles}
            jaccard = len(vocab[p] & vocab[q]) / len(vocab[p] | vocab[q])
            assert jaccard < 0.35, (p, q, sorted(vocab[p] & vocab[q]))
    for p in range(5):
        kinds = {o["kind"] for _, _, m in iter_samples(stream, p, "train") for o in m["scene"]["objects"]}
        assert kinds <= {k.names[0] for k in BASE_DOMAINS[p].kinds} and len(kinds) >= 3
    names = [domain_for_phase(p).name for p in range(20)]
    assert len(set(names)) == 20
    assert (
        domain_for_phase(5).kinds == BASE_DOMAINS[0].kinds
        and domain_for_phase(5).colours != BASE_DOMAINS[0].colours
    )
    with pytest.raises(ValueError):
        domain_for_phase(-1)


def test_later_phases_render(tmp_path: Path) -> None:
    for phase in (5, 9, 13):
        key, members = synth.make_sample(0, phase, "eval", 0, 32)
        meta = json.loads(members["json"])
        assert key == f"p{phase:02d}-eval-000000" and meta["domain"].startswith("mix-")
        assert Image.open(io.BytesIO(members["jpg"])).size == (32, 32)
        assert schema_errors(meta, "sample") == []


def test_cli_generate_and_info(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pipelines.cli import app

    runner = CliRunner()
    out = tmp_path / "cli-stream"
    argv = [
        "data",
        "generate",
        "--out",
        str(out),
        "--phases",
        "2",
        "--samples-per-phase",
        "8",
        "--seed",
        "4",
        "--eval-per-domain",
        "5",
        "--gallery-per-domain",
        "6",
        "--samples-per-shard",
        "4",
        "--shift",
        "disjoint",
        "--image-size",
        "32",
    ]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [p["domain"] for p in summary["phases"]] == ["geometric", "signs"]
    assert summary["phases"][0]["shards"] == {"train": 2, "eval": 2, "gallery": 2}
    manifest = load_manifest(out)
    assert manifest["image_size"] == 32 and manifest["seed"] == 4

    info = runner.invoke(app, ["data", "info", str(out)])
    assert info.exit_code == 0 and json.loads(info.stdout)["missing_shards"] == []
    (out / "phase-01/eval/shard-00001.tar").unlink()
    info = runner.invoke(app, ["data", "info", str(out)])
    assert info.exit_code == 1 and json.loads(info.stdout)["missing_shards"] == [
        "phase-01/eval/shard-00001.tar"
    ]

    bad = runner.invoke(app, argv[:-2] + ["--image-size", "48"])
    assert bad.exit_code == 2 and "other settings" in bad.stderr


def train_tiny_clip_and_score(stream_dir: Path, epochs: int) -> tuple[float, float]:
    """Train a 1M-parameter CLIP on phase 0; mean text->image R@5 on phase 0 and phase 1 eval sets."""
    import open_clip
    import torch
    import torch.nn.functional as F

    from compat.data.loader import ShardStream, iter_batches, load_captioned_set

    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=64,
        vision_cfg={"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
        text_cfg={"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    )
    mean = torch.tensor([0.48, 0.46, 0.41]).view(3, 1, 1)
    std = torch.tensor([0.27, 0.26, 0.28]).view(3, 1, 1)

    def transform(image: Image.Image) -> torch.Tensor:
        return (torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1) - mean) / std

    def tokenize(texts: list[str]) -> torch.Tensor:
        return open_clip.tokenize(texts, context_length=32)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98))
    stream = ShardStream(phase_urls(stream_dir, 0, "train"), seed=0, epochs=epochs)
    model.train()
    for batch in iter_batches(stream, 64, transform, tokenize, caption_choice="random", drop_last=True):
        image_features, text_features, scale = model(batch.images, batch.texts)[:3]
        logits = scale * image_features @ text_features.T
        labels = torch.arange(len(logits))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    def recall_at_5(phase: int) -> float:
        evalset = load_captioned_set(phase_urls(stream_dir, phase, "eval"))
        with torch.no_grad():
            images = model.encode_image(torch.stack([transform(i) for i in evalset.images]))
            images = F.normalize(images, dim=-1)
            hits = []
            for t in range(5):
                texts = tokenize([c[t] for c in evalset.captions])
                sim = F.normalize(model.encode_text(texts), dim=-1) @ images.T
                hits.append(((sim > sim.diag()[:, None]).sum(1) < 5).float().mean().item())
        return float(np.mean(hits))

    return recall_at_5(0), recall_at_5(1)


def test_tiny_clip_learns_the_captions_and_meets_a_new_domain(tmp_path: Path) -> None:
    """Briefly trained, a tiny CLIP retrieves phase-0 eval images far above chance (R@5 = 2.5%), and
    does far worse on phase 1, whose domain it has not seen."""
    import torch

    generate_stream(
        tmp_path,
        phases=2,
        samples_per_phase=3000,
        seed=0,
        eval_per_domain=200,
        gallery_per_domain=0,
        samples_per_shard=500,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model trains fastest on one thread, and the suite shares the cores
    try:
        seen, unseen = train_tiny_clip_and_score(tmp_path, epochs=5)
    finally:
        torch.set_num_threads(threads)
    assert seen > 0.3, seen
    assert unseen < seen / 2, (seen, unseen)
