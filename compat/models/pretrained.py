"""Pretrained start weights: a local open_clip checkpoint, or an open_clip tag in a weights folder or cache.

A spec is a path to a ``.safetensors`` file or to a ``.pt``/``.pth``/``.bin`` file holding a state dict
(plain, or under ``"state_dict"`` as open_clip's training program saves it; ``module.`` prefixes dropped), a
folder holding one such file, or a pretrained tag (``openai``, ``laion2b_s34b_b79k``, ...) of the open_clip
architecture the model config is (or names in ``open_clip_model``). A tag is looked up, in this order, in the
weights folders given (laid out ``<folder>/<ARCH>/<TAG>/<weights file>``, as :func:`fetch` writes them: a
mounted volume, the workspace's ``weights/``), the Hugging Face hub cache, then open_clip's ``~/.cache/clip``.
Nothing is downloaded at run time: a missing tag is an error naming the command that fetches it. A weights
folder may also hold tags of its own (a team's weights under a name of theirs).
``.pt`` files are read with ``torch.load(weights_only=True)``: nothing is ever unpickled.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# The file names open_clip's hub repos use, preferred in this order when a folder holds several.
HUB_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


class PretrainedError(ValueError):
    """Pretrained weights cannot be found or do not fit the model; the message says what to do."""


def looks_like_path(spec: str) -> bool:
    """True when ``spec`` names a file (a weights suffix or a path separator), not an open_clip tag."""
    return spec.lower().endswith(WEIGHT_SUFFIXES) or "/" in spec or os.sep in spec or spec.startswith("~")


def resolve_pretrained(
    spec: str,
    *,
    arch: str | None = None,
    where: str = "pretrained",
    weights_dirs: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """The local weights file of ``spec``: a file or folder path, or a tag of open_clip architecture ``arch``
    found in ``weights_dirs`` (``<dir>/<arch>/<tag>/``) or the local caches."""
    if not isinstance(spec, str) or not spec.strip():
        raise PretrainedError(f"{where}: pretrained must be a file path or an open_clip tag, got {spec!r}")
    if looks_like_path(spec):
        path = Path(os.path.expandvars(spec)).expanduser()
        if path.is_dir():
            return weights_in(path, where)
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
    return _cached_tag(spec, arch, where, weights_dirs)


def weights_in(folder: Path, where: str = "pretrained") -> Path:
    """The weights file of a folder: one of :data:`HUB_FILES`, else its one file with a weights suffix."""
    for name in HUB_FILES:
        if (folder / name).is_file():
            return folder / name
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES)
    if len(found) != 1:
        raise PretrainedError(
            f"{where}: folder {folder} holds {len(found)} weights files "
            f"({', '.join(p.name for p in found)}); it must hold one of {', '.join(HUB_FILES)} "
            f"or a single {'/'.join(WEIGHT_SUFFIXES)} file"
        )
    return found[0]


def hub_files(cfg: dict[str, Any]) -> tuple[str, list[str]]:
    """The Hugging Face repo of an open_clip pretrained config and its file names, safetensors first."""
    hub = cfg.get("hf_hub", "")
    if hub.endswith("/"):
        repo, filename = hub.rstrip("/"), "open_clip_pytorch_model.bin"
    else:
        repo, filename = os.path.split(hub)
    candidates = [filename]
    if filename == HUB_FILES[1]:  # open_clip's own choice of the safetensors copy of its default file
        candidates.insert(0, HUB_FILES[0])
    elif filename.endswith((".bin", ".pth")):
        candidates.insert(0, filename.rsplit(".", 1)[0] + ".safetensors")
    return repo, candidates


def find_cached(
    arch: str, tag: str, weights_dirs: Sequence[str | os.PathLike[str]] = ()
) -> tuple[Path | None, list[str]]:
    """Where the weights of ``arch``/``tag`` are on this machine (None: nowhere), and every place looked."""
    tried: list[str] = []
    for root in weights_dirs:
        folder = Path(root).expanduser() / arch / tag
        if folder.is_dir():
            return weights_in(folder, f"{arch}/{tag}"), tried
        tried.append(str(folder))
    from open_clip.pretrained import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch, tag) or {}
    if cfg.get("file") and Path(cfg["file"]).is_file():
        return Path(cfg["file"]), tried
    if cfg.get("hf_hub"):
        from huggingface_hub import try_to_load_from_cache

        repo, candidates = hub_files(cfg)
        for name in candidates:
            if isinstance(cached := try_to_load_from_cache(repo_id=repo, filename=name), str):
                return Path(cached), tried
            tried.append(f"hf://{repo}/{name}")
    if cfg.get("url"):
        target = Path("~/.cache/clip").expanduser() / os.path.basename(cfg["url"])
        if target.is_file():
            return target, tried
        tried.append(str(target))
    return None, tried


def _cached_tag(
    tag: str, arch: str | None, where: str, weights_dirs: Sequence[str | os.PathLike[str]]
) -> Path:
    from open_clip.pretrained import get_pretrained_cfg, list_pretrained_tags_by_model

    if not arch:
        raise PretrainedError(
            f"{where}: pretrained {tag!r} is an open_clip tag, but the model config names no open_clip "
            'architecture: use one (e.g. "ViT-B-32") as the model config, add "open_clip_model" to yours, '
            "or give a .pt/.safetensors file"
        )
    found, tried = find_cached(arch, tag, weights_dirs)
    if found is not None:
        return found
    if not get_pretrained_cfg(arch, tag):
        tags = list_pretrained_tags_by_model(arch)
        folders = f" nor a folder {', '.join(tried)}" if tried else ""
        raise PretrainedError(
            f"{where}: open_clip has no pretrained tag {tag!r} for {arch!r}{folders}; "
            f"known: {', '.join(tags) or 'none'}"
        )
    into = f" --to {weights_dirs[0]}" if weights_dirs else " --to DIR"
    raise PretrainedError(
        f"{where}: open_clip pretrained weights {arch}/{tag} are not in the local cache or a weights folder "
        f"and nothing is downloaded at run time (looked in {', '.join(tried)}): run `compatflow models fetch "
        f"{arch} {tag}{into}` where huggingface.co can be reached (it puts the weights where the pipeline "
        "reads them; copy the folder over if that is another machine), or point pretrained at a local "
        ".pt/.safetensors file"
    )


def fetch(arch: str, tag: str, weights_dir: str | os.PathLike[str]) -> Path:
    """Download the weights of open_clip tag ``arch``/``tag`` into ``<weights_dir>/<arch>/<tag>/`` (the one
    operation here that uses a network); returns the file. Raises :class:`PretrainedError` naming the
    problem (an unknown tag, no network)."""
    from huggingface_hub import constants, hf_hub_download
    from open_clip.pretrained import get_pretrained_cfg, list_pretrained_tags_by_model

    cfg = get_pretrained_cfg(arch, tag)
    if not cfg or not cfg.get("hf_hub"):
        raise PretrainedError(
            f"open_clip has no Hugging Face pretrained tag {tag!r} for {arch!r}; "
            f"known: {', '.join(list_pretrained_tags_by_model(arch)) or 'none'}"
        )
    folder = Path(weights_dir).expanduser() / arch / tag
    repo, candidates = hub_files(cfg)
    # Downloaded beside its place and renamed into it: a folder under <ARCH>/<TAG> always holds the weights.
    partial = folder.parent / f".fetch-{tag}-{uuid.uuid4().hex[:8]}"
    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False  # asked for: this one call goes out
    errors = []
    try:
        for name in candidates:
            try:
                hf_hub_download(repo_id=repo, filename=name, local_dir=partial)
            except Exception as exc:  # the hub client raises many kinds (HTTP, connection, not found)
                errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            shutil.rmtree(partial / ".cache", ignore_errors=True)  # the hub client's bookkeeping
            if folder.exists():
                shutil.rmtree(folder)
            partial.replace(folder)
            return folder / name
    finally:
        constants.HF_HUB_OFFLINE = offline
        shutil.rmtree(partial, ignore_errors=True)
    raise PretrainedError(
        f"cannot download {arch}/{tag} from https://huggingface.co/{repo} ({'; '.join(errors)}): fetching "
        f"needs a network that reaches huggingface.co; run it where one does and copy {folder} over"
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a weights file: safetensors, or ``torch.load(weights_only=True)`` (no unpickling)."""
    import pickle

    import torch

    path = Path(path)
    if path.suffix.lower() == ".safetensors":
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
    model: torch.nn.Module,
    spec: str,
    *,
    arch: str | None = None,
    where: str = "pretrained",
    weights_dirs: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """Load the weights ``spec`` names into ``model`` (strictly); return their source and sha256."""
    path = resolve_pretrained(spec, arch=arch, where=where, weights_dirs=weights_dirs)
    state = read_state_dict(path)
    own = model.state_dict()
    if "logit_scale" in state and "logit_scale" in own:
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
    from compat.models.checkpoint import sha256_file

    model.load_state_dict(state, strict=True)
    return {"spec": spec, "path": str(Path(path).resolve()), "sha256": sha256_file(path)}
