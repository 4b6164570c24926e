"""Pretrained start weights: a local open_clip checkpoint file, or an open_clip tag in the local cache.

A spec is a path to a ``.safetensors`` file or to a ``.pt``/``.pth``/``.bin`` file holding a state dict
(plain, or under ``"state_dict"`` as open_clip's training program saves it; ``module.`` prefixes dropped),
or an open_clip pretrained tag (``openai``, ``laion2b_s34b_b79k``, ...) of the architecture the model config
names in ``open_clip_model``. Tags are looked up in the local caches only (the Hugging Face hub cache, then
open_clip's ``~/.cache/clip``): nothing is downloaded; a missing file is an error naming what to download and
where.
``.pt`` files are read with ``torch.load(weights_only=True)``: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_FREE_SUFFIXES = (".pt", ".pth", ".bin")  # read with torch.load(weights_only=True)
WEIGHT_SUFFIXES = SAFETENSORS_SUFFIXES + PICKLE_FREE_SUFFIXES


class PretrainedError(ValueError):
    """Pretrained weights cannot be found or do not fit the model; the message says what to do."""


def looks_like_path(spec: str) -> bool:
    """True when ``spec`` names a file (a weights suffix or a path separator), not an open_clip tag."""
    return spec.lower().endswith(WEIGHT_SUFFIXES) or "/" in spec or os.sep in spec or spec.startswith("~")


def resolve_pretrained(spec: str, *, arch: str | None = None, where: str = "pretrained") -> Path:
    """The local weights file of ``spec`` (a file path, or a tag of open_clip architecture ``arch``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise PretrainedError(f"{where}: pretrained must be a file path or an open_clip tag, got {spec!r}")
    if looks_like_path(spec):
        path = Path(os.path.expandvars(spec)).expanduser()
        if path.suffix.lower() not in WEIGHT_SUFFIXES:
            raise PretrainedError(
                f"{where}: pretrained file {spec!r} must end in {', '.join(WEIGHT_SUFFIXES)} "
                "(a state dict saved by torch.save, or safetensors)"
            )
        if not path.is_file():
            raise PretrainedError(
                f"{where}: pretrained file {path} does not exist (relative paths are read from {os.getcwd()})"
            )
        return path
    return _cached_tag(spec, arch, where)


def _cached_tag(tag: str, arch: str | None, where: str) -> Path:
    from open_clip.pretrained import get_pretrained_cfg, list_pretrained_tags_by_model

    if not arch:
        raise PretrainedError(
            f"{where}: pretrained {tag!r} is an open_clip tag, but the model config names no open_clip "
            'architecture: add "open_clip_model" (e.g. "ViT-B-32") or give a .pt/.safetensors file'
        )
    cfg = get_pretrained_cfg(arch, tag)
    if not cfg:
        tags = list_pretrained_tags_by_model(arch)
        raise PretrainedError(
            f"{where}: open_clip has no pretrained tag {tag!r} for {arch!r}; "
            f"known: {', '.join(tags) or 'none'}"
        )
    if cfg.get("file") and Path(cfg["file"]).is_file():
        return Path(cfg["file"])
    tried: list[str] = []
    hint = ""
    hub = cfg.get("hf_hub", "")
    if hub:
        if hub.endswith("/"):
            repo, filename = hub.rstrip("/"), "open_clip_pytorch_model.bin"
        else:
            repo, filename = os.path.split(hub)
        candidates = [filename]
        if filename.endswith((".bin", ".pth")):
            candidates.insert(0, filename.rsplit(".", 1)[0] + ".safetensors")
        from huggingface_hub import constants, hf_hub_download

        for name in candidates:
            try:
                return Path(hf_hub_download(repo_id=repo, filename=name, local_files_only=True))
            except Exception:
                tried.append(f"https://huggingface.co/{repo}/resolve/main/{name}")
        hint = (
            f"run `huggingface-cli download {repo} {candidates[0]}` on a machine with internet and copy its "
            f"cache into {constants.HF_HUB_CACHE} (or set HF_HUB_CACHE), "
        )
    url = cfg.get("url", "")
    if url:
        target = Path("~/.cache/clip").expanduser() / os.path.basename(url)
        if target.is_file():
            return target
        tried.append(url)
        if not hub:  # a hub copy is a plain state dict; some of these URLs are TorchScript archives
            hint = f"download {url} to {target}, "
    raise PretrainedError(
        f"{where}: open_clip pretrained weights {arch}/{tag} are not in the local cache and nothing is "
        f"downloaded at run time ({', '.join(tried)}): {hint}"
        "or point pretrained at a local .pt/.safetensors file"
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a weights file: safetensors, or ``torch.load(weights_only=True)`` (no unpickling)."""
    import pickle

    import torch

    path = Path(path)
    if path.suffix.lower() in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        try:
            loaded: Any = load_file(str(path), device="cpu")
        except Exception as exc:
            raise PretrainedError(f"{path}: not a readable safetensors file ({exc})") from exc
    else:
        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise PretrainedError(
                f"{path}: holds objects other than tensors, which are never unpickled here; save a plain "
                f"state dict (torch.save(model.state_dict(), ...)) or safetensors "
                f"({str(exc).splitlines()[0]})"
            ) from exc
        except Exception as exc:
            raise PretrainedError(f"{path}: not a readable torch file ({exc})") from exc
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if (
        not isinstance(loaded, dict)
        or not loaded
        or not all(isinstance(v, torch.Tensor) for v in loaded.values())
    ):
        raise PretrainedError(f"{path}: expected a state dict of tensor names to tensors")
    if all(k.startswith("module.") for k in loaded):
        loaded = {k[len("module.") :]: v for k, v in loaded.items()}
    return loaded


def load_pretrained(
    model: torch.nn.Module, spec: str, *, arch: str | None = None, where: str = "pretrained"
) -> dict[str, Any]:
    """Load the weights ``spec`` names into ``model`` (strictly); return their source and sha256."""
    path = resolve_pretrained(spec, arch=arch, where=where)
    state = read_state_dict(path)
    own = model.state_dict()
    if (
        "logit_scale" in state
        and "logit_scale" in own
        and state["logit_scale"].shape != own["logit_scale"].shape
    ):
        state["logit_scale"] = state["logit_scale"].reshape(own["logit_scale"].shape)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        parts = [
            f"{label} {names[:5]}{' ...' if len(names) > 5 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
            if names
        ]
        raise PretrainedError(
            f"{where}: weights {path} do not fit the model config ({'; '.join(parts)}); pretrained weights "
            "must come from the same open_clip architecture"
        )
    model.load_state_dict(state, strict=True)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return {"spec": spec, "path": str(Path(path).resolve()), "sha256": digest.hexdigest()}
