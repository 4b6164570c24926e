"""``bt2``: Backward-compatible Training with Basis Transformation (BT^2, Zhou et al.), for CLIP towers.

Algorithm 1, applied to each tower's output. The backbone's projection is widened to ``m + n`` outputs
(``phi_1``): its first ``m`` columns start from the independent new model ``phi'_new`` (dimension ``m``), the
other ``n`` are new. With a shared head for both modalities (image and text must stay in one space):

    phi_2 = f(phi_1) / ||f(phi_1)||            d dims (old-side features phi'_new does not use)
    phi_3 = phi_1[:m] / ||phi_1[:m]||          m dims, trained to mimic phi'_new
    phi_4 = C * B_1 phi_3                      m dims, ||phi_4|| = C
    phi_5 = B_2 [phi_2 ; phi_4[:n-d]]          n dims, trained to mimic phi_old
    phi_new = [phi_5 ; phi_4[n-d:]]            m + d dims, ||phi_new|| = sqrt(1 + C^2)

``B_1``, ``B_2`` are orthonormal BT blocks ``exp(A)``, ``A`` skew-symmetric (Lemma 2); ``C = 2``; needs
``d <= n <= m + d``. Old gallery vectors are read by truncation: ``cos(phi_new[:n], phi_old)`` (rule
``truncate``). A series of updates treats the previous BT^2 model as ``phi_old``; the prefixes nest, so the
newest queries read every earlier gallery (``contract.old_dims``), each by truncation to its width.

Losses (Sec. 3, "exactly as written", with CLIP's contrastive loss standing in for the classification loss):

    L_phi'new = clip(phi_new(img), phi_new(txt); s) + lambda_1 (1 - <phi_3, phi'_new>)
    L_phi_old = lambda_2 L(w_old, phi_5) + lambda_3 (1 - <phi_5 / ||phi_5||, phi_old>)

``L(w_old, phi_5)`` is the old "classifier" applied to phi_5 -- for CLIP the frozen old model's other
modality: :func:`compat.methods.bct.cross_model_loss` with the old temperature. Choices: the classification
loss goes on ``phi_new`` (the paper's choice for transformers; the released code puts it on ``phi_3``);
``lambda_1, lambda_2, lambda_3 = 1, 10, 10`` (the values the released trainer hard-codes; the paper gives
none); ``d = 16`` by default for 64-d towers (the paper's 32 for 128-d); the new columns of the widened
projection start random (open_clip's projection init), ``B_1 = B_2 = I`` (``A = 0``). The cosine terms
average over both modalities.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import nn

from compat.device import resolve_device
from compat.losses import clip_loss
from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.bct import cross_model_loss
from compat.methods.config import MethodConfig
from compat.methods.contract import Batch, CompatError, Encoder, ServingContract
from compat.methods.layers import OrthogonalMatrix
from compat.methods.model import CompatModel, Parts, Tensors
from compat.methods.training import (
    TrainingLog,
    adamw_cosine,
    contract_lineage,
    freeze,
    frozen_features,
    logit_scale_of,
    working_copy,
)
from compat.models import ClipBundle
from compat.training.trainer import LOGIT_SCALE_MAX


class BT2Output(NamedTuple):
    phi_new: torch.Tensor
    phi3: torch.Tensor
    phi5: torch.Tensor


class BT2Head(nn.Module):
    """Algorithm 1 from ``phi_1`` [N, m + n] to ``phi_new`` [N, m + d] (with ``phi_3`` and ``phi_5``)."""

    def __init__(self, m: int, n: int, d: int, c: float = 2.0) -> None:
        super().__init__()
        if not (1 <= d <= n <= m + d):
            raise CompatError(
                f"bt2: Algorithm 1 needs 1 <= d <= n <= m + d, got m={m} (new), n={n} (old), d={d} "
                f"(extra_dims); choose extra_dims in [{max(1, n - m)}, {n}]"
            )
        self.m, self.n, self.d, self.c = int(m), int(n), int(d), float(c)
        self.f = nn.Linear(m + n, d)
        self.b1 = OrthogonalMatrix(m)
        self.b2 = OrthogonalMatrix(n)

    @property
    def out_dim(self) -> int:
        return self.m + self.d

    def forward(self, phi1: torch.Tensor) -> BT2Output:
        if phi1.shape[-1] != self.m + self.n:
            raise ValueError(
                f"bt2 head expects phi_1 of width m + n = {self.m + self.n}, got {phi1.shape[-1]}"
            )
        m, n, d = self.m, self.n, self.d
        phi2 = F.normalize(self.f(phi1), dim=-1)
        phi3 = F.normalize(phi1[:, :m], dim=-1)
        phi4 = self.c * self.b1(phi3)
        phi5 = self.b2(torch.cat([phi2, phi4[:, : n - d]], dim=-1))
        return BT2Output(torch.cat([phi5, phi4[:, n - d :]], dim=-1), phi3, phi5)

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.f.parameters()) + self.b1.num_trainable() + self.b2.num_trainable()


def _projection_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """The output projections of both towers: state-dict prefix -> (owner module, attribute)."""
    slots: dict[str, tuple[nn.Module, str]] = {}
    if isinstance(getattr(model.visual, "proj", None), nn.Parameter):
        slots["visual.proj"] = (model.visual, "proj")
    if isinstance(getattr(model, "text_projection", None), (nn.Parameter, nn.Linear)):
        slots["text_projection"] = (model, "text_projection")
    elif hasattr(model, "text"):
        for attr in ("proj", "text_projection"):
            if isinstance(getattr(model.text, attr, None), (nn.Parameter, nn.Linear)):
                slots[f"text.{attr}"] = (model.text, attr)
                break
    if len(slots) != 2:
        raise CompatError(
            f"bt2: cannot find a linear output projection in both towers of {type(model).__name__} "
            f"(found {sorted(slots)}); BT^2 widens them to m + n outputs"
        )
    return slots


def widen_projections(
    model: nn.Module, extra: int, generator: torch.Generator | None = None
) -> dict[str, int]:
    """Append ``extra`` output columns to both towers' projections (in place).

    Returns the widened state-dict keys -> the axis that grew. New columns use open_clip's projection init
    (normal, std = input width^-0.5); ``generator=None`` leaves them zero (for restoring saved weights).
    """
    grown: dict[str, int] = {}
    for prefix, (owner, attr) in _projection_slots(model).items():
        current = getattr(owner, attr)
        linear = isinstance(current, nn.Linear)  # weight [out, in]; a bare parameter is [in, out] (x @ P)
        weight = current.weight if linear else current
        axis, width = (0, weight.shape[1]) if linear else (1, weight.shape[0])
        shape = (extra, width) if linear else (width, extra)
        cols = torch.zeros(shape) if generator is None else torch.randn(shape, generator=generator)
        widened = torch.cat([weight.detach(), (cols * width**-0.5).to(weight)], dim=axis)
        if not linear:
            setattr(owner, attr, nn.Parameter(widened))
            grown[prefix] = 1
            continue
        layer = nn.Linear(width, widened.shape[0], bias=current.bias is not None).to(weight)
        with torch.no_grad():
            layer.weight.copy_(widened)
            if current.bias is not None:
                layer.bias.copy_(torch.cat([current.bias, current.bias.new_zeros(extra)]))
        setattr(owner, attr, layer)
        grown[f"{prefix}.weight"] = 0
        if current.bias is not None:
            grown[f"{prefix}.bias"] = 0
    return grown


def split_widened(
    state: dict[str, torch.Tensor], grown: dict[str, int], m: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the state dict with projections cut back to ``m`` outputs, the extra slices keyed ``extra.<key>``)."""
    base, extra = dict(state), {}
    for key, axis in grown.items():
        base[key] = state[key].narrow(axis, 0, m)
        extra[f"extra.{key}"] = state[key].narrow(axis, m, state[key].shape[axis] - m)
    return base, extra


