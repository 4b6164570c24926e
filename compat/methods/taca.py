"""``taca``: Task-agnostic Compatible Adapter (TaCA; anonymous, under review; digest-taca.md).

The new visual encoder is frozen; TaCA adds a tied-weight bottleneck adapter to every Transformer block
(:mod:`compat.modules.adapters`, Eq. 3-4) and a two-layer dimension projector ``d_n -> d_p -> d_o``
(:class:`~compat.modules.projection.TwoLayerProjector`, ``d_p = 4096``). Only adapters and projector train,
with (Eq. 5-7 and Algorithm 1)::

    L_TaCA = L_contra + lambda * L_distill,   lambda = 2
    L_contra  = 1/2 [CE(s V_new W_old^T, arange) + CE(s W_old V_new^T, arange)]   (symmetric, Algorithm 1)
    L_distill = 1/B sum_i || V_new_i - V_old_i ||_2                                 (Eq. 5)

``V_new = norm(projector(E_new^I(x)))`` (the projector takes the raw visual output, Algorithm 1 line 19),
``V_old``/``W_old`` are the frozen old model's l2-normalised image/text features of the same pairs. The new
model's text encoder is not used: TaCA upgrades the visual encoder only, so the served text encoder is the
old one (:meth:`TaCAModel.encode_texts`) and text->image new/old equals old/old by construction; images
(queries or re-embedded gallery items) go through the adapted new encoder into the old space (rule ``as_is``).

Choices where the paper is silent:

- ``L_distill`` is Eq. 5's per-sample norm (Euclidean distance, not its square) on l2-normalised features,
  the same features the contrastive term compares by cosine (Eq. 1); Algorithm 1 calls it ``l2_loss``.
- Temperature: not stated. ``logit_scale = None`` uses the old model's own learned multiplier, whose text
  features are the contrastive targets; the value used is stored in the saved config.
- Adapter position (after each block's MLP), sigma = GELU, small random init: see
  :mod:`compat.modules.adapters`. Projector activation GELU. Bottleneck ``d'``: ``None`` = width / 8 (the
  paper's 128 for the 1024-wide L/14).
- Optimiser: AdamW, lr 2e-4 (Sec. 4.1), constant, weight decay 0.01 (not stated; AdamW's default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple, Self

import torch

from compat.device import resolve_device
from compat.losses import clip_loss
from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.config import MethodConfig
from compat.methods.contract import Batch, CompatError, Encoder, ServingContract
from compat.methods.model import AdaptedModel, Parts, Tensors
from compat.methods.training import (
    TrainingLog,
    cycle_batches,
    freeze,
    frozen_features,
    logit_scale_of,
    on_device,
    prepare_images,
    seeded,
    working_copy,
)
from compat.models import ClipBundle
from compat.modules.adapters import AdapterHandle, insert_tied_adapters, vision_blocks
from compat.modules.projection import TwoLayerProjector
from compat.modules.serving import ProjectedCLIP, load_named_tensors, projected_bundle


class TaCATerms(NamedTuple):
    """One step's loss: ``total = contra + distill_weight * distill``."""

    total: torch.Tensor
    contra: torch.Tensor
    distill: torch.Tensor


def distillation_loss(new_image: torch.Tensor, old_image: torch.Tensor) -> torch.Tensor:
    """``L_distill`` (Eq. 5): mean of ``||v_new_i - v_old_i||_2`` over the batch; old features detached."""
    if new_image.shape != old_image.shape:
        raise ValueError(
            f"distillation: new features {tuple(new_image.shape)} and old features "
            f"{tuple(old_image.shape)} must have the same shape (project to the old dimension)"
        )
    return (new_image - old_image.detach()).norm(dim=-1).mean()


