"""Streaming, resumable reads of img2dataset-style shards (``{key}.jpg`` / ``.txt`` / ``.json``).

Only images, ``.txt`` and ``.json`` members are decoded (nothing unpickled). The loader expects validated
shards: a sample without an image or a caption, or an undecodable member, raises :class:`LoaderError` naming
the shard and the key.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, astuple, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from compat.data.cache import sample_bytes
from compat.data.images import MAX_PIXELS, WHITE, ImageDecodeError, check_background, decode_rgb
from compat.data.shards import IMAGE_EXTS, ShardError, is_local, iter_raw_samples, local_path, refuse_pipe

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from compat.data.cache import SampleCache

_GLOB_CHARS = re.compile(r"[*?\[]")
Decoder = Callable[[dict[str, Any]], dict[str, Any]]  # webdataset's: a raw sample to its decoded members


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
            if _GLOB_CHARS.search(path):
                matches = sorted(m for m in glob.glob(path, recursive=True) if os.path.isfile(m))
            elif os.path.isdir(path):
                matches = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".tar"))
            else:
                matches = [path] if os.path.isfile(path) else []
            if not matches:
                raise LoaderError(f"shard spec {spec!r} matches no shard ({item!r} names nothing on disk)")
            out += [f"file://{os.path.abspath(m)}" if item.startswith("file:") else m for m in matches]
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

    A spec is a local path, a directory (its ``*.tar`` files), a glob (``**`` spans folders), a brace
    pattern (``shard-{00000..00009}.tar``) or an fsspec URL (remote globs listed through fsspec). A local
    spec that matches nothing raises :class:`LoaderError`.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise LoaderError("no shard spec given")
    return list(dict.fromkeys(url for s in specs for url in _expand_one(os.fspath(s))))


@dataclass
class Sample:
    """A decoded sample; ``original_size`` is the stored image's upright size (``image`` may be smaller)."""

    key: str
    image: Image.Image
    caption: str
    captions: list[str]
    meta: dict[str, Any]
    shard: str
    original_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class StreamPosition:
    """After ``sample_offset`` samples of the ``shard_index``-th shard (in the epoch's order) of ``epoch``."""

    epoch: int = 0
    shard_index: int = 0
    sample_offset: int = 0
    samples_seen: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StreamPosition:
        """From :meth:`to_dict` output; raise ``ValueError`` naming a missing or bad field."""
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


def _decoder(image_size: int | None, background: Sequence[int], max_pixels: int | None) -> Decoder:
    from webdataset import autodecode

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
            return json.loads(data)
        return None

    return autodecode.Decoder([decode], pre=[], post=[], only={*IMAGE_EXTS, "txt", "json"})


def decode_sample(raw: dict[str, Any], shard: str, decoder: Decoder) -> Sample:
    """Decode a webdataset raw sample (``__key__`` plus members) into a :class:`Sample`."""
    from webdataset.autodecode import DecodingError

    key = raw.get("__key__", "?")
    try:
        decoded = decoder(raw)
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


DEFAULT_CHUNK = 16  # samples per task sent to a decoding worker
CHUNKS_AHEAD = 2  # per worker: tasks queued or done but not yet consumed (memory stays bounded)


@dataclass
class _Item:
    """One step of a stream walk: a sample to decode (``raw``) or cached (``sample``), or a marker: the end of
    a cacheable shard (``end_of``) or of an epoch, or a barrier (the next shard is still being cached)."""

    url: str | None
    position: StreamPosition | None
    raw: dict[str, Any] | None = None
    sample: Sample | None = None
    cache_key: Any = None  # the shard's cache key when it is read from its start into the cache
    end_of: Any = None
    barrier: bool = False


_WORKER: dict[str, Any] = {}


def _worker_start(decode_settings: tuple[Any, ...], prepare: Callable[[Sample, int], Any] | None) -> None:
    """A decoding worker's set-up: one torch thread, its decoder and step, and a watch that ends the worker
    when its parent is gone (killed, it cannot say so)."""
    import torch

    torch.set_num_threads(1)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="loader-parent-watch", daemon=True).start()
    _WORKER["decoder"] = _decoder(*decode_settings)
    _WORKER["prepare"] = prepare