@dataclass
class BT2Config(MethodConfig):
    """BT^2 settings: ``extra_dims`` is Algorithm 1's ``d``, ``scale_c`` its ``C``; lambdas: module doc.

    ``lr`` 5e-4 with AdamW and a cosine schedule, the project's continual-training rate (the paper fine-tunes
    ViTs with SGD at 0.01 and trains ResNets with Adam at 1e-3).
    """

    steps: int = 300
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_fraction: float = 0.1
    extra_dims: int = 16
    scale_c: float = 2.0
    lambda1: float = 1.0
    lambda2: float = 10.0
    lambda3: float = 10.0

    def validate(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.extra_dims < 1 or self.scale_c <= 0:
            raise ValueError("steps >= 1, lr > 0, extra_dims >= 1 and scale_c > 0 are required")


class BT2Terms(NamedTuple):
    total: torch.Tensor
    new_clip: torch.Tensor
    new_cos: torch.Tensor
    old_influence: torch.Tensor
    old_cos: torch.Tensor


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (1 - (F.normalize(a, dim=-1) * F.normalize(b, dim=-1)).sum(dim=-1)).mean()


def bt2_losses(
    image: BT2Output,
    text: BT2Output,
    ref_image: torch.Tensor,
    ref_text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    logit_scale: torch.Tensor | float,
    old_logit_scale: float,
    config: BT2Config,
) -> BT2Terms:
    """``L_phi'new + L_phi_old`` (see the module docstring) on one batch."""
    new_clip = clip_loss(F.normalize(image.phi_new, dim=-1), F.normalize(text.phi_new, dim=-1), logit_scale)
    new_cos = (_one_minus_cos(image.phi3, ref_image) + _one_minus_cos(text.phi3, ref_text)) / 2
    influence = cross_model_loss(
        F.normalize(image.phi5, dim=-1), F.normalize(text.phi5, dim=-1), old_image, old_text, old_logit_scale
    )
    old_cos = (_one_minus_cos(image.phi5, old_image) + _one_minus_cos(text.phi5, old_text)) / 2
    total = new_clip + config.lambda1 * new_cos + config.lambda2 * influence + config.lambda3 * old_cos
    return BT2Terms(total, new_clip, new_cos, influence, old_cos)


class BT2Model(CompatModel):
    """The BT^2 network: widened backbone + head; serves ``phi_new / ||phi_new||``."""

    def __init__(
        self,
        backbone: ClipBundle,
        head: BT2Head,
        grown: dict[str, int],
        logit_scale: torch.Tensor,
        contract: ServingContract,
        config: BT2Config,
    ) -> None:
        super().__init__(contract, config)
        self.backbone, self.head, self.grown = backbone, head.eval(), dict(grown)
        self._logit_scale = logit_scale.detach().float().reshape(())

    @property
    def image_size(self) -> int:
        return self.backbone.image_size

    @property
    def logit_scale(self) -> float:
        return float(self._logit_scale.exp().clamp(max=100.0))

    def _serve(self, phi1: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(self.head(phi1.float()).phi_new, dim=-1)

    def encode_images(self, images: Any, batch_size: int = 256, device: Any = None) -> torch.Tensor:
        return self._serve(
            self.backbone.encode_images(images, batch_size=batch_size, device=device, normalize=False)
        )

    def encode_texts(self, texts: list[str], batch_size: int = 256, device: Any = None) -> torch.Tensor:
        return self._serve(
            self.backbone.encode_texts(texts, batch_size=batch_size, device=device, normalize=False)
        )

    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, dict | None]]:
        base, _ = split_widened(self.backbone.model.state_dict(), self.grown, self.head.m)
        return {"new": (self.backbone, base)}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        _, extra = split_widened(self.backbone.model.state_dict(), self.grown, self.head.m)
        head = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        return {**extra, **head, "logit_scale": self._logit_scale.reshape(1)}

    @classmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        backbone = parts["new"]
        m, n = backbone.embed_dim, contract.old_dim
        head = BT2Head(m, n, config.extra_dims, config.scale_c)
        grown = widen_projections(backbone.model, n)
        try:
            head.load_state_dict(
                {k[5:]: v for k, v in adapters.items() if k.startswith("head.")}, strict=True
            )
            state = backbone.model.state_dict()
            for key, axis in grown.items():
                state[key].narrow(axis, m, n).copy_(adapters[f"extra.{key}"])
            logit_scale = adapters["logit_scale"]
        except (RuntimeError, KeyError) as exc:
            raise CompatError(
                f"bt2: saved adapters do not fit the configuration (m={m}, n={n}): {exc}"
            ) from exc
        backbone.model.eval()
        return cls(backbone, head, grown, logit_scale, contract, config)


