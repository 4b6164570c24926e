"""A robust reader of webdataset tar shards that groups members into samples.

Unlike ``tarfile`` iteration (which silently stops at a cut-off header) and webdataset
(which raises on the first damaged byte or drops members it cannot key), this reader:

* yields every member it could read, grouped into samples the way webdataset groups them
  (consecutive members sharing the key before the first ``.`` of the base name);
* keeps members that have no extension, are links or devices, or carry unsafe names, so the
  caller can quarantine them instead of losing them;
* reports damage (not a tar, truncated header or data, missing end-of-archive marker) in
  :attr:`ShardReader.error` after iteration, while the samples read before it still count;
* reads no member whose header declares more bytes than :class:`MemberLimits` allows for its extension
  (it is yielded empty, ``oversized``, for the caller to quarantine), and stops a compressed shard that
  expands beyond ``max_expansion`` times its size (a decompression bomb): memory stays bounded by the limits.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = tarfile.BLOCKSIZE
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext


def split_member_name(name: str) -> tuple[str, str]:
    """Split a member name into ``(key, extension)`` as webdataset does; a name without one keeps ext ``""``.

    The extension is lower-cased (webdataset matches extensions case-insensitively).
    """
    match = _KEY_EXT.match(name)
    if match is None:
        return name, ""
    return match.group(1), match.group(2).lower()


MiB = 1 << 20


@dataclass(frozen=True)
class MemberLimits:
    """Largest member read, by extension, from the tar header before any byte of it is read."""

    caption_bytes: int = 64 * 1024
    metadata_bytes: int = 1 * MiB
    image_bytes: int = 32 * MiB
    other_bytes: int = 32 * MiB
    max_expansion: float = 100.0  # decompressed / compressed bytes a compressed shard may reach
    expansion_floor_bytes: int = 64 * MiB  # below this much decompressed data the ratio is not checked

    def for_ext(self, ext: str) -> int:
        if ext == "txt":
            return self.caption_bytes
        if ext == "json":
            return self.metadata_bytes
        if ext in ("jpg", "jpeg", "png", "webp"):
            return self.image_bytes
        return self.other_bytes


@dataclass(frozen=True)
class Member:
    """One tar member as read: its header, its bytes, whether the shard ended inside its data, and
    whether it was left unread because its header declares more than the limit (``oversized``: the
    limit in bytes, else 0)."""

    info: tarfile.TarInfo
    data: bytes
    truncated: bool = False
    oversized: int = 0

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def ext(self) -> str:
        return split_member_name(self.info.name)[1]

    @property
    def is_file(self) -> bool:
        return self.info.isreg()


@dataclass
class SampleGroup:
    """Consecutive members sharing one key; ``index`` is the sample's position in its shard."""

    key: str
    index: int
    members: list[Member] = field(default_factory=list)


class ShardReader:
    """Iterate the samples of one tar shard; after iteration ``error`` says what stopped it early.

    ``name`` is how messages refer to the shard (the path as the glob matched it).
    """

    def __init__(self, path: Path | str, name: str | None = None, limits: MemberLimits | None = None) -> None:
        self.path = Path(path)
        self.name = name or str(path)
        self.limits = limits or MemberLimits()
        self.error: str | None = None
        self.samples = 0
        self.members = 0

    def __iter__(self) -> Iterator[SampleGroup]:
        self.error, self.samples, self.members = None, 0, 0
        current: SampleGroup | None = None
        for member in self._members():
            key, _ = split_member_name(member.name)
            if current is None or key != current.key:
                if current is not None:
                    yield current
                current = SampleGroup(key=key, index=self.samples)
                self.samples += 1
            current.members.append(member)
        if current is not None:
            yield current

    def _members(self) -> Iterator[Member]:
        try:
            raw = self.path.open("rb")
        except OSError as exc:
            self.error = f"cannot open: {exc.strerror or exc}"
            return
        with raw:
            if self.path.stat().st_size == 0:
                self.error = "not a tar archive: the file is empty (0 bytes)"
                return
            try:
                tar = tarfile.open(fileobj=raw, mode="r:*")
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                self.error = f"not a tar archive ({_open_error(exc)} at offset 0)"
                return
            stream = tar.fileobj
            compressed = self.path.stat().st_size if tar.fileobj is not raw else 0
            while True:
                try:
                    info = tar.next()
                except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                    self.error = f"damaged after {self.members} members: {_first_line(exc)}"
                    return
                if info is None:
                    break
                limit = self.limits.for_ext(split_member_name(info.name)[1])
                bomb = self._expansion_error(info.offset_data + info.size, compressed)
                if bomb or (info.isreg() and info.size > limit):  # never read: yielded empty, quarantined
                    self.members += 1
                    yield Member(info=info, data=b"", oversized=limit if info.size > limit else info.size)
                    if bomb:
                        self.error = bomb
                        return
                    continue
                data, truncated, damage = b"", False, None
                if info.isreg() and info.size:
                    try:
                        stream.seek(info.offset_data)
                        data = stream.read(info.size)
                    except (EOFError, OSError, zlib.error) as exc:  # a compressed shard cut inside a member
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
            self.error = _check_end_marker(stream, tar.offset, self.members)

    def _expansion_error(self, position: int, compressed: int) -> str | None:
        """Why reading on to ``position`` of a compressed shard would be a decompression bomb, or None."""
        if not compressed or position < self.limits.expansion_floor_bytes:
            return None
        if position <= self.limits.max_expansion * compressed:
            return None
        return (
            f"decompression bomb: reading on would expand its {compressed} bytes to over {position} bytes "
            f"(more than {self.limits.max_expansion:g}x); the rest of the shard is not read"
        )


def _check_end_marker(stream, offset: int, members: int) -> str | None:
    """``tarfile`` ends quietly at a cut-off header; a complete archive ends with a zero block."""
    try:
        stream.seek(offset)
        tail = stream.read(BLOCK)
    except (EOFError, OSError, zlib.error) as exc:
        return f"damaged at the end of the archive: {_first_line(exc)}"
    if len(tail) == BLOCK and not tail.strip(b"\0"):
        return None
    if not tail:
        return f"truncated: the archive ends after {members} members without an end-of-archive marker"
    if len(tail) < BLOCK:
        return f"truncated: a member header is cut off after {members} members"
    return f"damaged: an unreadable member header follows member {members} (offset {offset})"


def _open_error(exc: BaseException) -> str:
    """``tarfile.open(mode='r:*')`` lists one failure per method; the plain-tar one says most."""
    lines = [line.strip() for line in str(exc).splitlines()]
    for line in lines:
        if line.startswith("- method tar:"):
            detail = line.removeprefix("- method tar:").strip()
            match = re.fullmatch(r"\w+\((['\"])(.*)\1\)", detail)
            return match.group(2) if match else detail
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
