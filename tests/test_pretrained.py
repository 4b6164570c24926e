"""A pretrained start: a checkpoint open_clip wrote is loaded (never unpickled), trained from and served."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from compat.models import build_model, load_checkpoint, read_sidecar, save_checkpoint
from compat.models.pretrained import PretrainedError, resolve_pretrained

# A small open_clip architecture of its own (the shape of cf-tiny, so that config can name the weights).
TINY = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
CAPTIONS = ["a red circle", "a blue square on stripes", "two green triangles"]


class NotATensor:
    """Anything but tensors in a .pt file must be refused, not unpickled."""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The state dict of an open_clip model built and saved by open_clip/torch, as .pt and .safetensors."""
    import open_clip
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(1234)
    model = open_clip.CLIP(**TINY).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, root / "open_clip_tiny.pt")
    torch.save(
        {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, root / "train_run.pt"
    )
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "open_clip_tiny.safetensors"))
    return root, model, state


def _images() -> list[Image.Image]:
    out = []
    for i, colour in enumerate([(220, 20, 20), (20, 20, 220), (20, 200, 20)]):
        image = Image.new("RGB", (80, 64), colour)
        image.paste((255, 255, 255), (i * 10, 10, i * 10 + 20, 30))
        out.append(image)
    return out


@pytest.mark.parametrize("name", ["open_clip_tiny.pt", "train_run.pt", "open_clip_tiny.safetensors"])
def test_local_open_clip_checkpoint_loads_with_equal_weights(written, name):
    root, _, state = written
    bundle = build_model("cf-tiny", pretrained=str(root / name))
    loaded = bundle.model.state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    assert (
        bundle.pretrained["path"] == str((root / name).resolve()) and len(bundle.pretrained["sha256"]) == 64
    )


def test_served_model_embeds_as_open_clip_does(written, tmp_path):
    from compat.production import load_encoder

    root, model, _ = written
    bundle = build_model("cf-tiny", pretrained=str(root / "open_clip_tiny.pt"))
    save_checkpoint(bundle, tmp_path / "m", version="v0")
    assert read_sidecar(tmp_path / "m")["pretrained"]["sha256"] == bundle.pretrained["sha256"]
    served = load_encoder(tmp_path / "m")
    images = _images()
    with torch.no_grad():
        pixels = torch.stack([bundle.preprocess_eval(im) for im in images])
        want_images = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1)
        want_texts = torch.nn.functional.normalize(model.encode_text(bundle.tokenizer(CAPTIONS)), dim=-1)
    assert torch.allclose(served.encode_images(images), want_images, atol=1e-5)
    assert torch.allclose(served.encode_texts(CAPTIONS), want_texts, atol=1e-5)


def test_pickled_objects_are_refused_not_loaded(written, tmp_path):
    root, _, state = written
    torch.save({"state_dict": state, "extra": NotATensor()}, tmp_path / "hostile.pt")
    with pytest.raises(PretrainedError, match="never unpickled"):
        build_model("cf-tiny", pretrained=str(tmp_path / "hostile.pt"))


def test_bad_specs_name_the_problem(written, tmp_path):
    root, _, _ = written
    with pytest.raises(PretrainedError, match="does not exist"):
        build_model("cf-tiny", pretrained=str(tmp_path / "missing.pt"))
    with pytest.raises(PretrainedError, match="do not fit"):
        build_model("cf-small", pretrained=str(root / "open_clip_tiny.pt"))
    (tmp_path / "weights.ckpt").write_bytes(b"x")
    with pytest.raises(PretrainedError, match="must end in"):
        resolve_pretrained(str(tmp_path / "weights.ckpt"))
    with pytest.raises(PretrainedError, match="open_clip_model"):
        resolve_pretrained("openai")
    with pytest.raises(PretrainedError, match="no pretrained tag 'nonsense'"):
        resolve_pretrained("nonsense", arch="ViT-B-32")


def test_a_tag_missing_from_the_cache_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # an empty ~/.cache/clip
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(PretrainedError) as caught:
        resolve_pretrained("openai", arch="ViT-B-32")
    message = str(caught.value)
    assert "ViT-B-32/openai" in message and "not in the local cache" in message
    assert "download" in message and ("huggingface.co" in message or "openaipublic" in message)


def _sample(key: str, caption: str) -> dict[str, bytes]:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (len(key) * 53 % 256, 120, 40)).save(buffer, "JPEG")
    meta = {"key": key, "width": 64, "height": 64, "status": "success"}
    return {"jpg": buffer.getvalue(), "txt": caption.encode(), "json": json.dumps(meta).encode()}


def _shard(path: Path, prefix: str, n: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in _sample(f"{prefix}{i:03d}", CAPTIONS[i % 3]).items():
                info = tarfile.TarInfo(f"{prefix}{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_bootstrap_starts_from_the_pretrained_weights(written, tmp_path):
    from compat.data.manifest import add_phase
    from components.continual import TrainingSettings, run_continual

    root, _, state = written
    stream = tmp_path / "stream"
    add_phase(
        stream,
        {
            "train": [_shard(tmp_path / "in" / "train.tar", "t", 8)],
            "eval": [_shard(tmp_path / "in" / "eval.tar", "e", 4)],
            "gallery": [_shard(tmp_path / "in" / "gallery.tar", "g", 4)],
        },
        "shapes",
    )
    out = tmp_path / "continual"
    settings = TrainingSettings(
        config_name="cf-tiny",
        steps=1,
        batch_size=4,
        lr=0.0,  # one step that moves nothing: the first model is the pretrained one
        checkpoint_every=0,
        device="cpu",
        pretrained=str(root / "open_clip_tiny.safetensors"),
        resize_mode="longest",
    )
    run_continual(stream, 0, out, settings)
    first = load_checkpoint(out / "model")
    weights = first.model.state_dict()
    assert all(torch.equal(weights[k], state[k]) for k in state)
    assert first.resize_mode == "longest" and first.pretrained["spec"].endswith("open_clip_tiny.safetensors")


def test_pipeline_config_names_the_start_weights_and_is_checked_at_load(written, tmp_path):
    import yaml

    from pipelines.config import CONFIG_DIR, ConfigError, load_config

    root, _, _ = written
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["training"]["pretrained"] = str(root / "open_clip_tiny.pt")
    document["training"]["resize_mode"] = "squash"
    path = tmp_path / "with_pretrained.yaml"
    path.write_text(yaml.safe_dump(document))
    assert load_config(path).training.pretrained.endswith("open_clip_tiny.pt")
    document["training"]["pretrained"] = str(tmp_path / "nowhere.safetensors")
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match=r"training\.pretrained: pretrained file .*nowhere.safetensors"):
        load_config(path)
    document["training"]["pretrained"], document["training"]["resize_mode"] = None, "crop"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="resize_mode"):
        load_config(path)
