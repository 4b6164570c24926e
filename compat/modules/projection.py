"""Projection heads that map a new model's embedding into the old model's space: XBT's ``phi`` (Sec. 4.1,
no dropout) and TaCA's dimension projector (Sec. 3.3; the paper names no activation: GELU, the ViTs' own)."""

from __future__ import annotations

import torch
from torch import nn


class _Projection(nn.Module):
    """An MLP ``net`` from ``in_dim`` to ``out_dim`` through ``hidden_dim``; inputs are checked."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int) -> None:
        super().__init__()
        for name, value in (("in_dim", in_dim), ("out_dim", out_dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.in_dim, self.out_dim, self.hidden_dim = in_dim, out_dim, hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_dim:
            raise ValueError(
                f"{type(self).__name__} expects inputs of dimension {self.in_dim}, got {x.shape[-1]}"
            )
        return self.net(x)


class XBTProjection(_Projection):
    """XBT's ``phi``: ``in_dim -> 4*out_dim -> 4*out_dim -> out_dim`` (Linear-LN-GELU-Linear-LN-GELU-Linear),
    hidden width four times the *output* (old) dimension.

    The module is the bare MLP; XBT l2-normalises its input and output around it (Sec. 3.2: "all embeddings
    are l2-normalized", so ``phi(w_new + eps)`` takes the re-normalised noisy embedding).
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int | None = None) -> None:
        hidden_dim = 4 * out_dim if hidden_dim is None else hidden_dim
        super().__init__(in_dim, out_dim, hidden_dim)
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, out_dim),
        )

    def layernorm_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the LayerNorms only: what XBT's stage 2 fine-tunes (Sec. 3.3)."""
        return [
            (f"net.{i}.{n}", p)
            for i, m in enumerate(self.net)
            if isinstance(m, nn.LayerNorm)
            for n, p in m.named_parameters()
        ]


class TwoLayerProjector(_Projection):
    """TaCA's dimension projector ``d_n -> d_p -> d_o`` (Linear-GELU-Linear), ``d_p = 4096`` by default."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 4096) -> None:
        super().__init__(in_dim, out_dim, hidden_dim)
        self.net = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, out_dim))
