"""Helpers every method's training loop shares: frozen features, batches, the optimiser schedule, the log."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from compat.methods.contract import Batch, CompatError, Encoder
from compat.methods.model import CompatModel
from compat.models import ClipBundle
from compat.progress import Tracked, track

log = logging.getLogger("compat.methods")
T = TypeVar("T")


def logit_scale_of(encoder: Encoder) -> float:
    """The contrastive temperature multiplier ``s`` of a frozen encoder (a bundle's ``logit_scale.exp()``)."""
    if isinstance(encoder, ClipBundle):
        return float(encoder.model.logit_scale.detach().exp().clamp(max=100.0).item())
    return float(getattr(encoder, "logit_scale", 1 / 0.07))


def contract_lineage(old: Encoder) -> tuple[str | None, tuple[int, ...]]:
    """Space id and gallery dimensions readable by prefix through ``old`` when it is a compatible model.

    A plain bundle gives ``(None, ())``. For a compatible model: its own dimension, plus the dimensions it
    reads by a prefix rule (``as_is`` / ``zero_pad`` / ``truncate``) when it kept the old space.
    """
    if not isinstance(old, CompatModel):
        return None, ()
    dims: tuple[int, ...] = (old.contract.dim,)
    if old.contract.keeps_space and old.contract.old_vector_rule in ("as_is", "zero_pad", "truncate"):
        dims += tuple(d for d in old.contract.old_dims if d not in dims)
    return old.contract.space_id, dims


def cycle_batches(batches: Iterable[Batch], steps: int) -> Iterator[Batch]:
    """Yield ``steps`` batches, starting ``batches`` over when it runs out (it must be re-iterable)."""
    produced = 0
    while produced < steps:
        empty = True
        for batch in batches:
            empty = False
            yield batch
            produced += 1
            if produced >= steps:
                return
        if empty:
            raise CompatError(
                f"the training data produced no batch (after {produced} of {steps} steps); "
                "pass a non-empty, re-iterable batch source"
            )


def prepare_images(images: Any, bundle: ClipBundle, train: bool = True) -> torch.Tensor:
    """A [B, 3, S, S] tensor for ``bundle``: PIL lists go through its preprocessing; tensors are checked."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[-1] != bundle.image_size or images.shape[-2] != bundle.image_size:
            raise CompatError(
                f"image batch of shape {tuple(images.shape)} does not fit model {bundle.config_name!r} "
                f"(expects [B, 3, {bundle.image_size}, {bundle.image_size}]); preprocess with the "
                "model's own transform or pass PIL images"
            )
        return images
    transform = bundle.preprocess_train if train else bundle.preprocess_eval
    return torch.stack([transform(im) for im in images])


def texts_of(batch: Batch) -> list[str]:
    """The raw captions of a batch (token ids are refused: each model tokenises with its own tokenizer)."""
    texts = batch.texts
    if isinstance(texts, torch.Tensor) or not all(isinstance(t, str) for t in texts):
        raise CompatError(
            "compatibility training needs raw caption strings in batch.texts (the old and new models "
            "may use different tokenizers); use compat.compat_training.ShardBatches"
        )
    return list(texts)


def image_size_of(encoder: Encoder) -> int | None:
    """Input resolution of an encoder (None when unknown)."""
    return encoder.image_size if isinstance(encoder, ClipBundle) else getattr(encoder, "image_size", None)


def frozen_features(
    encoder: Encoder, batch: Batch, device: torch.device, prepared: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised image and text features of a frozen encoder on ``batch``, on ``device``, without gradients.

    ``prepared`` (the trained model's input tensor) is reused when the encoder takes the same resolution, so
    both models see the same view; otherwise the encoder preprocesses the batch's images itself. All cf-*
    configs share open_clip's default normalisation.
    """
    images = batch.images
    if prepared is not None and image_size_of(encoder) == prepared.shape[-1]:
        images = prepared
    elif isinstance(encoder, ClipBundle):
        images = prepare_images(images, encoder, train=False)
    with torch.no_grad():
        img = encoder.encode_images(images, device=device)
        txt = encoder.encode_texts(texts_of(batch), device=device)
    return img.to(device), txt.to(device)


def freeze(encoder: Encoder, device: torch.device | None = None) -> Encoder:
    """Gradients off, eval mode, moved to ``device`` (a bundle); compatible models stay as they are."""
    if isinstance(encoder, ClipBundle):
        encoder.model.requires_grad_(False).eval()
        if device is not None:
            encoder.model.to(device)
    return encoder


def working_copy(new: ClipBundle, device: torch.device, copy: bool = True) -> ClipBundle:
    """``new`` on ``device`` for training; its network deep-copied first (``copy``), so the caller's bundle
    is never modified."""
    return dataclasses.replace(new, model=(deepcopy(new.model) if copy else new.model).to(device))


def minibatches(
    n: int, size: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> Iterator[torch.Tensor]:
    """Endless index minibatches of ``size`` over ``range(n)``: epochs of a random order, each epoch's
    incomplete last minibatch skipped."""
    order, cursor = torch.randperm(n, generator=generator, device=device), 0
    while True:
        if cursor + size > n:
            order, cursor = torch.randperm(n, generator=generator, device=device), 0
        yield order[cursor : cursor + size]
        cursor += size


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with ``torch.manual_seed(seed)`` and restore the caller's RNG state afterwards."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def on_device(encoder: Encoder, device: torch.device) -> Iterator[None]:
    """Keep a frozen ``ClipBundle`` on ``device`` for the block (its ``encode_*`` would otherwise move it
    there and back on every call)."""
    if not isinstance(encoder, ClipBundle) or encoder.device == device:
        yield
        return
    original = encoder.device
    encoder.model.to(device)
    try:
        yield
    finally:
        encoder.model.to(original)


def adamw_cosine(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, steps: int, warmup_fraction: float
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up over ``warmup_fraction`` of ``steps`` then cosine decay to zero."""
    from compat.training.schedule import CosineWarmup

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    factor = CosineWarmup.from_fraction(1.0, steps, warmup_fraction).lr_at
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


StepListener = Callable[[dict[str, float]], None]
_listener: ContextVar[StepListener | None] = ContextVar("compat_step_listener", default=None)


@contextlib.contextmanager
def step_records(listener: StepListener | None) -> Iterator[None]:
    """Within the block, every :class:`TrainingLog` a method's ``fit`` keeps also hands each step's record
    (``{"step": n, <term>: value, ...}``, ``n`` from 1, the terms the method records) to ``listener`` as it
    is made: a tracker logs a compatibility fit as it runs, whichever method, with no change to the methods'
    ``fit`` contract."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


@dataclass
class TrainingLog:
    """A fit's optimisation record: its progress line, each step's update and loss terms (stored in
    ``compat.json`` under ``training``); each step's record also goes to the listener of
    :func:`step_records`, when one is set."""

    name: str = ""  # the fit in progress lines and errors ("bct", "xbt stage 1")
    every: int = 50  # a step kept in ``history`` every ``every`` steps
    lr: str = "lr"  # the setting to lower when the loss diverges, e.g. "lr (0.0005)"
    part: str = ""  # names a fit's earlier part in the listener's records (XBT's "stage1."), kept apart
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    listener: StepListener | None = field(default_factory=_listener.get)
    progress: Tracked | None = None

    def track(self, items: Iterable[T], total: int | None = None) -> Iterator[tuple[int, T]]:
        """``enumerate(items)``, shown as this fit's progress with the last loss."""
        self.progress = track(items, self.name, total=total, unit="steps")
        return enumerate(self.progress)

    def student_steps(
        self, batches: Iterable[Batch], steps: int, student: ClipBundle, old: Encoder, device: torch.device
    ) -> Iterator[tuple]:
        """:meth:`track` over ``steps`` batches (:func:`cycle_batches`): each step's index, batch,
        ``student``'s image tensor and tokens of it, and the frozen ``old`` features of the same pairs."""
        for step, batch in self.track(cycle_batches(batches, steps), steps):
            images = prepare_images(batch.images, student, train=True).to(device)
            tokens = student.tokenizer(texts_of(batch)).to(device)
            yield step, batch, images, tokens, frozen_features(old, batch, device, images)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        step: int,
        schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
        **terms: torch.Tensor,
    ) -> None:
        """Back-propagate the first of ``terms`` (the loss), step ``optimizer`` and ``schedule``, record
        ``terms``; a loss that is not finite stops the fit with a sentence."""
        loss = next(iter(terms.values()))
        if not torch.isfinite(loss):
            raise CompatError(f"{self.name}: the loss became {loss.item()} at step {step}; lower {self.lr}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        self.record(step, **terms)

    def record(self, step: int, **terms: torch.Tensor | float) -> None:
        self.steps = step + 1
        self._last = {"step": step, **{k: round(float(v), 6) for k, v in terms.items()}}
        if self.progress is not None:
            self.progress.set(loss=self._last[next(iter(terms))])
        if self.listener is not None:
            terms = {f"{self.part}{k}": v for k, v in self._last.items() if k != "step"}
            self.listener({"step": step + 1, **terms})
        if step == 0 or (self.every > 0 and step % self.every == 0):
            self.history.append(self._last)
            log.info(
                "step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in self._last.items() if k != "step")
            )

    def finish(self, **extra: Any) -> dict[str, Any]:
        last = getattr(self, "_last", None)
        if last is not None and (not self.history or self.history[-1]["step"] != last["step"]):
            self.history.append(last)
        return {
            "steps": self.steps,
            "seconds": round(time.monotonic() - self.started, 3),
            "history": self.history,
            **extra,
        }
