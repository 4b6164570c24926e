"""XBT's image augmentation (Sec. 4.1) on already preprocessed image batches.

The paper lists: random resized crop with scale (0.5, 1.0), random horizontal flip, random contrast,
brightness and sharpness, random translation and rotation -- without magnitudes. Chosen here: contrast and
brightness factors in [0.8, 1.2], sharpness factor 2 with probability 0.5, rotation up to 10 degrees,
translation up to 10% of the side. Each image gets its own random draw. Photometric operations act on
``[0, 1]`` pixels, so the batch is un-normalised with the model's mean/std first and normalised again after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PairedImageAugment:
    """Callable ``[B, 3, S, S] -> [B, 3, S, S]`` applying the augmentation above to normalised images."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        from torchvision.transforms import v2

        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)
        self.transform = v2.Compose(
            [
                v2.RandomResizedCrop(image_size, scale=(0.5, 1.0), antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ColorJitter(brightness=0.2, contrast=0.2),
                v2.RandomAdjustSharpness(sharpness_factor=2.0, p=0.5),
                v2.RandomAffine(degrees=10.0, translate=(0.1, 0.1)),
            ]
        )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean.to(images), self.std.to(images)
        pixels = (images * std + mean).clamp(0, 1)
        out = torch.stack([self.transform(img) for img in pixels])
        return (out - mean) / std


def augment_for(visual: torch.nn.Module, image_size: int) -> PairedImageAugment:
    """The augmentation for an open_clip vision tower (its ``image_mean``/``image_std``, else CLIP's)."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    mean = getattr(visual, "image_mean", None) or OPENAI_DATASET_MEAN
    std = getattr(visual, "image_std", None) or OPENAI_DATASET_STD
    return PairedImageAugment(image_size, mean, std)
