"""``bct``: Backward-Compatible Training (Shen et al., CVPR 2020), in its image-text (CLIP) form.

BCT trains the new model with its own loss plus an *influence loss* that scores the new features with the
old model's frozen classifier: ``L_BCT = L(w_new, phi_new) + lambda * L(w_old, phi_new)`` (as restated in
BT^2, Sec. 5 baselines). For CLIP the "classifier" of an image is the batch's text embeddings and vice
versa, so the influence loss becomes a cross-model contrastive loss against the frozen old model: new
image vs old text and new text vs old image, with the old model's own temperature (part of its classifier):

    L = clip(v_new, w_new; s_new) + lambda * 1/2 [clip(v_new, w_old; s_old) + clip(v_old, w_new; s_old)]

``clip`` is :func:`compat.losses.clip_loss` (symmetric InfoNCE; the same cross-model form as XBT's
L_Direct, Eq. 6). Choices where the sources leave room: the two cross terms are averaged (lambda = 1 then
weighs them like the model's own loss); the symmetric CLIP form also contains the transposed rows (old
query -> new item), as every CLIP loss does. When the new embedding is wider than the old one, old features
are zero-padded ("BCT(+k)" of BT^2, Tables 1-4) and served by the ``zero_pad`` rule; when narrower, old
features are truncated to the new width (``truncate`` rule). The new model is fully trainable, so
``trainable_parameters`` counts all of it.

BCT's rule for classes the old classifier has never seen (Shen et al., Sec. 3.2: their old classifier
weights are *synthesised* from the old model's features of the new classes' samples) is opt-in
(``synthesize_unmatched``). In the image-text form a "new class" is a pair the old model cannot match: its
old image feature's top-1 among the batch's old text features is not its own caption (the test of Mod-X's
Eq. 3). For such a pair the old text feature is no usable classifier (an old text tower that never saw a
domain's words embeds its captions without their content), so the image-to-text influence target of that
row is the old model's own image feature of the pair instead (:func:`unmatched_to_old_image`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from compat.device import resolve_device
from compat.losses import clip_loss, matched_rows
from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.config import MethodConfig
from compat.methods.contract import Batch, Encoder
from compat.methods.layers import truncate, zero_pad
from compat.methods.none import PlainModel
from compat.methods.training import TrainingLog, adamw_cosine, freeze, logit_scale_of, working_copy
from compat.models import ClipBundle
from compat.training.trainer import clamp_logit_scale


def match_old_dim(old: torch.Tensor, new_dim: int) -> torch.Tensor:
    """Old features as compared with new ones: zero-padded when narrower, prefix-truncated when wider."""
    if old.shape[-1] == new_dim:
        return old
    return zero_pad(old, new_dim) if old.shape[-1] < new_dim else truncate(old, new_dim)


def old_vector_rule(new_dim: int, old_dim: int) -> str:
    """The serving rule that matches :func:`match_old_dim`."""
    return "as_is" if new_dim == old_dim else "zero_pad" if old_dim < new_dim else "truncate"


def cross_model_loss(
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    old_logit_scale: torch.Tensor | float,
    i2t_targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """``1/2 [clip(v_new, w_old) + clip(v_old, w_new)]`` with the old model's scale (the BCT influence loss).

    Inputs are L2-normalised; old features are detached and matched to the new width first.
    ``i2t_targets`` replaces ``w_old`` in the first term (see :func:`unmatched_to_old_image`).
    """
    dim = new_image.shape[-1]
    targets = match_old_dim((old_text if i2t_targets is None else i2t_targets).detach(), dim)
    old_image = match_old_dim(old_image.detach(), dim)
    return (
        clip_loss(new_image, targets, old_logit_scale) + clip_loss(old_image, new_text, old_logit_scale)
    ) / 2


def old_model_matches(old_image: torch.Tensor, old_text: torch.Tensor) -> torch.Tensor:
    """Rows whose old image feature retrieves its own caption first among the batch's old text features."""
    return matched_rows(old_image @ old_text.T)


