"""Removable LoRA (Hu et al. 2021) on the transformer blocks of open_clip towers, through peft.

Targets, chosen by :func:`lora_targets` (XBT does not say which layers it adapts): every ``nn.Linear`` and
every ``nn.MultiheadAttention`` inside the transformer blocks of the requested towers -- open_clip blocks
(``attn`` = packed q/k/v + output projection, ``mlp.c_fc``, ``mlp.c_proj``) and Hugging Face BERT-style text
blocks (``query``, ``key``, ``value`` and the three ``dense`` layers). Embeddings, final projections and
LayerNorms are not adapted.

peft's own LoRA for ``nn.MultiheadAttention`` adds the low-rank delta to ``in_proj_weight`` before every
forward and subtracts it afterwards, so the frozen base weights drift by float rounding at every call
(measured: 2.6e-7 after 200 steps on cf-tiny). :class:`ExactLoraMultiheadAttention` replaces it (peft's
custom-module hook): it runs the attention with ``W + delta`` through ``torch.func.functional_call``, leaving
the base parameters bit-identical. As in peft's implementation, the attention delta acts on the weights, so
LoRA dropout applies to the ``nn.Linear`` targets only.

:meth:`LoraHandle.remove` unloads the adapters (no merge) and restores every ``requires_grad`` flag, so the
model is the original one, parameter for parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TOWERS = ("image", "text")
# Where the transformer blocks of each tower live in open_clip's CLIP / CustomTextCLIP.
BLOCK_LISTS: dict[str, tuple[str, ...]] = {
    "image": ("visual.transformer.resblocks",),
    "text": ("transformer.resblocks", "text.transformer.resblocks", "text.transformer.encoder.layer"),
}
ADAPTER = "compat"  # peft's adapter name


def _exact_mha_class() -> type:
    from peft.tuners.lora.layer import MultiheadAttention as PeftLoraMHA

    class ExactLoraMultiheadAttention(PeftLoraMHA):
        """peft LoRA for ``nn.MultiheadAttention`` that never writes to the base weights."""

        def forward(self, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            active = [a for a in self.active_adapters if a in self.lora_A]
            if self.disable_adapters or self.merged or not active:
                return super().forward(query, *args, **kwargs)
            self._check_forward_args(query, *args, **kwargs)
            base = self.get_base_layer()
            out_lora = base.out_proj  # peft lora.Linear around the original out_proj
            in_weight = base.in_proj_weight
            out_weight = out_lora.get_base_layer().weight
            for name in active:
                in_weight = in_weight + self.get_delta_weight(name).to(in_weight.dtype)
                out_weight = out_weight + out_lora.get_delta_weight(name).to(out_weight.dtype)
            params = {"in_proj_weight": in_weight, "out_proj.base_layer.weight": out_weight}
            return torch.func.functional_call(base, params, (query, *args), kwargs)

    return ExactLoraMultiheadAttention


def lora_targets(model: nn.Module, towers: tuple[str, ...] = TOWERS) -> list[str]:
    """Full names of the modules LoRA adapts in ``towers`` of an open_clip model (see module docstring)."""
    modules = dict(model.named_modules())
    targets: list[str] = []
    for tower in towers:
        if tower not in BLOCK_LISTS:
            raise ValueError(f"unknown tower {tower!r}; expected one of {TOWERS}")
        found = [p for p in BLOCK_LISTS[tower] if isinstance(modules.get(p), nn.ModuleList)]
        if not found:
            raise TypeError(
                f"no transformer blocks found for the {tower} tower of {type(model).__name__}; "
                f"looked for {', '.join(BLOCK_LISTS[tower])}"
            )
        for prefix in found:
            for name, module in modules[prefix].named_modules(prefix=prefix):
                parent = modules.get(name.rsplit(".", 1)[0])
                if isinstance(module, nn.MultiheadAttention) or (
                    isinstance(module, nn.Linear) and not isinstance(parent, nn.MultiheadAttention)
                ):
                    targets.append(name)
    return targets


class LoraHandle:
    """LoRA injected in place into ``model`` (no wrapper); :meth:`remove` restores the original model."""

    def __init__(self, model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float) -> None:
        from peft import LoraConfig
        from peft.tuners.lora import LoraModel

        if r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        if not targets:
            raise ValueError("LoRA needs at least one target module")
        if hasattr(model, "peft_config"):
            raise ValueError("this model already carries peft adapters; remove them first")
        self.model, self.targets = model, list(targets)
        self._flags = {n: p.requires_grad for n, p in model.named_parameters()}
        config = LoraConfig(
            r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=self.targets, bias="none"
        )
        config._register_custom_module({nn.MultiheadAttention: _exact_mha_class()})
        self._tuner = LoraModel(model, config, ADAPTER)
        if missing := set(self.targets) - set(self._tuner.targeted_module_names):
            self.remove()
            raise ValueError(f"LoRA could not adapt {sorted(missing)}")

    @property
    def attached(self) -> bool:
        return self._tuner is not None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The LoRA matrices, by their full names in ``model``."""
        marker = f".{ADAPTER}."
        return [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n and marker in n]

    def remove(self) -> nn.Module:
        """Unload the adapters without merging and restore ``requires_grad`` flags (idempotent)."""
        if self._tuner is None:
            return self.model
        self._tuner.unload()
        self._tuner = None
        self.model.__dict__.pop("peft_config", None)
        for name, param in self.model.named_parameters():
            if name in self._flags:
                param.requires_grad_(self._flags[name])
        return self.model


def attach_lora(
    model: nn.Module, towers: tuple[str, ...] = TOWERS, r: int = 16, alpha: float = 16, dropout: float = 0.1
) -> LoraHandle:
    """Inject LoRA (``r``, ``alpha``, ``dropout``; XBT Sec. 4.1: 16, 16, 0.1) into ``towers`` of ``model``.

    peft freezes every non-LoRA parameter of ``model`` while the adapters are attached.
    """
    return LoraHandle(model, lora_targets(model, towers), r, alpha, dropout)