def _work(item: _Item, decoder: Decoder, prepare: Any) -> tuple[Sample, Any]:
    sample = item.sample if item.sample is not None else decode_sample(item.raw, item.url, decoder)
    return sample, (prepare(sample, item.position.epoch) if prepare is not None else None)


class _TensorData:
    """A tensor crossing processes as plain bytes (torch would give each one a shared-memory segment)."""

    def __init__(self, tensor: Any) -> None:
        self.array = tensor.numpy()

    def tensor(self) -> Any:
        import torch

        return torch.from_numpy(self.array)


def _work_chunk(items: list[_Item]) -> tuple[list[tuple[Sample, Any]], LoaderError | None]:
    """A worker's task: the chunk's samples decoded and prepared, up to the first that cannot be (its error
    comes back beside the samples before it, which the stream still yields)."""
    import torch

    done: list[tuple[Sample, Any]] = []
    try:
        for item in items:
            sample, extra = _work(item, _WORKER["decoder"], _WORKER["prepare"])
            done.append((sample, _TensorData(extra) if isinstance(extra, torch.Tensor) else extra))
    except LoaderError as exc:
        return done, exc
    return done, None


class ShardStream:
    """Iterable of :class:`Sample` over shards, with a deterministic shard order and a resumable position.

    ``epochs=None`` repeats forever. Images are decoded by :func:`compat.data.images.decode_rgb` to
    ``image_size`` on the short side (None: full size). With a ``cache`` (:class:`~.cache.SampleCache`) a
    local shard read to its end is kept decoded for later reads. Iterating again continues from
    :attr:`position`; build a new stream with ``position=`` to resume in another process.

    ``workers`` > 0 decodes in that many processes, ``chunk`` samples per task, at most
    :data:`CHUNKS_AHEAD` chunks per worker ahead; the samples and every :attr:`position` are those of
    ``workers=0``.
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
        cache: SampleCache | None = None,
        workers: int = 0,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        self.urls = expand_urls(urls)
        self._decode_settings = (image_size, tuple(check_background(background, "shard reader")), MAX_PIXELS)
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        if workers < 0 or chunk < 1:
            raise ValueError(f"loader workers must be >= 0 and chunk >= 1, got {workers=!s}, {chunk=!s}")
        self.shuffle_shards, self.seed, self.epochs = shuffle_shards, seed, epochs
        self.cache, self.workers, self.chunk = cache, workers, chunk
        if isinstance(position, dict):
            position = StreamPosition.from_dict(position)
        self.position = position or StreamPosition()
        if self.position.shard_index > len(self.urls):
            raise ValueError(
                f"position shard_index {self.position.shard_index} is past the {len(self.urls)} shards"
            )
        self._decoder = _decoder(*self._decode_settings)

    def order(self, epoch: int) -> list[str]:
        """Shard URLs in the order epoch ``epoch`` visits them."""
        return [self.urls[i] for i in shard_order(len(self.urls), self.seed, epoch, self.shuffle_shards)]

    def __iter__(self) -> Iterator[Sample]:
        for sample, _ in self.prepared():
            yield sample

    def prepared(self, prepare: Callable[[Sample, int], Any] | None = None) -> Iterator[tuple[Sample, Any]]:
        """``(sample, prepare(sample, epoch))`` for each sample in stream order (``None`` without
        ``prepare``), in the :attr:`workers` processes when there are any (then ``prepare`` must pickle)."""
        self._filling: set[Any] = set()  # cache keys of shards read to their end, not yet put in the cache
        items = self._walk()
        if self.workers == 0:
            done: Iterator[tuple[_Item, Sample | None, Any]] = (
                (item, *(_work(item, self._decoder, prepare) if item.raw or item.sample else (None, None)))
                for item in items
            )
        else:
            done = self._in_workers(items, prepare)
        kept: list[Sample] | None = None
        kept_bytes = 0
        for item, sample, extra in done:
            if item.barrier:
                continue
            if item.end_of is not None:
                if kept is not None and self.cache is not None:
                    self.cache.put(item.end_of, kept)
                self._filling.discard(item.end_of)
                kept = None
                continue
            self.position = item.position
            if sample is None:  # the end of an epoch
                continue
            if item.cache_key is not None and self.cache is not None:
                if item.position.sample_offset == 1:
                    kept, kept_bytes = [], 0
                if kept is not None:
                    kept_bytes += sample_bytes(sample)
                    kept = kept if kept_bytes <= self.cache.max_bytes else None  # never fits: stop
                    if kept is not None:
                        kept.append(sample)
            yield sample, extra

    def _walk(self) -> Iterator[_Item]:
        """The stream from :attr:`position` as undecoded (or cached) samples and markers, in order."""
        epoch, shard_index, offset, seen = astuple(self.position)
        while self.epochs is None or epoch < self.epochs:
            order = self.order(epoch)
            while shard_index < len(order):
                url = order[shard_index]
                key = self.cache.key(url, self._decode_settings) if self.cache is not None else None
                if key is not None and key in self._filling:  # read ahead of the consumer: wait for its put
                    yield _Item(None, None, barrier=True)
                cached = self.cache.get(key) if self.cache is not None else None
                if cached is not None:
                    for sample in cached[offset:]:
                        offset += 1
                        seen += 1
                        yield _Item(url, StreamPosition(epoch, shard_index, offset, seen), sample=sample)
                    shard_index, offset = shard_index + 1, 0
                    continue
                cache_key = key if key is not None and offset == 0 else None
                try:
                    for raw in iter_raw_samples(url, skip=offset):
                        offset += 1
                        seen += 1
                        position = StreamPosition(epoch, shard_index, offset, seen)
                        members = {"__key__": raw.key, **raw.members}
                        yield _Item(url, position, raw=members, cache_key=cache_key)
                except ShardError as exc:
                    raise LoaderError(str(exc)) from exc
                if cache_key is not None:
                    self._filling.add(cache_key)
                    yield _Item(url, StreamPosition(epoch, shard_index, offset, seen), end_of=cache_key)
                shard_index, offset = shard_index + 1, 0
            epoch, shard_index = epoch + 1, 0
            yield _Item(None, StreamPosition(epoch, 0, 0, seen))

    def _in_workers(
        self, items: Iterator[_Item], prepare: Callable[[Sample, int], Any] | None
    ) -> Iterator[tuple[_Item, Sample | None, Any]]:
        """``items`` decoded (and prepared) by a pool of :attr:`workers` processes, in order, not past a
        barrier until everything before it is consumed. A read error ends the stream after the samples
        before it."""
        pool = ProcessPoolExecutor(
            self.workers, initializer=_worker_start, initargs=(self._decode_settings, prepare)
        )
        pending: deque[tuple[list[_Item], Any]] = deque()  # (items, future of their results or None)
        chunk: list[_Item] = []
        error: BaseException | None = None
        draining = False  # a barrier was reached: hand out nothing more until the consumer catches up

        def submit() -> None:
            nonlocal chunk
            if chunk:
                pending.append((chunk, pool.submit(_work_chunk, chunk)))
                chunk = []

        try:
            while True:
                while error is None and not draining and len(pending) < CHUNKS_AHEAD * self.workers:
                    try:
                        item = next(items)
                    except (StopIteration, LoaderError) as exc:
                        error = exc
                        break
                    if item.barrier:
                        draining = True
                        break
                    if item.raw is not None or (item.sample is not None and prepare is not None):
                        chunk.append(item)
                        if len(chunk) == self.chunk:
                            submit()
                    else:  # a marker or a cached sample with nothing to do keeps its place in order
                        submit()
                        pending.append(([item], None))
                if error is not None or draining or not pending:
                    submit()
                if not pending:
                    if draining:  # everything before the barrier is consumed: the walk goes on
                        draining = False
                        continue
                    break
                batch, future = pending.popleft()
                if future is None:
                    yield batch[0], batch[0].sample, None
                    continue
                done, failed = future.result()
                for item, (sample, extra) in zip(batch, done, strict=False):
                    yield item, sample, extra.tensor() if isinstance(extra, _TensorData) else extra
                if failed is not None:
                    raise failed
            if error is not None and not isinstance(error, StopIteration):
                raise error
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # at most one running chunk per worker to wait for


@dataclass
class Batch:
    """A collated batch: images ``[B, C, H, W]``, token ids ``[B, L]``, keys, and the position after it."""

    images: torch.Tensor
    texts: torch.Tensor
    keys: list[str]
    position: StreamPosition


def pick_caption(sample: Sample, choice: Literal["first", "random"], seed: int, epoch: int) -> str:
    """The caption to train on: the ``.txt`` one, or one of ``captions`` fixed by hashing (seed, key, epoch),
    so that a resumed stream picks the same captions as an uninterrupted one."""
    if choice == "first":
        return sample.caption
    if choice != "random":
        raise ValueError(f"caption_choice must be 'first' or 'random', got {choice!r}")
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample.key}".encode(), digest_size=8).digest()
    return sample.captions[int.from_bytes(digest, "little") % len(sample.captions)]


class SeededTransform:
    """``transform(sample.image)`` with torch's generator seeded by (seed, epoch, key), whichever process
    prepares it; the caller's generator state is left as it was."""

    def __init__(self, transform: Callable[[Any], Any], seed: int) -> None:
        self.transform, self.seed = transform, seed

    def __call__(self, sample: Sample, epoch: int) -> Any:
        import torch

        digest = hashlib.blake2b(f"augment/{self.seed}/{epoch}/{sample.key}".encode(), digest_size=8).digest()
        generator = torch.default_generator  # what torchvision's random transforms draw from
        state = generator.get_state()
        generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        try:
            return self.transform(sample.image)
        finally:
            generator.set_state(state)


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

    ``image_transform`` maps a PIL image to a ``[C, H, W]`` tensor (:class:`SeededTransform`, in the stream's
    workers when it has any); ``tokenizer`` maps captions to a ``[B, L]`` tensor. Each batch's ``position``
    is the one right after its last sample, so a tail dropped by ``drop_last`` is replayed on resume.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows: list[tuple[Any, str, str]] = []  # (image, caption, key) of the batch being filled
    position = stream.position

    def collate() -> Batch:
        images, texts, keys = zip(*rows, strict=True)
        tokens = torch.as_tensor(tokenizer(list(texts)))  # a tensor comes back as it is
        return Batch(torch.stack([torch.as_tensor(i) for i in images]), tokens, list(keys), position)

    for sample, image in stream.prepared(SeededTransform(image_transform, seed)):
        rows.append((image, pick_caption(sample, caption_choice, seed, stream.position.epoch), sample.key))
        position = stream.position
        if len(rows) == batch_size:
            yield collate()
            rows = []
    if rows and not drop_last:
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
    urls: str | Sequence[str], background: Sequence[int] = WHITE, image_size: int | None = None
) -> CaptionedSet:
    """Every sample of ``urls`` (in spec order) in a :class:`CaptionedSet`, images decoded to ``image_size``
    on the short side (give the model input so the set holds no more); :class:`LoaderError` on a duplicate
    key."""
    out = CaptionedSet([], [], [], [])
    seen: dict[str, str] = {}
    stream = ShardStream(urls, shuffle_shards=False, background=background, image_size=image_size)
    for sample in stream:
        if sample.key in seen:
            raise LoaderError(f"key {sample.key!r} appears twice: in {seen[sample.key]} and {sample.shard}")
        seen[sample.key] = sample.shard
        out.keys.append(sample.key)
        out.images.append(sample.image)
        out.captions.append(sample.captions)
        out.metas.append(sample.meta)
    return out
