"""A robust reader of webdataset tar shards that groups members into samples as webdataset does.

``tarfile`` stops quietly at a cut-off header and webdataset raises on the first damaged byte; this reader
yields every member it could read, keeps odd members for the caller to quarantine, and reports damage in
:attr:`ShardReader.error`. Every read goes through :class:`_BoundedStream`, refused past the step's
allowance or the decompression cap, so memory stays bounded whatever the shard declares."""

from __future__ import annotations

import bz2
import gzip
import itertools
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from compat.data.importer import MAX_CAPTION_BYTES
from compat.data.shards import is_local, local_path

BLOCK = tarfile.BLOCKSIZE
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext


def split_member_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name as webdataset splits it, the extension lower-cased."""
    match = _KEY_EXT.match(name)
    if match is None:
        return name, ""
    return match.group(1), match.group(2).lower()


MiB = 1 << 20


@dataclass(frozen=True)
class MemberLimits:
    """Largest member read, by extension, from the tar header before any byte of it is read."""

    caption_bytes: int = MAX_CAPTION_BYTES  # the importer's bound too
    metadata_bytes: int = 1 * MiB
    image_bytes: int = 32 * MiB
    other_bytes: int = 32 * MiB
    max_expansion: float = 100.0  # decompressed / compressed bytes a compressed shard may reach
    expansion_floor_bytes: int = 64 * MiB  # below this much decompressed data the ratio is not checked
    header_bytes: int = 1 * MiB  # one member's headers, pax and GNU long-name ones included

    def decompressed_cap(self, compressed: int) -> float:
        """Most bytes a shard of ``compressed`` bytes may decompress to (infinite for a plain tar: 0)."""
        if not compressed:
            return float("inf")
        return max(self.expansion_floor_bytes, self.max_expansion * compressed)

    def for_ext(self, ext: str) -> int:
        if ext in ("jpg", "jpeg", "png", "webp"):
            return self.image_bytes
        return {"txt": self.caption_bytes, "json": self.metadata_bytes}.get(ext, self.other_bytes)


@dataclass(frozen=True)
class Member:
    """One tar member as read: its header, its bytes and whether the shard ended inside its data; an unread
    one has empty ``data`` and ``unread`` says why (``oversized``: the limit its declared size breaks)."""

    info: tarfile.TarInfo
    data: bytes
    truncated: bool = False
    oversized: int = 0
    unread: str = ""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def ext(self) -> str:
        return split_member_name(self.info.name)[1]


@dataclass
class SampleGroup:
    """Consecutive members sharing one key; ``index`` is the sample's position in its shard."""

    key: str
    index: int
    members: list[Member] = field(default_factory=list)


class ShardReader:
    """The samples of one tar shard (a path or fsspec URL); after iteration ``error`` says what stopped it."""

    def __init__(self, path: Path | str, name: str | None = None, limits: MemberLimits | None = None) -> None:
        self.url = os.fspath(path)
        self.path = (
            Path(path) if isinstance(path, Path) else Path(local_path(path)) if is_local(path) else None
        )
        self.name = name or self.url
        self.limits = limits or MemberLimits()
        self.error: str | None = None
        self.samples, self.members = 0, 0

    def __iter__(self) -> Iterator[SampleGroup]:
        self.error, self.samples, self.members = None, 0, 0
        for key, members in itertools.groupby(self._members(), lambda m: split_member_name(m.name)[0]):
            group = SampleGroup(key=key, index=self.samples, members=list(members))
            self.samples += 1
            yield group

    def _members(self) -> Iterator[Member]:
        try:
            raw, compressed = self._open()
        except (OSError, ValueError) as exc:
            self.error = f"cannot open: {getattr(exc, 'strerror', None) or exc}"
            return
        with raw:
            if compressed == 0:
                self.error = "not a tar archive: the file is empty (0 bytes)"
                return
            inner = _decompressed(raw)
            if inner is raw:
                compressed = 0
            stream = _BoundedStream(inner, self.limits.decompressed_cap(compressed), compressed)
            stream.allow(self.limits.header_bytes, _headers_of(1))
            try:
                tar = tarfile.open(fileobj=stream, mode="r:")
            except ShardRefused as exc:
                self.error = f"refused at offset 0: {exc}"
                return
            except _DAMAGE as exc:
                self.error = f"not a tar archive ({_first_line(exc)} at offset 0)"
                return
            while True:
                stream.allow(self.limits.header_bytes, _headers_of(self.members + 1))
                try:
                    info = tar.next()
                except (ShardRefused, *_DAMAGE) as exc:
                    self.error = _stopped(exc, f"after {self.members} members")
                    return
                tar.members.clear()  # tarfile keeps every header it read; a stream needs none
                if sum(len(k) + len(v) for k, v in tar.pax_headers.items()) > self.limits.header_bytes:
                    self.error = (
                        f"refused after {self.members} members: its global pax headers add up to over "
                        f"{self.limits.header_bytes} bytes; the rest of the shard is not read"
                    )
                    return
                if info is None:
                    break
                unread = self._unread(info, compressed)
                if unread:  # never read: yielded empty, quarantined
                    limit = self.limits.for_ext(split_member_name(info.name)[1])
                    self.members += 1
                    oversized = limit if info.isreg() and info.size > limit else 0
                    yield Member(info=info, data=b"", oversized=oversized, unread=unread)
                    if not oversized:  # past the decompression cap: nothing after it is read either
                        self.error = self._expansion_error(info.offset_data + info.size, compressed)
                        return
                    continue
                data, truncated, damage = b"", False, None
                if info.isreg() and info.size:
                    stream.allow(info.size, f"member {info.name!r}")
                    try:
                        stream.seek(info.offset_data)
                        data = stream.read(info.size)
                    except (ShardRefused, *_DAMAGE) as exc:  # a compressed shard cut inside a member
                        damage = f"damaged inside member {info.name!r}: {_first_line(exc)}"
                    truncated = len(data) < info.size
                self.members += 1
                yield Member(info=info, data=data, truncated=truncated)
                if damage:
                    self.error = damage
                    return
                if truncated:
                    self.error = (
                        f"truncated: member {info.name!r} has {len(data)} of {info.size} bytes "
                        f"(after {self.members} members)"
                    )
                    return
            stream.allow(BLOCK, "the end-of-archive marker")
            self.error = _check_end_marker(stream, tar.offset, self.members)

    def _open(self) -> tuple[BinaryIO, int]:
        """The shard opened for reading, and its size in bytes."""
        if self.path is not None:
            raw = self.path.open("rb")
            return raw, os.fstat(raw.fileno()).st_size
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(self.url)
        raw = fs.open(path, "rb")
        return raw, int(fs.size(path))

    def _unread(self, info: tarfile.TarInfo, compressed: int) -> str:
        """Why the member must not be read (its declared size and the limit it breaks), or ``""``."""
        ext = split_member_name(info.name)[1]
        limit = self.limits.for_ext(ext)
        if info.isreg() and info.size > limit:
            return f"declares {info.size} bytes, over the {limit}-byte limit for .{ext or '(none)'} members"
        end = info.offset_data + info.size
        if self._expansion_error(end, compressed):
            return (
                f"declares {info.size} bytes, ending at byte {end} of the decompressed shard, past its "
                f"{self.limits.decompressed_cap(compressed):.0f}-byte decompression cap "
                f"({self.limits.max_expansion:g}x its {compressed} bytes)"
            )
        return ""

    def _expansion_error(self, position: int, compressed: int) -> str | None:
        """Why reading on to ``position`` of a compressed shard would be a decompression bomb, or None."""
        if position <= self.limits.decompressed_cap(compressed):
            return None
        return (
            f"decompression bomb: reading on would expand its {compressed} bytes to over {position} bytes "
            f"(more than {self.limits.max_expansion:g}x); the rest of the shard is not read"
        )


