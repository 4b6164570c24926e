"""``xbt_base``: XBT's "Base" baseline (Sec. 4.2): ``L_Direct`` with a randomly initialised ``phi``.

Same adapters as XBT stage 2 -- LoRA on both new encoders plus the learnable visual prompts -- but ``phi``
is not pretrained, all of it is trained, and the loss is the naive direct backward contrastive loss
(Eq. 6) ``L_c(v_bar_new, w_old) + L_c(w_bar_new, v_old)``, which needs the frozen old model on every batch.
Settings are XBT's stage-2 ones (:class:`~compat.methods.xbt.XBTStage2Config`). Served like XBT.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from compat.device import resolve_device
from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.contract import Batch, Encoder
from compat.methods.training import freeze, frozen_features, on_device, seeded
from compat.methods.xbt import AdaptedNewModel, XBTModel, XBTStage2Config, direct_loss, train_adapters
from compat.models import ClipBundle
from compat.modules.projection import XBTProjection


class XBTBaseModel(XBTModel):
    """The Base-trained new model: served as XBT (``norm(phi(norm(E_new(x))))`` against the old gallery)."""


@register_method("xbt_base")
class XBTBase(CompatMethod):
    """LoRA + prompts + a random, fully trainable ``phi``, trained with ``L_Direct`` against the old model."""

    config_class = XBTStage2Config
    model_class = XBTBaseModel

    def train(
        self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: XBTStage2Config
    ) -> XBTBaseModel:
        device, old_dim = resolve_device(config.device), int(old.embed_dim)
        freeze(old)

        def step_loss(batch: Batch, v_bar: torch.Tensor, w_bar: torch.Tensor) -> torch.Tensor:
            v_old, w_old = frozen_features(old, batch, device)
            return direct_loss(v_bar, w_bar, v_old, w_old, config.logit_scale)

        with seeded(config.seed, device), on_device(old, device):
            adapted = AdaptedNewModel(new, XBTProjection(new.embed_dim, old_dim), config, device)
            info = train_adapters(adapted, batches, config, step_loss, "all", "xbt_base")
        model = XBTBaseModel(adapted, self.contract(config, old_dim, old_dim), config)
        return model.trained(adapted.num_trained(), info)
