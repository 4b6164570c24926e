"""Contrastive losses for continual CLIP training: CLIP's InfoNCE and Mod-X (Ni et al., ICML 2023).

Notation follows the Mod-X paper (Sec 4.3). For a batch of B image-text pairs, ``V`` and ``L`` are the
L2-normalised image and text embeddings, ``M = s(V, L) = V L^T`` is the contrastive matrix (Eq 1-2; cosine
similarity since the rows have unit norm). The student is the model being trained (CLIP_t), the teacher the
frozen previous model (CLIP_{t-1}) evaluated on the same batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

_NORM_TOLERANCE = 1e-2


def _check_pair(image: torch.Tensor, text: torch.Tensor, what: str) -> None:
    if image.ndim != 2 or text.ndim != 2:
        raise ValueError(
            f"{what}: expected [B, D] image and text features, got {tuple(image.shape)} and "
            f"{tuple(text.shape)}"
        )
    if image.shape != text.shape:
        raise ValueError(
            f"{what}: image features {tuple(image.shape)} and text features {tuple(text.shape)} "
            "must have the same shape (one text per image)"
        )
    if image.shape[0] == 0:
        raise ValueError(f"{what}: empty batch")


def _check_normalised(x: torch.Tensor, what: str) -> None:
    worst = (x.detach().float().norm(dim=-1) - 1).abs().max().item()
    if not worst <= _NORM_TOLERANCE:  # also catches NaN
        raise ValueError(
            f"{what}: rows must be L2-normalised (largest |norm - 1| = {worst:.3g}); "
            "apply F.normalize(x, dim=-1) first"
        )


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Loss arithmetic runs in float32 (or the input's wider type), also under bf16/fp16 autocast."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def clip_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor | float
) -> torch.Tensor:
    """CLIP's symmetric InfoNCE: ``(CE(s M, arange) + CE(s M^T, arange)) / 2`` with ``M = V L^T``.

    ``logit_scale`` is the multiplier ``s`` itself (``model.logit_scale.exp()``, as open_clip's forward
    returns it), not its logarithm. Mean over the batch in each direction (the "Contrastive" term of Eq 5).
    """
    _check_pair(image_features, text_features, "clip_loss")
    logits = logit_scale * _at_least_fp32(image_features) @ _at_least_fp32(text_features).T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def matched_rows(similarity: torch.Tensor) -> torch.Tensor:
    """Mod-X Eq 3's test per row of a pair-similarity matrix: is the row's argmax its own pair (the diagonal)?

    ``argmax`` returns the first maximal index, so a row whose diagonal ties an earlier column fails.
    """
    return similarity.argmax(dim=1) == torch.arange(similarity.shape[0], device=similarity.device)


def _corrected_row_kl(
    student: torch.Tensor, teacher: torch.Tensor, selective_correction: bool = True
) -> torch.Tensor:
    """Sum over rows of KL(softmax(teacher_row) || softmax(student_row)), Eq 3 correction applied.

    Eq 3 replaces a teacher row whose argmax is not its own pair (``argmax_j M_{t-1}^{i,:} != i``) by the
    student's row. KL(p || p) = 0 with zero gradient, so replacing a row is the same as dropping it: this
    function keeps the rows the teacher gets right and sums their KL (Eq 4, ``reduction='sum'``). On ties
    ``argmax`` returns the first maximal index, so a row whose diagonal ties an earlier column is dropped.
    """
    log_q = F.log_softmax(student, dim=1)
    log_p = F.log_softmax(teacher, dim=1)
    per_row = (log_p.exp() * (log_p - log_q)).sum(dim=1)
    if not selective_correction:
        return per_row.sum()
    return (per_row * matched_rows(teacher)).sum()


def modx_kl(
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    *,
    selective_correction: bool = True,
) -> torch.Tensor:
    """Mod-X spatial-alignment term L_KL (Eq 3-4), averaged over the two retrieval directions.

    Inputs are L2-normalised [B, D] features of the same batch: ``new_*`` from the student CLIP_t,
    ``old_*`` from the frozen teacher CLIP_{t-1} (detached here, so gradients reach only the new features).
    For image-to-text the matrices are ``M_t = V_t L_t^T`` and ``M_{t-1} = V_{t-1} L_{t-1}^T``; for
    text-to-image their transposes ``L V^T``. Teacher rows whose argmax is not the diagonal are replaced by
    the student's rows (Eq 3). Each direction is ``sum_i KL(softmax(M_{t-1}^{i,:}) || softmax(M_t^{i,:}))`` on
    the raw cosines (temperature 1, no logit scale), summed over rows (Eq 4); the result is the mean of the
    two directions. The teacher's feature dimension may differ from the student's: both matrices are B x B.

    ``selective_correction=False`` is an ablation outside the paper: every teacher row is distilled.
    """
    _check_pair(new_image, new_text, "modx_kl (new features)")
    _check_pair(old_image, old_text, "modx_kl (old features)")
    if new_image.shape[0] != old_image.shape[0]:
        raise ValueError(
            f"modx_kl: student batch {new_image.shape[0]} != teacher batch {old_image.shape[0]}; "
            "both models must see the same batch"
        )
    named = {"new_image": new_image, "new_text": new_text, "old_image": old_image, "old_text": old_text}
    for name, tensor in named.items():
        _check_normalised(tensor, f"modx_kl ({name})")
    v, l_ = _at_least_fp32(new_image), _at_least_fp32(new_text)
    vo, lo = _at_least_fp32(old_image.detach()), _at_least_fp32(old_text.detach())
    student_i2t = v @ l_.T
    teacher_i2t = vo @ lo.T
    kl_i2t = _corrected_row_kl(student_i2t, teacher_i2t, selective_correction)
    kl_t2i = _corrected_row_kl(student_i2t.T, teacher_i2t.T, selective_correction)
    return (kl_i2t + kl_t2i) / 2


def teacher_rows_kept(old_image: torch.Tensor, old_text: torch.Tensor) -> torch.Tensor:
    """Share of teacher rows Eq 3 keeps: rows whose argmax is their own pair, mean over both directions.

    The Mod-X KL only ever sees these rows; on data the teacher does not understand it falls towards 0.
    """
    with torch.no_grad():
        m = _at_least_fp32(old_image) @ _at_least_fp32(old_text).T
        return (matched_rows(m).float().mean() + matched_rows(m.T).float().mean()) / 2


class LossTerms(NamedTuple):
    """The loss of one step and its terms (``total = contrastive + alpha * kl``).

    ``kept`` is :func:`teacher_rows_kept` when a teacher took part, else ``None``.
    """

    total: torch.Tensor
    contrastive: torch.Tensor
    kl: torch.Tensor
    kept: torch.Tensor | None = None


class ModXLoss(nn.Module):
    """Mod-X objective, Eq 5: ``L = L_InfoNCE + alpha * L_KL`` (alpha = 20 in the paper).

    ``alpha = 0`` is plain continual fine-tuning (the paper's CLIP_ct); then no teacher features are needed
    and the KL term is reported as 0. ``selective_correction=False`` is an ablation (see :func:`modx_kl`).
    """

    def __init__(self, alpha: float = 20.0, selective_correction: bool = True) -> None:
        super().__init__()
        if not alpha >= 0:
            raise ValueError(f"ModXLoss: alpha must be >= 0, got {alpha}")
        self.alpha = float(alpha)
        self.selective_correction = bool(selective_correction)

    @property
    def needs_teacher(self) -> bool:
        return self.alpha > 0

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        old_image_features: torch.Tensor | None = None,
        old_text_features: torch.Tensor | None = None,
    ) -> LossTerms:
        contrastive = clip_loss(image_features, text_features, logit_scale)
        if not self.needs_teacher:
            return LossTerms(contrastive, contrastive, contrastive.new_zeros(()))
        old = (old_image_features, old_text_features)
        if any(features is None for features in old):
            raise ValueError(f"ModXLoss(alpha={self.alpha}) needs the teacher's image and text features")
        kl = modx_kl(image_features, text_features, *old, selective_correction=self.selective_correction)
        kept = teacher_rows_kept(*old)
        return LossTerms(contrastive + self.alpha * kl, contrastive, kl, kept)
