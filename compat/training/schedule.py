"""Learning-rate schedule: linear warmup, then cosine decay (OpenAI CLIP / open_clip ``cosine_lr``).

The Mod-X paper warms up for 20% of each phase's steps (Table 4); the schedule restarts every phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CosineWarmup:
    """``lr(step)`` for ``step`` in ``[0, total_steps)``: ``base_lr * (step + 1) / warmup_steps`` during
    warmup, then ``min_lr + (base_lr - min_lr) * (1 + cos(pi * e / es)) / 2`` with ``e = step - warmup``,
    ``es = total_steps - warmup``."""

    base_lr: float
    total_steps: int
    warmup_steps: int
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps must be in [0, {self.total_steps}], got {self.warmup_steps}")
        if not (self.base_lr >= 0 and self.min_lr >= 0):
            raise ValueError("learning rates must be >= 0")

    @classmethod
    def from_fraction(
        cls, base_lr: float, total_steps: int, warmup_fraction: float, min_lr: float = 0.0
    ) -> CosineWarmup:
        if not 0 <= warmup_fraction <= 1:
            raise ValueError(f"warmup_fraction must be in [0, 1], got {warmup_fraction}")
        return cls(base_lr, total_steps, int(round(warmup_fraction * total_steps)), min_lr)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        e = min(step - self.warmup_steps, decay_steps)
        return self.min_lr + 0.5 * (1 + math.cos(math.pi * e / max(decay_steps, 1))) * (
            self.base_lr - self.min_lr
        )