def unmatched_to_old_image(old_image: torch.Tensor, old_text: torch.Tensor) -> torch.Tensor:
    """The old "classifier" of each pair for the image-to-text influence term (BCT's synthesised classifier
    for new classes, see the module docstring): its old text feature where the old model matches the pair,
    its old image feature where it does not."""
    keep = old_model_matches(old_image, old_text).unsqueeze(1)
    return torch.where(keep, old_text, old_image)


class BCTTerms(NamedTuple):
    total: torch.Tensor
    own: torch.Tensor
    influence: torch.Tensor


def bct_loss(
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    new_logit_scale: torch.Tensor | float,
    old_logit_scale: torch.Tensor | float,
    influence_weight: float = 1.0,
    synthesize_unmatched: bool = False,
) -> BCTTerms:
    """``clip(v_new, w_new; s_new) + lambda * cross_model_loss(...)`` (see the module docstring); with
    ``synthesize_unmatched`` the image-to-text term reads :func:`unmatched_to_old_image` targets."""
    own = clip_loss(new_image, new_text, new_logit_scale)
    targets = unmatched_to_old_image(old_image.detach(), old_text.detach()) if synthesize_unmatched else None
    influence = cross_model_loss(new_image, new_text, old_image, old_text, old_logit_scale, targets)
    return BCTTerms(own + influence_weight * influence, own, influence)


@dataclass
class BCTConfig(MethodConfig):
    """BCT settings. ``influence_weight`` is BCT's lambda (1 in the BCT paper); AdamW at ``lr`` 5e-4 with a
    cosine schedule, the project's continual-training rate."""

    steps: int = 300
    lr: float = 5e-4
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    influence_weight: float = 1.0
    synthesize_unmatched: bool = False  # BCT's synthesised classifier for pairs the old model cannot match

    def validate(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.influence_weight < 0:
            raise ValueError("steps >= 1, lr > 0 and influence_weight >= 0 are required")


class BCTModel(PlainModel):
    """The BCT-trained new model, served as it is against the old gallery."""


def train_new_model(
    new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: BCTConfig, influence_weight: float
) -> tuple[ClipBundle, dict]:
    """Train a copy of ``new`` with :func:`bct_loss` (``influence_weight = 0`` is plain fine-tuning)."""
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    student = working_copy(new, device)
    student.model.train().requires_grad_(True)
    freeze(old, device)
    s_old = logit_scale_of(old)
    optimizer, schedule = adamw_cosine(
        student.model.parameters(), config.lr, config.weight_decay, config.steps, config.warmup_fraction
    )
    history = TrainingLog("bct", config.log_every, f"lr ({config.lr})")
    steps = history.student_steps(batches, config.steps, student, old, device)
    for step, _, images, tokens, (old_img, old_txt) in steps:
        img = F.normalize(student.model.encode_image(images), dim=-1)
        txt = F.normalize(student.model.encode_text(tokens), dim=-1)
        s_new, unmatched = student.model.logit_scale.exp(), config.synthesize_unmatched
        terms = bct_loss(img, txt, old_img, old_txt, s_new, s_old, influence_weight, unmatched)
        history.step(optimizer, step, schedule, loss=terms.total, own=terms.own, influence=terms.influence)
        clamp_logit_scale(student.model)
    student.model.eval()
    return student, history.finish()


@register_method("bct")
class BCT(CompatMethod):
    """Backward-compatible training of the whole new model against the frozen old one."""

    config_class = BCTConfig
    model_class = BCTModel

    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: BCTConfig) -> BCTModel:
        trained, info = train_new_model(new, old, batches, config, config.influence_weight)
        dim, old_dim = trained.embed_dim, int(old.embed_dim)
        contract = self.contract(config, dim, old_dim, old_vector_rule(dim, old_dim))
        return BCTModel(trained, contract, config).trained(trained.num_parameters(), info)
