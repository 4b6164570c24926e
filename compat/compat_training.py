"""Compatibility training from files: load the models, stream the shards, fit a method, save the result.

This is what the ``compat`` pipeline step and ``compatflow compat train`` call. It sits above the methods
and the production-model contract (:mod:`compat.production`), which it loads the old model through.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat.methods import get_method
from compat.methods.model import CompatModel
from compat.methods.training import StepListener, step_records
from compat.models import load_checkpoint, read_sidecar
from compat.production import load_encoder, space_id_of

log = logging.getLogger(__name__)


def decode_size(*encoders: Any) -> int | None:
    """The short side images are decoded to for ``encoders``: the largest input (None when one is unknown)."""
    from compat.methods.training import image_size_of

    sizes = [image_size_of(e) for e in encoders]
    return None if any(s is None for s in sizes) else max(int(s) for s in sizes)  # type: ignore[arg-type]


@dataclass
class PairBatch:
    """Training pairs as the methods take them: PIL images and raw captions (each model tokenises its own)."""

    images: list[Any]
    texts: list[str]
    keys: list[str]


@dataclass(eq=False)
class ShardBatches:
    """Re-iterable batches from shards: each pass over it is the next epoch (its own shard order).

    Captions are picked per (seed, key, epoch) among each sample's captions. Full batches only, unless the
    shards hold fewer samples than one batch (then that one smaller batch). ``max_samples`` caps an epoch.

    Samples pass through a seeded shuffle buffer of ``shuffle_buffer`` samples (0 or 1: shard order only), so
    that a batch mixes shards. Without it every batch holds consecutive samples of one shard -- of one data
    phase, one domain -- and the in-batch negatives of the cross-model losses never come from the other
    domains that share the evaluation gallery (the hub captions an old text encoder produces for a domain it
    never learned then win new image queries of every domain: new/old image-to-text collapses).
    """

    urls: str | Sequence[str]
    batch_size: int
    seed: int = 0
    caption_choice: str = "random"
    max_samples: int | None = None
    shuffle_buffer: int = 4096
    image_size: int | None = None  # decoded to this short side when larger (the largest model input)
    cache_bytes: int = 1 << 30  # decoded shards kept across epochs: later ones decode nothing

    def __post_init__(self) -> None:
        from compat.data.cache import SampleCache
        from compat.data.loader import expand_urls

        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 for contrastive training, got {self.batch_size}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        self.urls = expand_urls(self.urls)
        self.cache = SampleCache(self.cache_bytes)
        self.epoch = 0

    def __iter__(self) -> Iterator[PairBatch]:
        from compat.data.loader import ShardStream, StreamPosition, pick_caption

        epoch = self.epoch
        self.epoch += 1
        stream = ShardStream(
            self.urls,
            seed=self.seed,
            epochs=epoch + 1,
            position=StreamPosition(epoch=epoch),
            image_size=self.image_size,
            cache=self.cache,
        )
        images, texts, keys, yielded = [], [], [], 0
        for sample in self._shuffled(stream, epoch):
            images.append(sample.image)
            texts.append(pick_caption(sample, self.caption_choice, self.seed, epoch))  # type: ignore[arg-type]
            keys.append(sample.key)
            if len(keys) == self.batch_size:
                yield PairBatch(images, texts, keys)
                yielded += 1
                images, texts, keys = [], [], []
        if keys and yielded == 0 and len(keys) >= 2:
            yield PairBatch(images, texts, keys)

    def _shuffled(self, stream: Iterator[Any], epoch: int) -> Iterator[Any]:
        """``stream`` (cut at ``max_samples``) through the seeded shuffle buffer of this epoch."""
        import random

        rng = random.Random(f"shard-batches-{self.seed}-{epoch}")
        pool: list[Any] = []
        for seen, sample in enumerate(stream, start=1):
            if self.shuffle_buffer <= 1:
                yield sample
            else:
                pool.append(sample)
                if len(pool) >= self.shuffle_buffer:
                    j = rng.randrange(len(pool))
                    pool[j], pool[-1] = pool[-1], pool[j]
                    yield pool.pop()
            if self.max_samples is not None and seen >= self.max_samples:
                break
        rng.shuffle(pool)
        yield from pool


def train_compat(
    method: str,
    old: str | Path,
    new: str | Path,
    shards: str | Sequence[str],
    out_dir: str | Path,
    settings: Mapping[str, Any] | None = None,
    batch_size: int = 64,
    max_samples: int | None = None,
    on_step: StepListener | None = None,
) -> CompatModel:
    """Fit ``method`` with the model at ``old`` frozen, starting from ``new``; save to ``out_dir``.

    ``settings`` are the method's config values (see ``compatflow compat methods``). ``old_space_id``
    defaults to the old model's space, ``version`` to the new checkpoint's version. ``on_step`` receives each
    training step's record as it is made (:func:`compat.methods.training.step_records`).
    """
    runner = get_method(method)
    old_encoder = load_encoder(old)
    new_bundle = load_checkpoint(Path(new))
    values = dict(settings or {})
    values.setdefault("old_space_id", space_id_of(old, old_encoder))
    values.setdefault("version", str(read_sidecar(Path(new))["version"]))
    config = runner.make_config(values)
    batches = ShardBatches(
        shards,
        batch_size,
        seed=config.seed,
        max_samples=max_samples,
        image_size=decode_size(old_encoder, new_bundle),
    )
    log.info(
        "compat %s: %d shard(s), batch %d, old %s, new %s", method, len(batches.urls), batch_size, old, new
    )
    with step_records(on_step):
        model = runner.fit(new_bundle, old_encoder, batches, config)
    model.training_info.setdefault(
        "data", {"shards": len(batches.urls), "batch_size": batch_size, "epochs_started": batches.epoch}
    )
    model.training_info["sources"] = {"old": str(old), "new": str(new)}
    model.save(out_dir)
    return model