@register_method("bt2")
class BT2(CompatMethod):
    """BT^2: the new model trained with extra dimensions, compatible with the old one by truncation."""

    config_class = BT2Config
    model_class = BT2Model

    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: BT2Config) -> BT2Model:
        device = resolve_device(config.device)
        m, n = new.embed_dim, int(old.embed_dim)
        head = BT2Head(m, n, config.extra_dims, config.scale_c).to(device)
        torch.manual_seed(config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        freeze(new, device)
        freeze(old, device)
        student = working_copy(new, device)
        grown = widen_projections(student.model, n, generator)
        student.model.train().requires_grad_(True)
        logit_scale = nn.Parameter(new.model.logit_scale.detach().clone().float().reshape(()).to(device))
        params = [*student.model.parameters(), *head.parameters(), logit_scale]
        optimizer, schedule = adamw_cosine(
            params, config.lr, config.weight_decay, config.steps, config.warmup_fraction
        )
        s_old = logit_scale_of(old)
        history = TrainingLog("bt2", config.log_every, f"lr ({config.lr})")
        steps = history.student_steps(batches, config.steps, student, old, device)
        for step, batch, images, tokens, (old_img, old_txt) in steps:
            ref_img, ref_txt = frozen_features(new, batch, device, images)
            out_img = head(student.model.encode_image(images))
            out_txt = head(student.model.encode_text(tokens))
            terms = bt2_losses(
                out_img, out_txt, ref_img, ref_txt, old_img, old_txt, logit_scale.exp(), s_old, config
            )
            history.step(optimizer, step, schedule, **terms._asdict())
            with torch.no_grad():
                logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        student.model.eval().cpu()
        head.eval().cpu()
        lineage = contract_lineage(old)[1] or (n,)
        contract = self.contract(config, head.out_dim, n, "truncate", lineage)
        model = BT2Model(student, head, grown, logit_scale.detach().cpu(), contract, config)
        return model.trained(student.num_parameters() + head.num_trainable() + 1, history.finish())
