"""``xbt``: cross-modal backward-compatible training (XBT; anonymous, under review; digest-xbt.md).

A projection ``phi`` (:class:`~compat.modules.projection.XBTProjection`, new dim -> 4K -> 4K -> K = old dim)
maps new embeddings into the old space. Two stages:

1. Text-only pretraining of ``phi`` (Sec. 3.2, Eq. 3): ``L_pre = L_c(phi(norm(w_new + eps)), w_old; tau_pre)``
   with ``eps ~ N(0, sigma^2)``, both text encoders frozen, all of ``phi`` trained, no image used.
2. XBT (Sec. 3.3, Eq. 4-5): ``v_bar = phi(v_new)``, ``w_bar = phi(w_new)``, ``L_X = L_c(v_bar, w_bar; tau_X)``
   on image-text pairs with LoRA on both new encoders, learnable visual prompts on the image encoder and
   only ``phi``'s LayerNorms trainable. The old model is not called in this stage: :func:`train_stage2`
   is not even given it.

``L_c`` is CLIP's symmetric InfoNCE (:func:`compat.losses.clip_loss`). Served embeddings are
``norm(phi(norm(E_new(x))))`` in the old space (rule ``as_is``), for queries and re-embedded gallery items
alike (the paper's new/new protocol also goes through ``phi``). Removing LoRA and prompts restores the
original new model exactly (:meth:`XBTModel.remove_adapters`, :meth:`XBTModel.original_new_model`).

Choices where the paper is silent or ambiguous (digest Sec. 7):

- sigma (not given): ``noise_std = 0.1`` by default. CapDec's best variance 0.016 (std 0.126) was set for
  512-d CLIP; for the 128-d new models here 0.1 keeps ``cos(w, norm(w + eps))`` around 0.6.
- "Temperature 2.6592" = ln(1/0.07): a fixed logit multiplier ``exp(2.6592) = 14.29`` for all three losses.
- LoRA targets (not stated): every Linear and MultiheadAttention in the transformer blocks of both towers
  (:func:`compat.modules.lora.lora_targets`); r = alpha = 16, dropout 0.1 (Sec. 4.1).
- Sec. 4.1 says LayerNorm is "the only trainable component" for the encoders; Sec. 3.3 and Table 7 say LoRA +
  prompts with phi's LayerNorms. Sec. 3.3 is implemented: encoder LayerNorms stay frozen.
- Prompts: 10 tokens after the class token at the first block's input (VPT-shallow), lr 1e-2 (100x).
- Stage 1 corpus D_T: the captions of the training batches (deduplicated), or a text file (``text_corpus``,
  one caption per line). Its embeddings are computed once with the frozen encoders; ``phi`` then trains for
  ``stage1_steps`` minibatches (epochs over D_T when it is small), fresh noise each step.
- Optimiser: AdamW, constant learning rates, weight decay 0.01 in both stages (Sec. 4.1).
- Augmentation (Sec. 4.1, :mod:`compat.modules.augment`) is off by default: the captions of this project's
  stream name positions ("top left", "right"), which flips, translations and 0.5-scale crops falsify.
- ``trainable_parameters`` counts LoRA + prompts + all of ``phi`` (everything trained in either stage, the
  accounting of the paper's Table 7); ``training_info`` has the per-stage split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
import torch.nn.functional as F

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
    minibatches,
    on_device,
    prepare_images,
    seeded,
    working_copy,
)
from compat.models import ClipBundle
from compat.modules.augment import augment_for
from compat.modules.lora import LoraHandle, attach_lora
from compat.modules.projection import XBTProjection
from compat.modules.serving import ProjectedCLIP, load_named_tensors, projected_bundle
from compat.modules.visual_prompts import PromptHandle, insert_visual_prompts

PAPER_LOG_LOGIT_SCALE = 2.6592  # ln(1/0.07): "temperature ... fixed at 2.6592" (Sec. 4.1)


def stage1_loss(
    phi: torch.nn.Module,
    w_new: torch.Tensor,
    w_old: torch.Tensor,
    noise_std: float,
    logit_scale: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``L_pre`` (Eq. 3): ``L_c(norm(phi(norm(w_new + eps))), w_old)``, ``eps ~ N(0, noise_std^2)`` per entry.

    ``w_new`` and ``w_old`` are l2-normalised text embeddings of the same texts (row ``i`` of each).
    """
    noise = torch.randn(w_new.shape, generator=generator, device=w_new.device, dtype=w_new.dtype)
    noisy = F.normalize(w_new + noise_std * noise, dim=-1)
    return clip_loss(F.normalize(phi(noisy), dim=-1), w_old, logit_scale)


