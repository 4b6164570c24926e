"""Learnable visual prompt tokens (VPT-shallow, Jia et al. 2022) inside open_clip's VisionTransformer.

XBT (Sec. 3.3) adds trainable prompts "as input, along with image patch tokens" to the new image encoder; it
uses 10 prompts (Sec. 4.1) and gives no position. Choice made here, following VPT-shallow: ``n`` tokens are
inserted right after the class token at the input of the first Transformer block (after open_clip's
``ln_pre``), carry no positional embedding, and are dropped again at the output of the last block, so
pooling, ``ln_post`` and the projection see the token layout of the unprompted model. Initialisation is VPT's:
``U(-v, v)`` with ``v = sqrt(6 / (3 * patch_area + width))``.

The insertion is a pre-/post-hook pair on ``visual.transformer`` and the tokens live in the submodule
``visual.visual_prompts`` (parameter ``visual.visual_prompts.tokens``); no original parameter is renamed or
touched, and :meth:`PromptHandle.remove` restores the original encoder exactly. ``forward_intermediates`` of
open_clip bypasses ``transformer.forward`` and therefore runs unprompted.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ATTRIBUTE = "visual_prompts"


class VisualPrompts(nn.Module):
    """``n`` learnable tokens of width ``width`` [n, width]."""

    def __init__(self, n: int, width: int, patch_area: int) -> None:
        super().__init__()
        if n < 1 or width < 1:
            raise ValueError(f"VisualPrompts needs n >= 1 and width >= 1, got n={n}, width={width}")
        self.n = int(n)
        self.tokens = nn.Parameter(torch.empty(n, width))
        bound = math.sqrt(6.0 / float(3 * patch_area + width))
        nn.init.uniform_(self.tokens, -bound, bound)

    def insert(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, 1 + P, D] -> [N, 1 + n + P, D]``: the prompts go right after the class token."""
        prompts = self.tokens.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1)
        return torch.cat([x[:, :1], prompts, x[:, 1:]], dim=1)

    def strip(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`insert` on the transformer output."""
        return torch.cat([x[:, :1], x[:, 1 + self.n :]], dim=1)


class PromptHandle:
    """The inserted prompts and the hooks that apply them; :meth:`remove` undoes the insertion."""

    def __init__(self, visual: nn.Module, prompts: VisualPrompts) -> None:
        self.visual, self.prompts = visual, prompts
        transformer = visual.transformer
        self._hooks = [
            transformer.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            transformer.register_forward_hook(self._post_hook),
        ]

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self.prompts.insert(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "x": self.prompts.insert(kwargs["x"])}

    def _post_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.prompts.strip(output)

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def remove(self) -> None:
        """Remove the hooks and the ``visual_prompts`` submodule (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if getattr(self.visual, ATTRIBUTE, None) is self.prompts:
            delattr(self.visual, ATTRIBUTE)


def insert_visual_prompts(visual: nn.Module, n: int = 10) -> PromptHandle:
    """Insert ``n`` learnable prompt tokens into an open_clip ``VisionTransformer`` (``model.visual``).

    Raises ``TypeError`` for other encoders and ``ValueError`` if prompts are already inserted.
    """
    for attr in ("transformer", "class_embedding", "conv1"):
        if not hasattr(visual, attr):
            raise TypeError(
                f"visual prompts need an open_clip VisionTransformer; {type(visual).__name__} has no "
                f"attribute {attr!r}"
            )
    if hasattr(visual, ATTRIBUTE):
        raise ValueError("this vision encoder already has visual prompts; remove them first")
    width = visual.class_embedding.shape[-1]
    patch_h, patch_w = visual.conv1.kernel_size
    prompts = VisualPrompts(n, width, patch_h * patch_w).to(visual.class_embedding.device)
    setattr(visual, ATTRIBUTE, prompts)
    return PromptHandle(visual, prompts)
