"""Serving an adapted open_clip model through heads (as a :class:`~compat.models.ClipBundle`, whose
``encode_*`` do batching, preprocessing, eval mode and devices), and the adapter-free state of an adapted
model (LoRA, prompts and tied adapters dropped, peft's ``base_layer`` unwrapped: the original new model) and
the loading of saved adapter tensors."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from compat.modules import adapters as _adapters
from compat.modules import visual_prompts as _prompts

if TYPE_CHECKING:  # pragma: no cover
    from compat.models import ClipBundle

_ADAPTER_SEGMENTS = {_adapters.ATTRIBUTE, _prompts.ATTRIBUTE}


class ProjectedCLIP(nn.Module):
    """``head(f(x))`` for an open_clip model's ``f = encode_image`` / ``encode_text``.

    ``normalize_inputs`` l2-normalises the embedding before the head (XBT: "all embeddings are
    l2-normalized"); TaCA feeds the raw visual output to its projector (its Algorithm 1). A modality without
    a head is not served by this model (``encode_text`` raises).
    """

    def __init__(
        self, clip: nn.Module, image_head: nn.Module, text_head: nn.Module | None, normalize_inputs: bool
    ) -> None:
        super().__init__()
        self.clip, self.image_head, self.text_head = clip, image_head, text_head
        self.normalize_inputs = normalize_inputs

    def _head(self, head: nn.Module, features: torch.Tensor, normalize: bool) -> torch.Tensor:
        if self.normalize_inputs:
            features = F.normalize(features, dim=-1)
        out = head(features)
        return F.normalize(out, dim=-1) if normalize else out

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        return self._head(self.image_head, self.clip.encode_image(images), normalize)

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        if self.text_head is None:
            raise TypeError("this projected model serves images only; texts are encoded by another model")
        return self._head(self.text_head, self.clip.encode_text(tokens), normalize)


def projected_bundle(bundle: ClipBundle, model: ProjectedCLIP, out_dim: int) -> ClipBundle:
    """``bundle`` (same preprocessing and tokenizer) served through ``model``, output dim ``out_dim``."""
    return dataclasses.replace(bundle, model=model, embed_dim=int(out_dim))


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The original model's state dict read from an adapted ``model`` (adapter entries dropped)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        segments = key.split(".")
        if not any(s.startswith("lora_") or s in _ADAPTER_SEGMENTS for s in segments):
            out[".".join(s for s in segments if s != "base_layer")] = value
    return out


def original_model(adapted: ClipBundle) -> ClipBundle:
    """A fresh copy of the model ``adapted`` was before its adapters: same config, :func:`base_state_dict`.

    ``adapted`` itself is not changed; the copy lives on the same device.
    """
    from compat.models import build_model

    fresh = build_model(adapted.config_name, device="cpu", pretrained="")
    fresh.model.load_state_dict(base_state_dict(adapted.model), strict=True)
    fresh.model.to(adapted.device)
    return fresh


def load_named_tensors(
    own: dict[str, nn.Parameter], tensors: dict[str, torch.Tensor], what: str, error: type[Exception]
) -> None:
    """Copy ``tensors`` into the parameters ``own`` of the same names; names and shapes must all match."""
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise error(
            f"{what} do not fit this model: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]} ({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for name, param in own.items():
        if tensors[name].shape != param.shape:
            raise error(
                f"{what}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
            )
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(tensors[name])
