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
    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings, run_continual

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
    settings = TrainingSettings.from_section(
        TrainingSection(),
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


# --------------------------------------------------------------------------------------------------------
# open_clip architectures and tags: a weights folder laid out <ARCH>/<TAG>/, the Hugging Face cache, fetch


def test_a_tag_resolves_from_the_weights_folder_then_the_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from compat.models.pretrained import find_cached

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(PretrainedError, match=r"compatflow models fetch ViT-B-32 laion2b_s34b_b79k --to"):
        resolve_pretrained("laion2b_s34b_b79k", arch="ViT-B-32", weights_dirs=[tmp_path / "weights"])
    # The Hugging Face cache's layout, as `huggingface-cli download` leaves it.
    repo = tmp_path / "hf" / "models--laion--CLIP-ViT-B-32-laion2B-s34B-b79K"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "open_clip_model.safetensors").write_bytes(b"weights")
    found = resolve_pretrained("laion2b_s34b_b79k", arch="ViT-B-32", weights_dirs=[tmp_path / "weights"])
    assert found.name == "open_clip_model.safetensors" and "snapshots" in found.parts
    # A weights folder (a mounted volume, the workspace's weights/) comes first.
    tag_dir = tmp_path / "weights" / "ViT-B-32" / "laion2b_s34b_b79k"
    tag_dir.mkdir(parents=True)
    (tag_dir / "open_clip_pytorch_model.bin").write_bytes(b"weights")
    assert find_cached("ViT-B-32", "laion2b_s34b_b79k", [tmp_path / "weights"])[0] == (
        tag_dir / "open_clip_pytorch_model.bin"
    )
    assert resolve_pretrained(str(tag_dir)) == tag_dir / "open_clip_pytorch_model.bin"  # the folder as a path
    with pytest.raises(PretrainedError, match=r"no pretrained tag 'nonsense' for 'ViT-B-32' nor a folder"):
        resolve_pretrained("nonsense", arch="ViT-B-32", weights_dirs=[tmp_path / "weights"])


def test_fetch_puts_a_tag_where_it_is_read_and_fails_without_a_network(tmp_path, monkeypatch):
    """The hub client is replaced (there is no network here): fetch writes <dir>/<ARCH>/<TAG>/<file> whole or
    nothing, and a failed download is an error saying a network is needed, leaving no folder behind."""
    import huggingface_hub

    from compat.models.pretrained import fetch

    def unreachable(**kwargs):
        Path(kwargs["local_dir"], ".cache").mkdir(parents=True)  # what the client leaves before it fails
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(PretrainedError, match="needs a network that reaches huggingface.co"):
        fetch("ViT-B-32", "laion2b_s34b_b79k", tmp_path)
    assert not list((tmp_path / "ViT-B-32").iterdir())
    with pytest.raises(PretrainedError, match="no Hugging Face pretrained tag 'nonsense'"):
        fetch("ViT-B-32", "nonsense", tmp_path)

    def downloads(repo_id, filename, local_dir):
        assert repo_id == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
        Path(local_dir, ".cache").mkdir(parents=True)
        Path(local_dir, filename).write_bytes(b"weights")
        return str(Path(local_dir, filename))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", downloads)
    path = fetch("ViT-B-32", "laion2b_s34b_b79k", tmp_path)
    assert path == tmp_path / "ViT-B-32" / "laion2b_s34b_b79k" / "open_clip_model.safetensors"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert resolve_pretrained("laion2b_s34b_b79k", arch="ViT-B-32", weights_dirs=[tmp_path]) == path


def test_the_models_command_lists_configs_tags_and_what_is_cached(tmp_path):
    import json as json_module

    from typer.testing import CliRunner

    from pipelines.cli import app

    (tmp_path / "w" / "ViT-B-32" / "laion2b_s34b_b79k").mkdir(parents=True)
    (tmp_path / "w" / "ViT-B-32" / "laion2b_s34b_b79k" / "open_clip_model.safetensors").write_bytes(b"x")
    runner = CliRunner()
    args = ["models", "--weights-dir", str(tmp_path / "w"), "--arch", "ViT-B-32", "--arch", "cf-tiny"]
    shown = runner.invoke(app, [*args, "--json"])
    assert shown.exit_code == 0, shown.output
    rows = {row["config"]: row for row in json_module.loads(shown.stdout)["configs"]}
    assert rows["cf-tiny"]["kind"] == "compatflow" and rows["cf-tiny"]["tags"] == []
    tags = {t["tag"]: t for t in rows["ViT-B-32"]["tags"]}
    assert tags["laion2b_s34b_b79k"]["cached"] and not tags["openai"]["cached"]
    text = runner.invoke(app, [*args, "--cached"])
    assert text.exit_code == 0 and "laion2b_s34b_b79k" in text.stdout and "openai" not in text.stdout
    refused = runner.invoke(app, ["models", "fetch", "cf-tiny", "x", "--to", str(tmp_path)])
    assert refused.exit_code == 2 and "not an open_clip architecture" in refused.output


def test_a_cycle_starts_from_a_real_architecture_saved_as_a_tag_in_the_weights_folder(tmp_path):
    """ViT-S-32-alt (open_clip's smallest built-in) with random weights that open_clip wrote, stored as a
    tag in the workspace's weights folder: the pipeline config names the architecture and the tag, its check
    at load finds them, and the bootstrap trains from exactly those weights (lr 0: nothing moves)."""
    import dataclasses

    import open_clip
    import yaml
    from safetensors.torch import save_file

    from compat.data.manifest import add_phase
    from components.state.workspace import Workspace
    from components.training.continual import TrainingSettings, run_continual
    from pipelines.config import CONFIG_DIR, load_config

    torch.manual_seed(7)
    model = open_clip.create_model("ViT-S-32-alt", pretrained=None)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    del model
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["workspace"] = str(tmp_path / "ws")
    document["training"].update(model_config="ViT-S-32-alt", pretrained="random-init")
    weights = Workspace(tmp_path / "ws").weights_dir / "ViT-S-32-alt" / "random-init"
    weights.mkdir(parents=True)
    save_file(state, str(weights / "open_clip_model.safetensors"))
    path = tmp_path / "real_arch.yaml"
    path.write_text(yaml.safe_dump(document))
    deployment = load_config(path)  # checked at load: the tag is found in <workspace>/weights

    stream = tmp_path / "stream"
    add_phase(
        stream,
        {
            "train": [_shard(tmp_path / "in" / "train.tar", "t", 4)],
            "eval": [_shard(tmp_path / "in" / "eval.tar", "e", 3)],
            "gallery": [_shard(tmp_path / "in" / "gallery.tar", "g", 3)],
        },
        "shapes",
    )
    settings = dataclasses.replace(  # as the continual step makes them
        TrainingSettings.from_section(deployment.training),
        steps=1,
        batch_size=4,
        replay_buffer_size=0,
        replay_rows=0,
        lr=0.0,
        checkpoint_every=0,
        device="cpu",
        weights_dir=str(Workspace.of(deployment).weights_dir),
    )
    run_continual(stream, 0, tmp_path / "continual", settings)
    first = load_checkpoint(tmp_path / "continual" / "model")
    assert first.config_name == "ViT-S-32-alt" and first.image_size == 224
    loaded = first.model.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert first.pretrained["spec"] == "random-init"
    assert first.pretrained["path"] == str((weights / "open_clip_model.safetensors").resolve())