def xbt_loss(v_bar: torch.Tensor, w_bar: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """``L_X`` (Eq. 5): ``L_c(v_bar_new, w_bar_new)``; the projected new embeddings only, no old model."""
    return clip_loss(v_bar, w_bar, logit_scale)


def direct_loss(
    v_bar: torch.Tensor, w_bar: torch.Tensor, v_old: torch.Tensor, w_old: torch.Tensor, logit_scale: float
) -> torch.Tensor:
    """``L_Direct`` (Eq. 6, the "Base" baseline): ``L_c(v_bar_new, w_old) + L_c(w_bar_new, v_old)``."""
    return clip_loss(v_bar, w_old.detach(), logit_scale) + clip_loss(w_bar, v_old.detach(), logit_scale)


@dataclass
class XBTStage2Config(MethodConfig):
    """Stage-2 settings (shared with the "Base" baseline). Defaults: the paper's Sec. 4.1."""

    steps: int = 300
    lr: float = 1e-4
    weight_decay: float = 0.01
    prompt_lr: float = 1e-2
    log_logit_scale: float = PAPER_LOG_LOGIT_SCALE
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.1
    num_prompts: int = 10
    augment: bool = False

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not (self.lr > 0 and self.prompt_lr > 0 and self.weight_decay >= 0):
            raise ValueError("lr and prompt_lr must be > 0 and weight_decay >= 0")
        if self.lora_rank < 1 or self.num_prompts < 1:
            raise ValueError("lora_rank and num_prompts must be >= 1")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not math.isfinite(self.log_logit_scale):
            raise ValueError("log_logit_scale must be finite")

    @property
    def logit_scale(self) -> float:
        return math.exp(self.log_logit_scale)


@dataclass
class XBTConfig(XBTStage2Config):
    """XBT settings: stage 2 (``steps``, ...) plus the text-only pretraining of ``phi`` (``stage1_*``)."""

    stage1_steps: int = 2000
    stage1_batch_size: int = 1024
    stage1_lr: float = 1e-4
    noise_std: float = 0.1
    text_corpus: str | None = None
    stage1_max_texts: int = 500_000

    def validate(self) -> None:
        super().validate()
        if self.stage1_steps < 1 or self.stage1_batch_size < 2 or self.stage1_max_texts < 2:
            raise ValueError(
                "stage1_steps >= 1, stage1_batch_size >= 2 and stage1_max_texts >= 2 are required"
            )
        if not (self.stage1_lr > 0 and self.noise_std >= 0):
            raise ValueError("stage1_lr must be > 0 and noise_std >= 0")


class AdaptedNewModel:
    """The new model with LoRA on both towers and visual prompts, served through ``phi``.

    With ``copy_model`` the new model is deep-copied first, so the caller's bundle is never modified.
    """

    def __init__(
        self,
        new: ClipBundle,
        phi: XBTProjection,
        config: XBTStage2Config,
        device: torch.device,
        copy_model: bool = True,
    ) -> None:
        self.bundle = working_copy(new, device, copy_model)
        model = self.bundle.model
        self.lora: LoraHandle = attach_lora(
            model, ("image", "text"), r=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout
        )
        self.prompts: PromptHandle = insert_visual_prompts(model.visual, config.num_prompts)
        self.phi = phi.to(device)
        self.head = ProjectedCLIP(model, phi, phi, normalize_inputs=True)
        self.serving = projected_bundle(self.bundle, self.head, phi.out_dim)

    @property
    def attached(self) -> bool:
        return self.lora.attached and self.prompts.attached

    def trainable_groups(self, phi_part: str) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """Stage-2 trainables by group: ``lora``, ``prompts``, ``phi`` (LayerNorms or ``"all"`` of phi)."""
        if phi_part not in ("layernorm", "all"):
            raise ValueError(f"phi_part must be 'layernorm' or 'all', got {phi_part!r}")
        phi = (
            self.phi.layernorm_parameters() if phi_part == "layernorm" else list(self.phi.named_parameters())
        )
        return {
            "lora": [(f"new.{n}", p) for n, p in self.lora.named_parameters()],
            "prompts": [("new.visual.visual_prompts.tokens", self.prompts.prompts.tokens)],
            "phi": [(f"phi.{n}", p) for n, p in phi],
        }

    def set_trainable(self, phi_part: str) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """Freeze everything, then unfreeze the stage-2 groups; returns them."""
        self.bundle.model.requires_grad_(False)
        self.phi.requires_grad_(False)
        groups = self.trainable_groups(phi_part)
        for _, p in itertools.chain(*groups.values()):
            p.requires_grad_(True)
        return groups

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """LoRA + prompts + all of ``phi`` by saved name: every parameter trained in either stage."""
        return {n: p for items in self.trainable_groups("all").values() for n, p in items}

    def num_trained(self) -> int:
        return sum(p.numel() for p in self.trained_parameters().values())

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.trained_parameters().items()}

    def load_adapter_state(self, tensors: dict[str, torch.Tensor], source: str = "adapters") -> None:
        load_named_tensors(self.trained_parameters(), tensors, f"{source}: XBT tensors", CompatError)

    def remove(self) -> ClipBundle:
        """Remove LoRA and prompts in place; the bundle is then the original new model."""
        self.lora.remove()
        self.prompts.remove()
        return self.bundle


