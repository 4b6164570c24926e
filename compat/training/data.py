"""What the trainer consumes: batches of preprocessed images and token ids, with a resumable position."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class TrainBatch:
    """One global batch: images [B, C, H, W], token ids [B, L], sample keys, the data position after it."""

    images: torch.Tensor
    texts: torch.Tensor
    keys: list[str]
    position: dict[str, Any]


class BatchSource(Protocol):
    """An endless batch iterator that can restart right after any position it reported."""

    batch_size: int

    def batches(self, position: dict[str, Any] | None) -> Iterator[TrainBatch]: ...


class ShardBatchSource:
    """Global batches from webdataset shards, repeating over epochs, resumable at any batch boundary.

    Shard order is shuffled per (seed, epoch); one of each sample's captions is drawn per epoch by a hash of
    (seed, epoch, key), so a resumed run sees exactly the samples, captions and order of an uninterrupted one.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        batch_size: int,
        image_transform: Callable[[Any], Any],
        tokenizer: Callable[[list[str]], Any],
        *,
        seed: int = 0,
        caption_choice: str = "random",
        shuffle_shards: bool = True,
    ) -> None:
        from compat.data.loader import expand_urls

        if batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 for a contrastive loss, got {batch_size}")
        self.urls = expand_urls(urls)
        self.batch_size = batch_size
        self.image_transform = image_transform
        self.tokenizer = tokenizer
        self.seed = seed
        self.caption_choice = caption_choice
        self.shuffle_shards = shuffle_shards

    def batches(self, position: dict[str, Any] | None) -> Iterator[TrainBatch]:
        from compat.data.loader import ShardStream, iter_batches

        stream = ShardStream(
            self.urls, shuffle_shards=self.shuffle_shards, seed=self.seed, epochs=None, position=position
        )
        for b in iter_batches(
            stream,
            self.batch_size,
            self.image_transform,
            self.tokenizer,
            caption_choice=self.caption_choice,
            seed=self.seed,
            drop_last=True,
        ):
            yield TrainBatch(b.images, b.texts, b.keys, b.position.to_dict())


class TensorBatchSource:
    """Batches cut from in-memory tensors in a fixed order, cycling; position = index of the next row."""

    def __init__(
        self, images: torch.Tensor, texts: torch.Tensor, batch_size: int, keys: Sequence[str] | None = None
    ) -> None:
        if images.shape[0] != texts.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {texts.shape[0]} texts")
        self.images, self.texts, self.batch_size = images, texts, batch_size
        self.keys = list(keys) if keys is not None else [str(i) for i in range(images.shape[0])]

    def batches(self, position: dict[str, Any] | None) -> Iterator[TrainBatch]:
        import torch

        n = self.images.shape[0]
        start = int((position or {}).get("next", 0))
        while True:
            idx = [(start + i) % n for i in range(self.batch_size)]
            start += self.batch_size
            t = torch.tensor(idx)
            yield TrainBatch(self.images[t], self.texts[t], [self.keys[i] for i in idx], {"next": start})
