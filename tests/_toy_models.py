"""Toy model pairs with a known answer for the compatibility-method tests.

``rotated_copy(old, new_dim)`` is the old CLIP with both projections multiplied by a random ``Q``
[old_dim, new_dim] with orthonormal rows, plus noise: its embeddings are the old ones isometrically embedded
in ``new_dim`` dimensions (``e_new ~= e_old Q``), so ``e_old ~= e_new Q^T`` is the map a compatibility head
has to learn, and before training a head new and old vectors are unrelated.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from types import SimpleNamespace

import torch

WORDS = (
    "red green blue yellow purple orange circle square triangle star ring cross small large "
    "top bottom left right center striped dotted plain"
).split()


def rotated_copy(old, new_dim: int, noise: float = 0.05, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old_dim = old.embed_dim
    q, _ = torch.linalg.qr(
        torch.randn(new_dim, old_dim, generator=gen)
    )  # [new_dim, old_dim], orthonormal cols
    rot = q.T.contiguous()  # [old_dim, new_dim], orthonormal rows
    model = copy.deepcopy(old.model)
    with torch.no_grad():
        for name in ("visual.proj", "text_projection"):
            owner, attr = (model.visual, "proj") if name == "visual.proj" else (model, "text_projection")
            weight = getattr(owner, attr)
            rotated = weight @ rot
            rotated += noise * weight.std() * torch.randn(rotated.shape, generator=gen)
            setattr(owner, attr, torch.nn.Parameter(rotated))
    return dataclasses.replace(old, model=model, embed_dim=new_dim)


def captions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        out.setdefault(" ".join(rng.choices(WORDS, k=5)), None)
    return list(out)


def batches(n: int, batch_size: int, image_size: int = 64, seed: int = 0) -> list[SimpleNamespace]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, image_size, image_size, generator=gen)
    texts = captions(n, seed)
    return [
        SimpleNamespace(images=images[i : i + batch_size], texts=texts[i : i + batch_size])
        for i in range(0, n, batch_size)
    ]
