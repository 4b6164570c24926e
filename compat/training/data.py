"""What the trainer consumes: batches of preprocessed images and token ids, with a resumable position."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_CACHE_BYTES = 1 << 30  # decoded samples kept across epochs (compat.data.cache.DEFAULT_MAX_BYTES)


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


@dataclass(eq=False)
class ShardBatchSource:
    """Global batches from webdataset shards, repeating over epochs, resumable at any batch boundary.

    Shard order is shuffled per (seed, epoch); one of each sample's captions is drawn per epoch by a hash of
    (seed, epoch, key), so a resumed run sees exactly the samples, captions and order of an uninterrupted one.
    Images are decoded to ``image_size`` on the short side when larger (give the model input), and kept
    decoded in a :class:`compat.data.cache.SampleCache` of ``cache_bytes`` (0: none), so that epochs after
    the first decode nothing. ``workers`` > 0 decodes and transforms in that many processes
    (:class:`compat.data.loader.ShardStream`): the batches and positions are those of ``workers=0``, and a
    random training transform draws per (seed, epoch, key) either way.
    """

    urls: str | Sequence[str]
    batch_size: int
    image_transform: Callable[[Any], Any]
    tokenizer: Callable[[list[str]], Any]
    _: KW_ONLY
    seed: int = 0
    caption_choice: str = "random"
    shuffle_shards: bool = True
    image_size: int | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    workers: int = 0

    def __post_init__(self) -> None:
        from compat.data.cache import SampleCache
        from compat.data.loader import expand_urls

        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 for a contrastive loss, got {self.batch_size}")
        if self.workers < 0:
            raise ValueError(f"loader workers must be >= 0 (0: decode in this process), got {self.workers}")
        self.urls = expand_urls(self.urls)
        self.cache = SampleCache(self.cache_bytes)

    def batches(self, position: dict[str, Any] | None) -> Iterator[TrainBatch]:
        from compat.data.loader import ShardStream, iter_batches

        stream = ShardStream(
            self.urls,
            shuffle_shards=self.shuffle_shards,
            seed=self.seed,
            epochs=None,
            position=position,
            image_size=self.image_size,
            cache=self.cache,
            workers=self.workers,
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


@dataclass
class ReplayBuffer:
    """A fixed memory of earlier phases' pairs: PIL images, every caption of each, sample keys."""

    keys: list[str]
    images: list[Any]
    captions: list[list[str]]

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def from_phases(
        cls,
        urls_by_phase: Sequence[Sequence[str] | str],
        size: int,
        seed: int = 0,
        image_size: int | None = None,
    ) -> ReplayBuffer:
        """``size`` samples drawn at random (seeded), split evenly over the earlier phases given, their
        images decoded to ``image_size`` on the short side when larger (the model input).

        The Mod-X paper's buffer (Table 2) is loosely specified: a random sample of the pretraining data
        before the first phase, topped up with the same number of samples of each finished phase. Here
        every earlier phase gets an equal share of a buffer of constant ``size`` (reservoir-like).
        """
        import random

        from compat.data.loader import ShardStream

        if size < 1 or not urls_by_phase:
            raise ValueError(f"a replay buffer needs size >= 1 and at least one phase, got {size}")
        rng = random.Random(f"replay-{seed}")
        out = cls([], [], [])
        n = len(urls_by_phase)
        for j, urls in enumerate(urls_by_phase):
            share = size // n + (1 if j < size % n else 0)
            # Reservoir sampling (Algorithm R), one streaming pass: memory O(share) whatever the phase's size
            kept: list[tuple[int, Any]] = []
            stream = ShardStream(urls, shuffle_shards=False, epochs=1, image_size=image_size)
            for seen, sample in enumerate(stream):
                if seen < share:
                    kept.append((seen, sample))
                elif (slot := rng.randrange(seen + 1)) < share:
                    kept[slot] = (seen, sample)
            for _, sample in sorted(kept, key=lambda item: item[0]):
                out.keys.append(sample.key)
                out.images.append(sample.image)
                out.captions.append(list(sample.captions))
        return out


@dataclass(eq=False)
class ReplayBatchSource:
    """Current-phase batches in which ``replay`` of the ``batch_size`` rows come from a :class:`ReplayBuffer`.

    This is the Mod-X paper's "Mod-X + buffer" (Table 2) when trained with alpha > 0 -- the teacher
    understands the buffer's earlier-phase pairs, so Eq 3 keeps their rows and the KL preserves their
    structure -- and experience replay when trained with alpha = 0. Rows ``[0, batch_size - replay)`` are
    the current phase's (a :class:`ShardBatchSource`), the rest buffer pairs drawn without replacement per
    batch, each with one of its captions, by a RNG seeded with (seed, batch number): resuming at a reported
    position replays exactly.
    """

    urls: str | Sequence[str]
    buffer: ReplayBuffer
    batch_size: int
    replay: int
    image_transform: Callable[[Any], Any]
    tokenizer: Callable[[list[str]], Any]
    _: KW_ONLY
    seed: int = 0
    image_size: int | None = None
    workers: int = 0

    def __post_init__(self) -> None:
        replay, most, held = self.replay, self.batch_size - 2, len(self.buffer)
        if not 1 <= replay <= most:
            raise ValueError(f"replay must be in [1, batch_size - 2] = [1, {most}], got {replay}")
        if held < replay:
            raise ValueError(f"the replay buffer holds {held} pairs, fewer than replay = {replay}")
        rows = self.batch_size - replay  # the current phase's
        options = {"seed": self.seed, "image_size": self.image_size, "workers": self.workers}
        self.current = ShardBatchSource(self.urls, rows, self.image_transform, self.tokenizer, **options)

    def batches(self, position: dict[str, Any] | None) -> Iterator[TrainBatch]:
        import random

        import torch

        position = position or {}
        drawn = int(position.get("replay_batches", 0))
        for b in self.current.batches(position.get("current")):
            rng = random.Random(f"replay-{self.seed}-{drawn}")
            idx = rng.sample(range(len(self.buffer)), self.replay)
            images = torch.stack([torch.as_tensor(self.image_transform(self.buffer.images[i])) for i in idx])
            tokens = torch.as_tensor(self.tokenizer([rng.choice(self.buffer.captions[i]) for i in idx]))
            drawn += 1
            yield TrainBatch(
                torch.cat([b.images, images]),
                torch.cat([b.texts, tokens]),
                b.keys + [self.buffer.keys[i] for i in idx],
                {"current": b.position, "replay_batches": drawn},
            )