class ShardRefused(Exception):
    """A read the limits forbid: a decompression bomb, or headers larger than ``header_bytes``."""


# What a damaged or hostile shard makes tarfile and the decompressors raise (a malformed GNU sparse map
# raises ValueError, a long chain of extended headers RecursionError).
_DAMAGE = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError, ValueError, RecursionError)


def _decompressed(raw):
    """``raw``, or a streaming decompressor over it chosen by magic bytes as tarfile's ``r:*`` would."""
    magic = raw.read(6)
    raw.seek(0)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)
    return raw


class _BoundedStream:
    """The shard's tar stream: reads take at most the allowance of the step in progress (:meth:`allow`) and
    none goes past ``cap``, the decompression cap; :class:`ShardRefused` before any byte of a refused read."""

    def __init__(self, inner, cap: float, compressed: int) -> None:
        self._inner, self._cap, self._compressed = inner, cap, compressed
        self._allowed, self._left, self._step = 0, 0, ""

    def allow(self, size: int, step: str) -> None:
        """Let the next reads take ``size`` bytes in all, for ``step`` (named in a refusal)."""
        self._allowed, self._left, self._step = size, size, step

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > self._left:
            wanted = "the rest of the shard" if size is None or size < 0 else f"{size} more bytes"
            raise ShardRefused(
                f"reading {self._step} needs {wanted}, over its {self._allowed}-byte limit; "
                "the rest of the shard is not read"
            )
        self._check_position(self._inner.tell() + size)
        data = self._inner.read(size)
        self._left -= len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence in (0, 1):
            self._check_position(offset if whence == 0 else self._inner.tell() + offset)
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def _check_position(self, position: int) -> None:
        if position > self._cap:
            raise ShardRefused(
                f"decompression bomb: reading {self._step} would expand the shard's {self._compressed} bytes "
                f"past the {self._cap:.0f}-byte decompression cap; the rest of the shard is not read"
            )


def _headers_of(member: int) -> str:
    return f"the headers of member {member} (pax and GNU long-name records included)"


def _check_end_marker(stream, offset: int, members: int) -> str | None:
    """``tarfile`` ends quietly at a cut-off header; a complete archive ends with a zero block."""
    try:
        stream.seek(offset)
        tail = stream.read(BLOCK)
    except (ShardRefused, *_DAMAGE) as exc:
        return _stopped(exc, "at the end of the archive")
    if len(tail) == BLOCK and not tail.strip(b"\0"):
        return None
    if not tail:
        return f"truncated: the archive ends after {members} members without an end-of-archive marker"
    if len(tail) < BLOCK:
        return f"truncated: a member header is cut off after {members} members"
    return f"damaged: an unreadable member header follows member {members} (offset {offset})"


def _stopped(exc: BaseException, where: str) -> str:
    """Why reading stopped ``where``: a read the limits refuse, or damage."""
    if isinstance(exc, ShardRefused):
        return f"refused {where}: {exc}"
    return f"damaged {where}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):  # tarfile recurses once per pax or GNU long-name header
        return "too long a chain of pax or GNU long-name headers"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
