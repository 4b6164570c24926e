"""TaCA's tied-weight bottleneck adapters in every block of open_clip's vision transformer.

TaCA (Sec. 3.3, Eq. 3-4): ``Adapter(x) = x + W_up sigma(W_down x)`` with ``W_up = W_down^T``. One parameter
``W`` of shape ``[d', k]`` (``k`` the block width, ``d'`` the bottleneck) gives ``out = x + W^T sigma(W x)``:
``k * d'`` parameters per adapter, no biases (the paper counts ``L k d'`` in all, Sec. 4.2).

Choices where the paper is silent (its Fig. 2b is not in the text):

- Position: one adapter per block (the parameter count ``L k d'`` rules out Houlsby's two), on the output of
  the block's MLP before the residual addition, ``x + ls_2(Adapter(mlp(ln_2(x))))`` -- the single
  post-FFN adapter of Pfeiffer et al. (2020), Houlsby's second position.
- sigma = GELU (the ViT's own activation).
- Initialisation: ``W ~ N(0, init_std^2)`` with a small ``init_std`` (0.01). ``W = 0`` would be a fixed point
  with zero gradient because the weights are tied and ``GELU(0) = 0``.

The adapter is the submodule ``<block>.adapter`` (parameter ``<block>.adapter.weight``, so the paper's
"params named 'adapter'" rule finds it) applied by a forward hook on ``<block>.mlp``; original parameters keep
their names and values, and :meth:`AdapterHandle.remove` restores the encoder exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTRIBUTE = "adapter"


class TiedAdapter(nn.Module):
    """``x + W^T GELU(W x)`` with one weight ``W`` [bottleneck, dim] (TaCA Eq. 3-4)."""

    def __init__(self, dim: int, bottleneck: int, init_std: float = 0.01) -> None:
        super().__init__()
        if not 1 <= bottleneck <= dim:
            raise ValueError(f"TiedAdapter: bottleneck must be in [1, dim={dim}], got {bottleneck}")
        if not init_std > 0:
            raise ValueError(
                f"TiedAdapter: init_std must be > 0 (W = 0 is a zero-gradient fixed point), got {init_std}"
            )
        self.dim, self.bottleneck = int(dim), int(bottleneck)
        self.weight = nn.Parameter(torch.randn(bottleneck, dim) * init_std)

    @property
    def w_down(self) -> torch.Tensor:
        return self.weight

    @property
    def w_up(self) -> torch.Tensor:
        """``W_up = W_down^T`` (Eq. 4): the same storage, transposed."""
        return self.weight.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        return x + F.linear(F.gelu(F.linear(x, weight)), weight.T)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self(output)


class AdapterHandle:
    """The inserted adapters (one per block, in block order); :meth:`remove` undoes the insertion."""

    def __init__(self, blocks: list[nn.Module], adapters: list[TiedAdapter]) -> None:
        self.blocks, self.adapters = blocks, adapters
        self._hooks = [
            block.mlp.register_forward_hook(adapter._hook)
            for block, adapter in zip(blocks, adapters, strict=True)
        ]

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def parameters(self) -> list[nn.Parameter]:
        return [a.weight for a in self.adapters]

    def remove(self) -> None:
        """Remove the hooks and the ``adapter`` submodules (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for block, adapter in zip(self.blocks, self.adapters, strict=True):
            if getattr(block, ATTRIBUTE, None) is adapter:
                delattr(block, ATTRIBUTE)


def vision_blocks(visual: nn.Module) -> list[nn.Module]:
    """The residual blocks of an open_clip ``VisionTransformer``; ``TypeError`` for other encoders."""
    blocks = getattr(getattr(visual, "transformer", None), "resblocks", None)
    if blocks is None or not all(hasattr(getattr(b, "mlp", None), "c_proj") for b in blocks):
        raise TypeError(
            f"tied adapters need an open_clip VisionTransformer with transformer.resblocks[*].mlp.c_proj; "
            f"got {type(visual).__name__}"
        )
    return list(blocks)


def insert_tied_adapters(visual: nn.Module, bottleneck: int, init_std: float = 0.01) -> AdapterHandle:
    """Put a :class:`TiedAdapter` of bottleneck ``bottleneck`` after the MLP of every block of ``visual``."""
    blocks = vision_blocks(visual)
    if any(hasattr(b, ATTRIBUTE) for b in blocks):
        raise ValueError("this vision encoder already has adapters; remove them first")
    adapters = []
    for block in blocks:
        weight = block.mlp.c_proj.weight  # [width, mlp_width]
        adapter = TiedAdapter(weight.shape[0], bottleneck, init_std).to(weight)  # its device and dtype
        setattr(block, ATTRIBUTE, adapter)
        adapters.append(adapter)
    return AdapterHandle(blocks, adapters)
