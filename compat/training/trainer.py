"""The training loop for continual CLIP training: Mod-X, fine-tuning (CLIP_ct) and joint training.

One optimizer step consumes one *global* batch of ``batch_size`` pairs: the B x B contrastive matrices of
both the InfoNCE and the Mod-X KL term span the whole global batch, across DDP ranks (features gathered with
gradients) and across gradient-accumulation micro-batches (features of the other micro-batches cached
without gradients, as open_clip's ``accum_freq``), so accumulation and data parallelism change memory and
speed, not the gradient.

Optimizer and schedule follow the Mod-X paper's Table 4: AdamW (betas 0.9/0.99, eps 1e-8, weight decay 0.2
on weight matrices, none on gains, biases and the logit scale), cosine decay with 20% linear warmup; the
learnable logit scale is clamped to [0, ln 100] after every step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compat.io import atomic_write
from compat.training.ddp import SINGLE, DistInfo, barrier, gather_no_grad, gather_with_grad
from compat.training.schedule import CosineWarmup
from compat.training.state import (
    ResumeError,
    TrainState,
    checkpoint_name,
    list_checkpoints,
    load_training_checkpoint,
    read_state_document,
    remove_stale_temporaries,
    save_training_checkpoint,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from compat.losses import LossTerms, ModXLoss
    from compat.models import ClipBundle
    from compat.training.data import BatchSource

log = logging.getLogger(__name__)

LOGIT_SCALE_MAX = math.log(100.0)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHECKPOINT_DIR = "checkpoints"
LEDGER_FILE = "samples.jsonl"
# Settings that shape the trajectory: a checkpoint resumes only under the same values.
_TRAJECTORY_FIELDS = tuple(
    "steps batch_size accum_steps lr min_lr weight_decay betas eps warmup_fraction alpha "
    "selective_correction seed precision".split()
)


@dataclass
class TrainConfig:
    """Settings of one training run (one phase). ``batch_size`` is the global contrastive batch B."""

    steps: int
    batch_size: int = 64
    accum_steps: int = 1
    lr: float = 5e-4
    min_lr: float = 0.0
    weight_decay: float = 0.2
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    warmup_fraction: float = 0.2
    alpha: float = 20.0
    selective_correction: bool = True  # Mod-X Eq 3; False is an ablation outside the paper
    precision: str = "auto"
    max_grad_norm: float | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0
    log_every: int = 10

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 (a contrastive batch), got {self.batch_size}")
        if self.accum_steps < 1 or self.batch_size % self.accum_steps:
            raise ValueError(f"accum_steps ({self.accum_steps}) must divide batch_size ({self.batch_size})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "betas": list(self.betas)}


@dataclass
class TrainResult:
    state: TrainState
    checkpoint: Path
    resumed_from: int | None
    step_times: list[float] = field(default_factory=list)


def mixed_precision(precision: str, device: torch.device) -> tuple[Any, Any]:
    """The autocast context of ``precision`` and, for fp16, its GradScaler (else None). ``auto``: bf16 on a
    CUDA device that supports it, else fp16 on CUDA, fp32 on CPU."""
    import torch

    if precision == "auto" and device.type == "cuda":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    elif precision == "fp16" and device.type != "cuda":
        raise ValueError("fp16 mixed precision needs a CUDA device; use fp32 or bf16 on CPU")
    if precision in ("auto", "fp32"):
        return contextlib.nullcontext(), None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return torch.autocast(device_type=device.type, dtype=dtype), scaler


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on weight matrices only (open_clip's rule: none on gains, biases, logit scale)."""
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    groups = [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": config.weight_decay},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def clamp_logit_scale(model: torch.nn.Module) -> None:
    """Clamp the learnable log temperature to [0, ln 100] (CLIP; Mod-X App B.1)."""
    import torch

    if (scale := getattr(getattr(model, "module", model), "logit_scale", None)) is not None:
        with torch.no_grad():
            scale.clamp_(0.0, LOGIT_SCALE_MAX)


def clip_features(
    model: torch.nn.Module, images: torch.Tensor, texts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised image and text features and ``logit_scale.exp()`` from an open_clip CLIP forward."""
    out = model(images, texts)
    if isinstance(out, dict):
        return out["image_features"], out["text_features"], out["logit_scale"]
    return out[0], out[1], out[2]


def _features_no_grad(
    model: torch.nn.Module, chunks: list, dist: DistInfo, autocast
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each micro-batch's image and text features, gathered over the ranks, without gradients."""
    import torch

    out = []
    with torch.no_grad(), autocast:
        for im, tx in chunks:
            f_i, f_t, _ = clip_features(model, im, tx)
            out.append((gather_no_grad(f_i, dist), gather_no_grad(f_t, dist)))
    return out


def loss_and_backward(
    model: torch.nn.Module,
    images: torch.Tensor,
    texts: torch.Tensor,
    loss_fn: ModXLoss,
    *,
    teacher: torch.nn.Module | None = None,
    dist: DistInfo = SINGLE,
    accum_steps: int = 1,
    autocast=None,
    scaler: Any = None,
) -> LossTerms:
    """Forward and backward of one global batch; ``images``/``texts`` are this rank's rows.

    With ``accum_steps > 1`` the local rows are split into micro-batches; the features of the other
    micro-batches enter each micro-batch's loss as constants, so the accumulated gradient equals the
    full-batch gradient. The logit scale takes its gradient from one micro-batch only (the last), for the
    same reason. Returns the (detached) loss terms of the global batch.
    """
    import torch

    from compat.losses import LossTerms

    autocast = autocast if autocast is not None else contextlib.nullcontext()
    chunks = list(zip(images.chunk(accum_steps), texts.chunk(accum_steps), strict=True))
    old_i = old_t = None
    if loss_fn.needs_teacher:
        if teacher is None:
            raise ValueError("this loss needs the teacher (the frozen production model)")
        # the frozen teacher's global-batch features, in the same row order as the student's
        old = _features_no_grad(teacher, chunks, dist, autocast)
        old_i, old_t = torch.cat([i.float() for i, _ in old]), torch.cat([t.float() for _, t in old])
    cached = _features_no_grad(model, chunks, dist, autocast) if accum_steps > 1 else []
    terms = None
    for j, (im, tx) in enumerate(chunks):
        last = j == accum_steps - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast:
                f_i, f_t, scale = clip_features(model, im, tx)
            g_i, g_t = gather_with_grad(f_i, dist), gather_with_grad(f_t, dist)
            if accum_steps > 1:
                g_i = torch.cat([c[0] for c in cached[:j]] + [g_i] + [c[0] for c in cached[j + 1 :]])
                g_t = torch.cat([c[1] for c in cached[:j]] + [g_t] + [c[1] for c in cached[j + 1 :]])
            s = scale if last else scale.detach()
            terms = loss_fn(g_i.float(), g_t.float(), s.float(), old_i, old_t)
            (scaler.scale(terms.total) if scaler is not None else terms.total).backward()
    assert terms is not None
    return LossTerms(*(None if t is None else t.detach() for t in terms))


class _Ledger:
    """``samples.jsonl``: the keys each optimizer step trained on, cut back to the checkpoint on resume."""

    def __init__(self, path: Path, keep_through_step: int, enabled: bool) -> None:
        self._fh = None
        if not enabled:
            return
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by a kill: everything after it is past the checkpoint too
                if entry["step"] <= keep_through_step:
                    kept.append(line)
        if len(kept) != keep_through_step:
            raise ResumeError(
                f"{path} lists {len(kept)} steps up to step {keep_through_step}; "
                "it does not belong to this checkpoint"
            )
        atomic_write(path, lambda tmp: tmp.write_text("".join(k + "\n" for k in kept)))
        self._fh = open(path, "a")  # noqa: SIM115 - held open for the whole run

    def append(self, step: int, keys: list[str]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"step": step, "keys": keys}) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def _check_resumable(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    current = config.to_dict()
    if diff := {k: (saved.get(k), current[k]) for k in _TRAJECTORY_FIELDS if saved.get(k) != current[k]}:
        detail = ", ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items())
        raise ResumeError(
            f"cannot resume from {path}: the run was started with other settings ({detail}); "
            "use the same settings or another output directory"
        )


def train(
    student: ClipBundle,
    source: BatchSource,
    config: TrainConfig,
    workdir: Path,
    *,
    teacher: ClipBundle | None = None,
    dist: DistInfo = SINGLE,
    resume: bool = True,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train ``student`` for ``config.steps`` optimizer steps on ``source``, resuming from ``workdir``.

    ``workdir/checkpoints/step-*`` hold resumable checkpoints (every ``checkpoint_every`` steps and at the
    end); ``workdir/samples.jsonl`` lists the sample keys of every step. With ``alpha > 0`` the loss is Mod-X
    against ``teacher`` (frozen, eval mode); ``alpha = 0`` is plain fine-tuning. Under torchrun (``dist``),
    every rank reads the same global batches and trains on its equal share of rows. ``on_step`` (main rank)
    receives each step's record as it is made (step, loss, its terms, lr, step time).
    """
    import torch

    from compat.losses import ModXLoss
    from compat.progress import Task

    loss_fn = ModXLoss(config.alpha, config.selective_correction)
    _check_inputs(student, source, config, dist, teacher)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_root = workdir / CHECKPOINT_DIR
    device = student.device
    autocast, scaler = mixed_precision(config.precision, device)
    schedule = CosineWarmup.from_fraction(config.lr, config.steps, config.warmup_fraction, config.min_lr)
    model = student.model.train()
    optimizer = build_optimizer(model, config)
    teacher_model = teacher.model.eval().requires_grad_(False) if loss_fn.needs_teacher else None

    last_ckpt, state = _start_or_resume(ckpt_root, model, optimizer, scaler, config, dist, resume=resume)
    resumed_from = state.step if last_ckpt else None
    if dist.distributed:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    ledger = _Ledger(workdir / LEDGER_FILE, state.step, enabled=dist.is_main)
    rows = dist.local_slice(config.batch_size)
    step_times: list[float] = []
    batches = source.batches(state.position)
    options = {"dist": dist, "accum_steps": config.accum_steps, "autocast": autocast, "scaler": scaler}
    saved = {"config": config.to_dict(), "schedule": asdict(schedule), "keep": config.keep_checkpoints}
    bar = Task("training", config.steps, "steps", completed=state.step, enabled=dist.is_main)
    try:  # the order of a step's effects (state, ledger, record, checkpoint) makes a resumed run exact
        for _ in range(state.step, config.steps):
            t0 = time.perf_counter()
            batch = next(batches)
            lr = schedule.lr_at(state.step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            images, texts = (t[rows].to(device, non_blocking=True) for t in (batch.images, batch.texts))
            terms = loss_and_backward(model, images, texts, loss_fn, teacher=teacher_model, **options)
            _optimizer_step(model, optimizer, scaler, config.max_grad_norm, terms, state.step + 1, lr)
            state.advance(len(batch.keys), batch.position)
            step_times.append(time.perf_counter() - t0)
            record = _step_record(state.step, terms, lr, model, step_times[-1])
            state.history.append(record)
            ledger.append(state.step, batch.keys)
            if on_step is not None and dist.is_main:
                on_step(record)
            bar.advance(1, loss=record["loss"])
            if config.log_every and state.step % config.log_every == 0:
                line = "step %(step)d/%(steps)d loss %(loss).4f (contrastive %(contrastive).4f, kl %(kl).4f)"
                log.info(line + " lr %(lr).2e", {**record, "steps": config.steps})
            due = config.checkpoint_every and state.step % config.checkpoint_every == 0
            if due or state.step == config.steps:
                last_ckpt = ckpt_root / checkpoint_name(state.step)
                if dist.is_main:
                    saved["scaler_state"] = scaler.state_dict() if scaler else None
                    save_training_checkpoint(ckpt_root, student, optimizer, state, **saved)
                barrier(dist)
    finally:
        bar.close()
        ledger.close()
    assert last_ckpt is not None  # the final step always writes one
    return TrainResult(state, Path(last_ckpt), resumed_from, step_times)


def _check_inputs(
    student: ClipBundle, source: BatchSource, config: TrainConfig, dist: DistInfo, teacher: ClipBundle | None
) -> None:
    """Refuse what cannot train, before anything is read or written; each message says what to change."""
    if source.batch_size != config.batch_size:
        raise ValueError(
            f"the batch source yields {source.batch_size} pairs, config.batch_size is {config.batch_size}"
        )
    if config.batch_size % (config.accum_steps * dist.world_size):
        raise ValueError(
            f"batch_size {config.batch_size} must split evenly over {dist.world_size} ranks x "
            f"{config.accum_steps} accumulation steps"
        )
    if config.alpha > 0 and teacher is None:  # ModXLoss.needs_teacher
        raise ValueError(f"alpha={config.alpha} (Mod-X) needs a teacher model; use alpha=0 to fine-tune")
    if teacher is not None and teacher.model is student.model:
        raise ValueError("the teacher must be a separate copy of the model, not the student itself")
    if not any(p.requires_grad for p in student.model.parameters()):
        raise ValueError("the student has no trainable parameters (requires_grad is off everywhere)")


def _start_or_resume(
    ckpt_root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    config: TrainConfig,
    dist: DistInfo,
    *,
    resume: bool,
) -> tuple[Path | None, TrainState]:
    """The newest resumable checkpoint loaded into ``model``, ``optimizer`` and ``scaler`` (its path and
    state), after checking that it was written with this training's settings; ``(None, TrainState())`` for
    a fresh start (seeded; ``resume=False`` deletes older checkpoints first)."""
    if dist.is_main:
        if not resume and ckpt_root.exists():
            shutil.rmtree(ckpt_root)  # a fresh start must not leave older checkpoints to resume from
        remove_stale_temporaries(ckpt_root)
    barrier(dist)
    found = next(reversed(list_checkpoints(ckpt_root)), None) if resume else None  # the newest
    if found is None:
        seed_everything(config.seed)
        return None, TrainState()
    _check_resumable(read_state_document(found)["config"], config, found)  # before touching the model
    state, scaler_state = load_training_checkpoint(found, model, optimizer)
    if scaler is not None and scaler_state:
        scaler.load_state_dict(scaler_state)
    log.info("resuming from %s (step %d of %d)", found, state.step, config.steps)
    return found, state


def _optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    max_grad_norm: float | None,
    terms: LossTerms,
    step: int,
    lr: float,
) -> None:
    """Apply the accumulated gradients (unscaled first under fp16, clipped when asked), then keep CLIP's
    logit scale within its bound. A loss that is not finite stops the run first (fp16's scaler skips it)."""
    import torch

    if not math.isfinite(loss := float(terms.total)) and scaler is None:
        raise FloatingPointError(
            f"loss is {loss} at step {step}; lower the learning rate (now {lr:g}) or use fp32"
        )
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    clamp_logit_scale(model)


def _step_record(
    step: int, terms: Any, lr: float, model: torch.nn.Module, seconds: float
) -> dict[str, float]:
    """One step's line of the training history (what ``on_step`` receives and the curve plots)."""
    record = {
        "step": step,
        "loss": float(terms.total),
        "contrastive": float(terms.contrastive),
        "kl": float(terms.kl),
        "lr": lr,
        "logit_scale": float(getattr(model, "module", model).logit_scale.detach().exp()),
        "step_time_s": seconds,
    }
    if terms.kept is not None:
        record["teacher_rows_kept"] = float(terms.kept)
    return record