class XBTModel(AdaptedModel):
    """New queries ``norm(phi(norm(E_new(x))))`` read the old gallery as it is; removing LoRA and prompts
    gives back the original new model."""

    def __init__(self, adapted: AdaptedNewModel, contract: ServingContract, config: XBTStage2Config) -> None:
        super().__init__(contract, config)
        self.adapted = adapted

    @property
    def logit_scale(self) -> float:
        return self.config.logit_scale

    @classmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        new = parts["new"]
        phi = XBTProjection(new.embed_dim, contract.dim)
        adapted = AdaptedNewModel(new, phi, config, new.device, copy_model=False)
        adapted.load_adapter_state(adapters, f"{cls.method} adapters")
        adapted.bundle.model.eval()
        phi.eval()
        return cls(adapted, contract, config)


def stage1_texts(batches: Iterable[Batch], config: XBTConfig) -> list[str]:
    """D_T: the lines of ``config.text_corpus`` or the captions of one pass over ``batches``, deduplicated."""
    if config.text_corpus:
        path = Path(config.text_corpus)
        if not path.is_file():
            raise CompatError(
                f"xbt: text_corpus {path} does not exist; give a UTF-8 file with one caption per "
                "line, or leave text_corpus unset to use the training captions"
            )
        source: Iterable[str] = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
        where = str(path)
    else:
        source = (text for batch in batches for text in batch.texts)
        where = "the training batches"
    texts: dict[str, None] = {}
    for text in source:
        if text:
            texts.setdefault(text, None)
            if len(texts) >= config.stage1_max_texts:
                break
    if len(texts) < 2:
        raise CompatError(f"xbt: stage 1 needs at least 2 distinct texts, {where} gave {len(texts)}")
    return list(texts)


