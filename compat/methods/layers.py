"""Small layers shared by the compatibility methods."""

from __future__ import annotations

import torch
from torch import nn


class OrthogonalMatrix(nn.Module):
    """A learnable orthogonal matrix ``B = exp(P)``, ``P`` skew-symmetric (Lezcano-Casado 2019).

    The learnable parameters are the strictly upper-triangular entries of ``U``; ``P = triu(U, 1) -
    triu(U, 1)^T``. This is the strict backward adapter ``B_perp`` of lambda-orthogonality (Sec. 3.2) and the
    BT block of BT^2 (Lemma 2). ``U = 0`` at initialisation, so ``B = I``. The exponential is taken in float64
    so that ``B B^T = I`` holds to float32 precision.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"OrthogonalMatrix: dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.upper = nn.Parameter(torch.zeros(dim, dim))

    def matrix(self) -> torch.Tensor:
        """The orthogonal matrix ``B`` [dim, dim]."""
        upper = torch.triu(self.upper, diagonal=1).double()
        return torch.linalg.matrix_exp(upper - upper.T).to(self.upper.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``B x`` for every row ``x`` of ``x`` [N, dim]."""
        return x @ self.matrix().T

    def num_trainable(self) -> int:
        """Free parameters: the strictly upper-triangular entries."""
        return self.dim * (self.dim - 1) // 2


def truncate(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The first ``dim`` coordinates of every row (the prefix rule), re-normalised."""
    if x.shape[-1] < dim:
        raise ValueError(f"cannot truncate vectors of dimension {x.shape[-1]} to {dim}")
    return nn.functional.normalize(x[..., :dim], dim=-1)


def zero_pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Append zeros to every row of ``x`` up to dimension ``dim``."""
    if x.shape[-1] > dim:
        raise ValueError(f"cannot zero-pad vectors of dimension {x.shape[-1]} to {dim}")
    return nn.functional.pad(x, (0, dim - x.shape[-1]))
