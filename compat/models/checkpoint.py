"""Checkpoints: ``model.safetensors`` plus a ``model.json`` sidecar, checksummed, never unpickled.

The sidecar records how images are resized for the model (``resize_mode``; absent in older sidecars, which
mean ``shortest``), so whoever loads it preprocesses as training did, and where pretrained start weights came
from (``pretrained``). The sidecar is written last (temp file + rename), so a directory holding a sidecar
always holds the complete weights it describes. Loading verifies the weights' sha256 before reading them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from compat.io import atomic_write, read_json, utc_now
from compat.models.factory import ClipBundle, _build, config_path, read_config, tokenizer_name_of

if TYPE_CHECKING:  # pragma: no cover
    import torch

FORMAT = "compatflow-checkpoint"
WEIGHTS_FILE = "model.safetensors"
SIDECAR_FILE = "model.json"
REQUIRED_FIELDS = ("format", "config_name", "embed_dim", "image_size", "tokenizer", "version", "sha256")


class CheckpointError(ValueError):
    """A checkpoint whose sidecar or weights are inconsistent or malformed."""


class ChecksumError(CheckpointError):
    """The weights file's sha256 differs from the one recorded in the sidecar."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def tensors_digest(path: Path) -> str:
    """sha256 of a checkpoint's tensors (names, dtypes, shapes and bytes), ``path`` = directory or sidecar.

    Equal weights give equal digests, whatever order safetensors wrote its header metadata in (it keeps
    none, so the file's own sha256 can differ between two saves of the same weights).
    """
    import torch
    from safetensors import safe_open

    weights = _sidecar_path(path).parent / WEIGHTS_FILE
    digest = hashlib.sha256()
    with safe_open(str(weights), framework="pt") as fh:
        for name in sorted(fh.keys()):
            tensor = fh.get_tensor(name).contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(
    bundle: ClipBundle,
    out_dir: Path,
    *,
    version: str,
    extra: dict | None = None,
    state_dict: dict | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` and the ``out_dir/model.json`` sidecar; return the sidecar path.

    ``state_dict`` defaults to ``bundle.model.state_dict()``; pass one to save other weights of the
    same architecture (e.g. merged adapters). ``extra`` must be JSON-serialisable.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_dict = state_dict if state_dict is not None else bundle.model.state_dict()
    # detached, contiguous CPU copies: safetensors refuses tensors sharing storage
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    param_names = {name for name, _ in bundle.model.named_parameters()}
    metadata = {"format": FORMAT, "config_name": bundle.config_name, "version": str(version)}
    weights = out_dir / WEIGHTS_FILE
    atomic_write(weights, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    sidecar = {
        "format": FORMAT,
        "config_name": bundle.config_name,
        "embed_dim": bundle.embed_dim,
        "image_size": bundle.image_size,
        "tokenizer": bundle.tokenizer_name,
        "version": str(version),
        "sha256": sha256_file(weights),
        "created_at": utc_now(),
        "parameters": int(sum(t.numel() for k, t in tensors.items() if k in param_names)),
        "resize_mode": bundle.resize_mode,
        "extra": extra or {},
    }
    if bundle.pretrained:
        sidecar["pretrained"] = bundle.pretrained
    text = json.dumps(sidecar, indent=2, sort_keys=True) + "\n"
    path = out_dir / SIDECAR_FILE
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def _sidecar_path(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / SIDECAR_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint sidecar {path} is missing; a checkpoint directory holds "
            f"{SIDECAR_FILE} and {WEIGHTS_FILE} written by save_checkpoint"
        )
    return path


def read_sidecar(path: Path) -> dict:
    """Read and validate a checkpoint sidecar (``path`` = checkpoint directory or its model.json)."""
    path = _sidecar_path(path)
    doc = read_json(path, CheckpointError)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if missing := [k for k in REQUIRED_FIELDS if k not in doc]:
        raise CheckpointError(f"{path}: missing field(s) {missing}")
    if doc["format"] != FORMAT:
        raise CheckpointError(f"{path}: field 'format' is {doc['format']!r}, expected {FORMAT!r}")
    try:
        config = read_config(doc["config_name"])
    except KeyError as exc:
        raise CheckpointError(f"{path}: field 'config_name': {exc.args[0]}") from exc
    expected = {
        "embed_dim": config["embed_dim"],
        "image_size": config["vision_cfg"]["image_size"],
        "tokenizer": tokenizer_name_of(config),
    }
    for key, want in expected.items():
        if doc[key] != want:
            raise CheckpointError(
                f"{path}: field {key!r} is {doc[key]!r} but config {doc['config_name']!r} "
                f"({config_path(doc['config_name'])}) has {want!r}"
            )
    from compat.data.images import DEFAULT_RESIZE_MODE, check_resize_mode

    try:
        check_resize_mode(doc.setdefault("resize_mode", DEFAULT_RESIZE_MODE), f"{path}: field 'resize_mode'")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    return doc


def verified_weights(sidecar_path: Path, doc: dict) -> Path:
    """The weights file beside a sidecar, once its sha256 matches the sidecar (else ChecksumError)."""
    weights = Path(sidecar_path).parent / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"checkpoint weights {weights} are missing (sidecar {sidecar_path} refers to them)"
        )
    if (actual := sha256_file(weights)) != doc["sha256"]:
        raise ChecksumError(
            f"{weights}: sha256 mismatch: expected {doc['sha256']} (from {sidecar_path}), "
            f"actual {actual}; the file was modified or truncated"
        )
    return weights


def load_checkpoint(path: Path, *, device: str | torch.device = "cpu") -> ClipBundle:
    """Load a checkpoint written by :func:`save_checkpoint` (``path`` = directory or model.json).

    The weights' sha256 is checked against the sidecar before they are read; the state dict is
    loaded strictly; images are preprocessed with the sidecar's ``resize_mode``. Raises FileNotFoundError,
    CheckpointError or ChecksumError with the file named.
    """
    from safetensors import safe_open

    sidecar_path = _sidecar_path(path)
    doc = read_sidecar(sidecar_path)
    weights = verified_weights(sidecar_path, doc)
    try:
        with safe_open(str(weights), framework="pt") as fh:
            meta = fh.metadata() or {}
            state_dict = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError for malformed files
        raise CheckpointError(f"{weights}: not a readable safetensors file ({exc})") from exc
    if meta.get("config_name") != doc["config_name"]:
        raise CheckpointError(
            f"{sidecar_path}: config_name {doc['config_name']!r} does not match the weights "
            f"{weights} (written for {meta.get('config_name')!r})"
        )
    bundle = _build(
        doc["config_name"], device="cpu", seed=None, pretrained_text=False, resize_mode=doc["resize_mode"]
    )
    bundle.pretrained = doc.get("pretrained")
    try:
        bundle.model.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{weights}: weights do not fit config {doc['config_name']!r}: {exc}") from exc
    bundle.model.to(device)
    return bundle