def pretrain_projection(
    new: ClipBundle, old: Encoder, texts: list[str], config: XBTConfig, device: torch.device
) -> tuple[XBTProjection, dict[str, Any]]:
    """Stage 1 (Sec. 3.2): train all of ``phi`` on text embeddings of the frozen encoders with Eq. 3."""
    history = TrainingLog("xbt stage 1 (text-only phi)", config.log_every, "stage1_lr", part="stage1.")
    w_new = new.encode_texts(texts, device=device).to(device)
    w_old = old.encode_texts(texts, device=device).to(device)
    if w_old.shape[-1] != int(old.embed_dim):
        raise CompatError(
            f"xbt: the old text encoder gave {w_old.shape[-1]}-d vectors, expected {old.embed_dim}"
        )
    phi = XBTProjection(new.embed_dim, int(old.embed_dim)).to(device)
    phi.train()
    optimizer = torch.optim.AdamW(phi.parameters(), lr=config.stage1_lr, weight_decay=config.weight_decay)
    batch_size = min(config.stage1_batch_size, len(texts))
    batches = minibatches(len(texts), batch_size, device=device)
    for step, idx in history.track(itertools.islice(batches, config.stage1_steps), config.stage1_steps):
        loss = stage1_loss(phi, w_new[idx], w_old[idx], config.noise_std, config.logit_scale)
        history.step(optimizer, step, loss=loss)
    phi.eval()
    trained = sum(p.numel() for p in phi.parameters())
    return phi, history.finish(texts=len(texts), batch_size=batch_size, trainable_parameters=trained)


StepLoss = Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor]


def train_adapters(
    adapted: AdaptedNewModel,
    batches: Iterable[Batch],
    config: XBTStage2Config,
    step_loss: StepLoss,
    phi_part: str,
    description: str,
) -> dict[str, Any]:
    """Train LoRA + prompts + ``phi_part`` of ``phi`` with ``step_loss(batch, v_bar, w_bar)``, ``v_bar`` and
    ``w_bar`` the l2-normalised projected embeddings of the batch. Constant learning rates: ``lr`` for LoRA
    and ``phi``, ``prompt_lr`` for the prompts (Sec. 4.1)."""
    device = adapted.bundle.device
    groups = adapted.set_trainable(phi_part)
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in groups["lora"] + groups["phi"]], "lr": config.lr},
            {"params": [p for _, p in groups["prompts"]], "lr": config.prompt_lr},
        ],
        weight_decay=config.weight_decay,
    )
    model = adapted.bundle.model
    augment = augment_for(model.visual, adapted.bundle.image_size) if config.augment else None
    model.train()
    adapted.phi.train()
    history = TrainingLog(description, config.log_every, f"lr ({config.lr})")
    for step, batch in history.track(cycle_batches(batches, config.steps), config.steps):
        images = prepare_images(batch.images, adapted.bundle, train=True).to(device)
        if augment is not None:
            images = augment(images)
        tokens = adapted.bundle.tokenizer(list(batch.texts)).to(device)
        v_bar = adapted.head.encode_image(images, normalize=True)
        w_bar = adapted.head.encode_text(tokens, normalize=True)
        history.step(optimizer, step, loss=step_loss(batch, v_bar, w_bar))
    model.eval().requires_grad_(False)
    adapted.phi.eval().requires_grad_(False)
    return history.finish(trainable_parameters={k: sum(p.numel() for _, p in v) for k, v in groups.items()})


def train_stage2(
    adapted: AdaptedNewModel, batches: Iterable[Batch], config: XBTStage2Config
) -> dict[str, Any]:
    """Stage 2 (Sec. 3.3): ``L_X`` (Eq. 5) on LoRA + prompts + phi's LayerNorms. Takes no old model."""

    def loss(batch: Batch, v_bar: torch.Tensor, w_bar: torch.Tensor) -> torch.Tensor:
        return xbt_loss(v_bar, w_bar, config.logit_scale)

    return train_adapters(adapted, batches, config, loss, "layernorm", "xbt stage 2")


@register_method("xbt")
class XBT(CompatMethod):
    """Text-only pretrained ``phi``, then LoRA + prompts + phi-LN trained with ``L_X``, no old model."""

    config_class = XBTConfig
    model_class = XBTModel

    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: XBTConfig) -> XBTModel:
        device = resolve_device(config.device)
        with seeded(config.seed, device):
            texts = stage1_texts(batches, config)
            with on_device(old, device):
                phi, stage1 = pretrain_projection(new, old, texts, config, device)
            adapted = AdaptedNewModel(new, phi, config, device)
            stage2 = train_stage2(adapted, batches, config)
        model = XBTModel(adapted, self.contract(config, int(old.embed_dim), int(old.embed_dim)), config)
        return model.trained(adapted.num_trained(), {**stage2, "stage1": stage1})
