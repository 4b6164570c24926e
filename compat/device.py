"""Which torch device a run uses: "auto" picks CUDA when there is one; a missing CUDA device is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; a CUDA device asked on a machine without CUDA raises
    ``ValueError`` saying what to pass instead; anything else as given."""
    import torch

    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} asked but CUDA is not available; use device cpu or auto")
    return device
