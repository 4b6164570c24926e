"""Streaming, resumable reads of img2dataset-style shards (``{key}.jpg`` / ``.txt`` / ``.json``).

Shards come from local paths, globs, brace patterns or fsspec URLs (:func:`expand_urls`). A
:class:`ShardStream` visits them in a deterministic per-(seed, epoch) order, reads them with
tarfile and webdataset's key grouper (:func:`compat.data.shards.iter_raw_samples`) and decodes
samples with webdataset's decoder (images to 8-bit RGB by :func:`compat.data.images.decode_rgb`, with
transparency on a white background unless told otherwise, at most :data:`compat.data.images.MAX_PIXELS`
and no larger than the ``image_size`` the reader asks for; ``.txt`` and ``.json`` only; nothing is ever
unpickled). Its :attr:`ShardStream.position` is the position after the last
sample yielded; a stream built with that position continues with exactly the next sample,
passing over the already-consumed members of the current shard without decoding them.

The loader expects validated shards: a sample without an image or a caption, or an undecodable
member, raises :class:`LoaderError` naming the shard and the key.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from compat.data.cache import sample_bytes
from compat.data.images import MAX_PIXELS, WHITE, ImageDecodeError, check_background, decode_rgb
from compat.data.shards import ShardError, is_local, iter_raw_samples, local_path, refuse_pipe

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from compat.data.cache import SampleCache

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
_GLOB_CHARS = re.compile(r"[*?\[]")


class LoaderError(ValueError):
    """Shards cannot be found or a sample cannot be decoded; the message names the spec, shard and key."""


def _expand_one(spec: str) -> list[str]:
    import braceexpand

    out: list[str] = []
    for item in braceexpand.braceexpand(spec):
        try:
            refuse_pipe(item)
        except ShardError as exc:
            raise LoaderError(str(exc)) from exc
        if is_local(item):
            path = local_path(item)
            as_file_url = item.startswith("file:")
            if _GLOB_CHARS.search(path):
                matches = sorted(m for m in glob.glob(path, recursive=True) if os.path.isfile(m))
            elif os.path.isdir(path):
                matches = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".tar"))
            else:
                matches = [path] if os.path.isfile(path) else []
            if not matches:
                raise LoaderError(f"shard spec {spec!r} matches no shard ({item!r} names nothing on disk)")
            out += [f"file://{os.path.abspath(m)}" if as_file_url else m for m in matches]
        elif _GLOB_CHARS.search(item):
            import fsspec

            fs, _, paths = fsspec.get_fs_token_paths(item)
            if not paths:
                raise LoaderError(f"shard spec {spec!r} matches no shard ({item!r} matched nothing)")
            protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
            out += [fs.unstrip_protocol(p) if protocol not in ("file", "local") else p for p in sorted(paths)]
        else:
            out.append(item)  # remote URL: opened (and checked) by fsspec when read
    return out


def expand_urls(spec: str | Sequence[str]) -> list[str]:
    """Shard URLs from a spec or a list of specs, in order, without duplicates.

    A spec is a local path, a directory (its ``*.tar`` files), a glob (``shards/*.tar``; ``**`` spans
    folders; files only), a brace pattern (``shard-{00000..00009}.tar``) or an fsspec URL (``file://``,
    ``s3://``, ``gs://``, ``memory://``, ...; remote globs are listed through fsspec). Training, evaluation
    and validation all expand shards here. A local spec that matches nothing raises :class:`LoaderError`.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise LoaderError("no shard spec given")
    urls: list[str] = []
    seen: set[str] = set()
    for s in specs:
        for url in _expand_one(os.fspath(s)):
            if url not in seen:
                seen.add(url)
                urls.append(url)
    return urls


@dataclass
class Sample:
    """A decoded sample: PIL RGB image, its caption (``.txt``), all captions, the ``.json`` metadata, and the
    upright size of the stored image (the image itself may be decoded smaller)."""

    key: str
    image: Image.Image
    caption: str
    captions: list[str]
    meta: dict[str, Any]
    shard: str
    original_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class StreamPosition:
    """Where a :class:`ShardStream` stands: after ``sample_offset`` samples of the ``shard_index``-th
    shard (in the epoch's shard order) of ``epoch``, ``samples_seen`` samples in all."""

    epoch: int = 0
    shard_index: int = 0
    sample_offset: int = 0
    samples_seen: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StreamPosition:
        """Build from :meth:`to_dict` output; raise ``ValueError`` naming a missing or bad field."""
        values = {}
        for name in ("epoch", "shard_index", "sample_offset", "samples_seen"):
            value = doc.get(name) if isinstance(doc, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"stream position field {name!r} must be a non-negative integer, got {value!r}"
                )
            values[name] = value
        return cls(**values)


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Shard visiting order of ``epoch``: a permutation fixed by (seed, epoch), or 0..n-1 unshuffled."""
    if not shuffle:
        return list(range(n_shards))
    import numpy as np

    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n_shards)]


def _decoder(
    background: Sequence[int] = WHITE, image_size: int | None = None, max_pixels: int | None = MAX_PIXELS
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    from webdataset import autodecode

    background = check_background(background, "shard reader")

    def decode(key: str, data: bytes) -> Any:
        ext = key.rsplit(".", 1)[-1].lower()
        if ext in IMAGE_EXTS:
            try:
                return decode_rgb(data, background, size=image_size, max_pixels=max_pixels)
            except ImageDecodeError as exc:
                raise ValueError(str(exc)) from exc
        if ext == "txt":
            return data.decode("utf-8")
        if ext == "json":
            import json

            return json.loads(data)
        return None

    only = {*IMAGE_EXTS, "txt", "json"}
    return autodecode.Decoder([decode], pre=[], post=[], only=only)


def decode_sample(
    raw: dict[str, Any], shard: str, decoder: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> Sample:
    """Decode a webdataset raw sample (``__key__`` plus members) into a :class:`Sample`."""
    from webdataset.autodecode import DecodingError

    key = raw.get("__key__", "?")
    try:
        decoded = (decoder or _decoder())(raw)
    except DecodingError as exc:
        raise LoaderError(
            f"shard {shard}, key {key!r}: cannot decode member .{exc.k}: {exc.__cause__}"
        ) from exc
    image = next((decoded[e] for e in IMAGE_EXTS if e in decoded), None)
    if image is None:
        raise LoaderError(f"shard {shard}, key {key!r}: no image member (.jpg/.jpeg/.png/.webp)")
    meta = decoded.get("json") or {}
    if not isinstance(meta, dict):
        raise LoaderError(f"shard {shard}, key {key!r}: .json member is not an object")
    captions = meta.get("captions")
    caption = decoded.get("txt") or meta.get("caption") or (captions[0] if captions else None)
    if not isinstance(caption, str) or not caption.strip():
        raise LoaderError(f"shard {shard}, key {key!r}: no caption (.txt member or json 'caption')")
    if not isinstance(captions, list) or not captions or not all(isinstance(c, str) for c in captions):
        captions = [caption]
    size = image.info.get("original_size")
    return Sample(key, image, caption, list(captions), meta, shard, tuple(size) if size else image.size)


class ShardStream:
    """Iterable of :class:`Sample` over shards, with a deterministic shard order and a resumable position.

    ``epochs=None`` repeats forever. Images are decoded by :func:`compat.data.images.decode_rgb`
    (transparency onto ``background``), to ``image_size`` on the short side when larger (None: full size;
    a JPEG is decoded at a reduced scale), refused above ``max_pixels``. With a ``cache``
    (:class:`compat.data.cache.SampleCache`) a local shard read to its end is kept decoded, and later reads
    of it (the next epoch, another stream sharing the cache) decode nothing. Shard order is
    :func:`shard_order` per (seed, epoch); samples keep their order inside a shard. Iterating again (a
    second ``iter()``) continues from :attr:`position`; build a new stream with ``position=`` to resume
    in another process.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        shuffle_shards: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        position: StreamPosition | dict[str, int] | None = None,
        background: Sequence[int] = WHITE,
        image_size: int | None = None,
        max_pixels: int | None = MAX_PIXELS,
        cache: SampleCache | None = None,
    ) -> None:
        self.urls = expand_urls(urls)
        self.cache = cache
        self._decode_settings = (image_size, tuple(check_background(background, "shard reader")), max_pixels)
        self.shuffle_shards = shuffle_shards
        self.seed = seed
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.epochs = epochs
        if isinstance(position, dict):
            position = StreamPosition.from_dict(position)
        self.position = position or StreamPosition()
        if self.position.shard_index > len(self.urls):
            raise ValueError(
                f"position shard_index {self.position.shard_index} is past the {len(self.urls)} shards"
            )
        self._decoder = _decoder(background, image_size, max_pixels)

    def order(self, epoch: int) -> list[str]:
        """Shard URLs in the order epoch ``epoch`` visits them."""
        return [self.urls[i] for i in shard_order(len(self.urls), self.seed, epoch, self.shuffle_shards)]

    def __iter__(self) -> Iterator[Sample]:
        pos = self.position
        epoch, shard_index, offset, seen = pos.epoch, pos.shard_index, pos.sample_offset, pos.samples_seen
        while self.epochs is None or epoch < self.epochs:
            order = self.order(epoch)
            while shard_index < len(order):
                url = order[shard_index]
                key = self.cache.key(url, self._decode_settings) if self.cache is not None else None
                cached = self.cache.get(key) if self.cache is not None else None
                if cached is not None:
                    for sample in cached[offset:]:
                        offset += 1
                        seen += 1
                        self.position = StreamPosition(epoch, shard_index, offset, seen)
                        yield sample
                    shard_index, offset = shard_index + 1, 0
                    continue
                kept: list[Sample] | None = [] if key is not None and offset == 0 else None
                kept_bytes = 0
                try:
                    for raw in iter_raw_samples(url, skip=offset):
                        sample = decode_sample({"__key__": raw.key, **raw.members}, url, self._decoder)
                        if kept is not None and self.cache is not None:
                            kept_bytes += sample_bytes(sample)
                            kept = kept if kept_bytes <= self.cache.max_bytes else None  # never fits: stop
                            if kept is not None:
                                kept.append(sample)
                        offset += 1
                        seen += 1
                        self.position = StreamPosition(epoch, shard_index, offset, seen)
                        yield sample
                except ShardError as exc:
                    raise LoaderError(str(exc)) from exc
                if kept is not None and self.cache is not None:
                    self.cache.put(key, kept)
                shard_index, offset = shard_index + 1, 0
            epoch, shard_index = epoch + 1, 0
            self.position = StreamPosition(epoch, 0, 0, seen)


@dataclass
class Batch:
    """A collated batch: images ``[B, C, H, W]``, token ids ``[B, L]``, keys, and the position after it."""

    images: torch.Tensor
    texts: torch.Tensor
    keys: list[str]
    position: StreamPosition


def pick_caption(sample: Sample, choice: Literal["first", "random"], seed: int, epoch: int) -> str:
    """The caption to train on: the ``.txt`` one, or one of ``captions`` fixed by (seed, key, epoch).

    The random pick hashes its inputs instead of drawing from a generator, so a resumed stream
    picks the same captions as an uninterrupted one.
    """
    if choice == "first":
        return sample.caption
    if choice != "random":
        raise ValueError(f"caption_choice must be 'first' or 'random', got {choice!r}")
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample.key}".encode(), digest_size=8).digest()
    return sample.captions[int.from_bytes(digest, "little") % len(sample.captions)]


def iter_batches(
    stream: ShardStream,
    batch_size: int,
    image_transform: Callable[[Any], Any],
    tokenizer: Callable[[list[str]], Any],
    caption_choice: Literal["first", "random"] = "first",
    seed: int = 0,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Collate ``stream`` into :class:`Batch` es of ``batch_size``.

    ``image_transform`` maps a PIL image to a ``[C, H, W]`` tensor; ``tokenizer`` maps a list of
    captions to a ``[B, L]`` tensor (an open_clip tokenizer does). The last, smaller batch is
    yielded unless ``drop_last``; a dropped tail counts as not consumed: each batch's ``position``
    is the stream position right after its last sample, so resuming from the last batch trained on
    replays the dropped samples.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    images: list[Any] = []
    texts: list[str] = []
    keys: list[str] = []
    position = stream.position

    def collate() -> Batch:
        tokens = tokenizer(texts)
        return Batch(
            torch.stack([torch.as_tensor(i) for i in images]),
            tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens),
            list(keys),
            position,
        )

    for sample in stream:
        images.append(image_transform(sample.image))
        texts.append(pick_caption(sample, caption_choice, seed, stream.position.epoch))
        keys.append(sample.key)
        position = stream.position
        if len(keys) == batch_size:
            yield collate()
            images, texts, keys = [], [], []
    if keys and not drop_last:
        yield collate()


@dataclass
class CaptionedSet:
    """An evaluation or gallery set held in memory, with every caption of each image."""

    keys: list[str]
    images: list[Image.Image]
    captions: list[list[str]]
    metas: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


def load_captioned_set(
    urls: str | Sequence[str],
    background: Sequence[int] = WHITE,
    image_size: int | None = None,
    max_pixels: int | None = MAX_PIXELS,
) -> CaptionedSet:
    """Read every sample of ``urls`` (in spec order, shards unshuffled) into a :class:`CaptionedSet`
    (images decoded by :func:`compat.data.images.decode_rgb`, transparency onto ``background``, to
    ``image_size`` on the short side when larger: give the model input so the set holds no more).

    Raises :class:`LoaderError` on a duplicate key.
    """
    out = CaptionedSet([], [], [], [])
    seen: dict[str, str] = {}
    stream = ShardStream(
        urls,
        shuffle_shards=False,
        epochs=1,
        background=background,
        image_size=image_size,
        max_pixels=max_pixels,
    )
    for sample in stream:
        if sample.key in seen:
            raise LoaderError(f"key {sample.key!r} appears twice: in {seen[sample.key]} and {sample.shard}")
        seen[sample.key] = sample.shard
        out.keys.append(sample.key)
        out.images.append(sample.image)
        out.captions.append(sample.captions)
        out.metas.append(sample.meta)
    return out