def contrastive_loss(new_image: torch.Tensor, old_text: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """``L_contra`` (Eq. 6 made symmetric as in Algorithm 1): CLIP InfoNCE of new images vs old texts."""
    return clip_loss(new_image, old_text.detach(), logit_scale)


def taca_loss(
    new_image: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    logit_scale: float,
    distill_weight: float = 2.0,
) -> TaCATerms:
    """``L_TaCA = L_contra + lambda L_distill`` (Eq. 7), lambda = 2 in the paper."""
    contra = contrastive_loss(new_image, old_text, logit_scale)
    distill = distillation_loss(new_image, old_image)
    return TaCATerms(contra + distill_weight * distill, contra, distill)


@dataclass
class TaCAConfig(MethodConfig):
    """TaCA settings; defaults from Sec. 4.1 where the paper gives them (see the module docstring)."""

    steps: int = 300
    lr: float = 2e-4
    weight_decay: float = 0.01
    bottleneck: int | None = None
    projector_hidden: int = 4096
    distill_weight: float = 2.0
    logit_scale: float | None = None
    adapter_init_std: float = 0.01

    def validate(self) -> None:
        if self.steps < 1 or not self.lr > 0 or self.weight_decay < 0:
            raise ValueError("steps >= 1, lr > 0 and weight_decay >= 0 are required")
        if self.bottleneck is not None and self.bottleneck < 1:
            raise ValueError(f"bottleneck must be >= 1 (or null for width / 8), got {self.bottleneck}")
        if self.projector_hidden < 1 or self.distill_weight < 0 or not self.adapter_init_std > 0:
            raise ValueError(
                "projector_hidden >= 1, distill_weight >= 0 and adapter_init_std > 0 are required"
            )
        if self.logit_scale is not None and not self.logit_scale > 0:
            raise ValueError(f"logit_scale must be > 0 (or null for the old model's), got {self.logit_scale}")


class AdaptedVisual:
    """The new model with tied adapters in every vision block and the projector on its image embedding."""

    def __init__(
        self,
        new: ClipBundle,
        out_dim: int,
        config: TaCAConfig,
        device: torch.device,
        copy_model: bool = True,
        bottleneck: int | None = None,
    ) -> None:
        self.bundle = working_copy(new, device, copy_model)
        model = self.bundle.model
        width = vision_blocks(model.visual)[0].mlp.c_proj.weight.shape[0]
        self.bottleneck = bottleneck or config.bottleneck or max(width // 8, 1)
        self.adapters: AdapterHandle = insert_tied_adapters(
            model.visual, self.bottleneck, config.adapter_init_std
        )
        self.projector = TwoLayerProjector(new.embed_dim, out_dim, config.projector_hidden).to(device)
        self.head = ProjectedCLIP(model, self.projector, None, normalize_inputs=False)
        self.serving = projected_bundle(self.bundle, self.head, out_dim)

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Adapters and projector, by name (``new.<block>.adapter.weight``, ``projector.*``)."""
        names = {id(p): n for n, p in self.bundle.model.named_parameters()}
        adapters = [(f"new.{names[id(p)]}", p) for p in self.adapters.parameters()]
        return adapters + [(f"projector.{n}", p) for n, p in self.projector.named_parameters()]

    def set_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        self.bundle.model.requires_grad_(False)
        self.projector.requires_grad_(False)
        params = self.trainable()
        for _, p in params:
            p.requires_grad_(True)
        return params

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.trainable()}

    def load_adapter_state(self, tensors: dict[str, torch.Tensor], source: str = "adapters") -> None:
        load_named_tensors(dict(self.trainable()), tensors, f"{source}: TaCA tensors", CompatError)

    @property
    def attached(self) -> bool:
        return self.adapters.attached

    def remove(self) -> ClipBundle:
        """Remove the adapters in place; the bundle is then the original new model."""
        self.adapters.remove()
        return self.bundle


class TaCAModel(AdaptedModel):
    """Images through the adapted new encoder + projector; texts through the old text encoder."""

    part_names = ("new", "old")

    def __init__(
        self, adapted: AdaptedVisual, old: ClipBundle, contract: ServingContract, config: TaCAConfig
    ) -> None:
        super().__init__(contract, config)
        self.adapted, self.old = adapted, old

    @property
    def logit_scale(self) -> float:
        return float(self.config.logit_scale or logit_scale_of(self.old))

    def encode_texts(self, texts: list[str], batch_size: int = 256, device: Any = None) -> torch.Tensor:
        return self.old.encode_texts(texts, batch_size=batch_size, device=device)

    def text_bundle(self) -> ClipBundle:
        return self.old

    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, Tensors | None]]:
        return {**super().checkpoint_parts(), "old": (self.old, None)}

    @classmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        new, old = parts["new"], freeze(parts["old"])
        weights = [v for k, v in adapters.items() if k.endswith(".adapter.weight")]
        if not weights:
            raise CompatError(f"{cls.method} adapters: no '*.adapter.weight' tensor found")
        adapted = AdaptedVisual(
            new, contract.dim, config, new.device, copy_model=False, bottleneck=int(weights[0].shape[0])
        )
        adapted.load_adapter_state(adapters, f"{cls.method} adapters")
        adapted.bundle.model.eval()
        adapted.projector.eval()
        return cls(adapted, old, contract, config)


def train_taca(
    adapted: AdaptedVisual, old: Encoder, batches: Iterable[Batch], config: TaCAConfig, logit_scale: float
) -> dict[str, Any]:
    """Algorithm 1: frozen old features, adapted new image features, ``L_TaCA``; adapters + projector only."""
    device = adapted.bundle.device
    params = adapted.set_trainable()
    optimizer = torch.optim.AdamW([p for _, p in params], lr=config.lr, weight_decay=config.weight_decay)
    model = adapted.bundle.model
    model.train()
    adapted.projector.train()
    same_input = adapted.bundle.image_size == old.image_size
    history = TrainingLog("taca", config.log_every, f"lr ({config.lr})")
    for step, batch in history.track(cycle_batches(batches, config.steps), config.steps):
        images = prepare_images(batch.images, adapted.bundle, train=True).to(device)
        old_batch = SimpleNamespace(images=images, texts=batch.texts) if same_input else batch
        old_image, old_text = frozen_features(old, old_batch, device)
        new_image = adapted.head.encode_image(images, normalize=True)
        terms = taca_loss(new_image, old_image, old_text, logit_scale, config.distill_weight)
        history.step(optimizer, step, loss=terms.total, contra=terms.contra, distill=terms.distill)
    model.eval().requires_grad_(False)
    adapted.projector.eval().requires_grad_(False)
    trained = sum(p.numel() for _, p in params)
    return history.finish(trainable_parameters=trained, bottleneck=adapted.bottleneck)


@register_method("taca")
class TaCA(CompatMethod):
    """Tied adapters in every new vision block + projector, trained with ``L_contra + 2 L_distill``."""

    config_class = TaCAConfig
    model_class = TaCAModel

    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: TaCAConfig) -> TaCAModel:
        # The served text encoder stays production's: a plain network, saved with the model. After an
        # earlier compatible release it is that model's text network (CompatModel.text_bundle).
        text_tower = old if isinstance(old, ClipBundle) else getattr(old, "text_bundle", lambda: None)()
        if text_tower is None:
            raise CompatError(
                f"taca keeps the production model's text encoder and saves it with the model, but production "
                f"is a {getattr(old, 'method', type(old).__name__)} model whose text encoder passes through "
                "adapters; make this upgrade compatible with bct, lambda_orth, bt2 or xbt instead"
            )
        device, old_dim = resolve_device(config.device), int(old.embed_dim)
        freeze(old)
        config = dataclasses.replace(config, logit_scale=config.logit_scale or logit_scale_of(old))
        with seeded(config.seed, device), on_device(old, device):
            adapted = AdaptedVisual(new, old_dim, config, device)
            info = train_taca(adapted, old, batches, config, config.logit_scale)
        model = TaCAModel(adapted, freeze(text_tower), self.contract(config, old_dim, old_dim), config)
        return model.trained(info["trainable_parameters"], info)
