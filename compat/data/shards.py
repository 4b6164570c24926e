"""Tar shards in img2dataset layout: deterministic atomic writing, and raw streaming reads.

:func:`iter_raw_samples` groups members by key itself (webdataset's ``tariterators`` in a few lines) because
importing webdataset imports torch (seconds for a one-shot search that reads a shard's captions).
"""

from __future__ import annotations

import io
import itertools
import os
import re
import stat
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse
from urllib.request import url2pathname

from compat.io import atomic_write

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # a sample's picture members: what makes its content


class ShardError(ValueError):
    """A shard cannot be opened or read; the message names the shard and, where known, the key."""


@dataclass
class RawSample:
    """One sample's undecoded members, by lower-case extension (``{"jpg": b"...", "json": b"..."}``)."""

    key: str
    members: dict[str, bytes]


def write_shard(path: str | os.PathLike[str], samples: Iterable[tuple[str, Mapping[str, bytes]]]) -> int:
    """Write ``(key, {ext: bytes})`` samples to the tar shard ``path`` atomically, the same bytes for the same
    samples; return the sample count."""
    path = Path(path)
    count = 0

    def write(tmp: Path) -> None:
        nonlocal count
        with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, members in samples:
                if "/" in key or "." in key:
                    raise ShardError(f"{path}: sample key {key!r} must not contain '/' or '.'")
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")  # mtime 0, mode 0o644, uid/gid 0, no owner names
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                count += 1

    atomic_write(path, write)
    return count


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return urlparse(url).scheme in ("", "file")


def local_path(url: str) -> str:
    """The filesystem path of a plain path or ``file://`` URL."""
    parsed = urlparse(url)
    return url2pathname(parsed.path) if parsed.scheme == "file" else url


def refuse_pipe(url: str) -> None:
    """Raise :class:`ShardError` for a ``pipe:`` URL: it would run a shell command."""
    if url.startswith("pipe:"):
        raise ShardError(
            f"{url}: pipe: URLs run shell commands and are not accepted; use a path or fsspec URL"
        )


def open_url(url: str) -> BinaryIO:
    """Open a shard for streaming reads: local paths directly, other URLs through fsspec (not ``pipe:``)."""
    refuse_pipe(url)
    try:
        if is_local(url):
            return open(local_path(url), "rb")  # noqa: SIM115 -- closed by the reader
        import fsspec

        return fsspec.open(url, "rb").open()
    except (OSError, ValueError, ImportError) as exc:
        raise ShardError(f"cannot open shard {url}: {exc}") from exc


def stat_url(url: str) -> tuple[int, int | str]:
    """The size of the shard at ``url`` and a token that changes with it (a local file's mtime in ns, else
    fsspec's ``ukey``); raises :class:`ShardError` when it is missing or not a file."""
    refuse_pipe(url)
    try:
        if is_local(url):
            st = os.stat(local_path(url))
            if not stat.S_ISREG(st.st_mode):
                raise ShardError(f"{url} is not a file (a shard is one tar file)")
            return st.st_size, st.st_mtime_ns
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(url)
        info = fs.info(path)
        if info.get("type") != "file":
            raise ShardError(f"{url} is a {info.get('type')}, not a file (a shard is one tar file)")
        return int(info["size"]), str(fs.ukey(path))
    except ShardError:
        raise
    except FileNotFoundError as exc:
        raise ShardError(f"{url}: no such shard file") from exc
    except (OSError, ValueError, ImportError) as exc:
        raise ShardError(f"cannot read shard {url}: {exc}") from exc


MAX_MEMBER_BYTES = 256 * 1024 * 1024  # the most one member may declare before it is read
_STEM_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def base_plus_ext(name: str) -> tuple[str | None, str | None]:
    """A member name's key and its extensions (``a/b.seg.jpg`` -> ``a/b``, ``seg.jpg``); ``(None, None)``
    for a name without one (webdataset's ``base_plus_ext``)."""
    match = _STEM_AND_EXT.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


def _tar_members(fileobj: BinaryIO, skip: int, state: dict[str, Any]) -> Iterator[tuple[str, str, bytes]]:
    """``(key, lower-case extension, bytes)`` of the tar stream's regular members, those of the first ``skip``
    samples passed over unread; ``state["member"]`` names the last member read. The archive must end with its
    end-of-archive marker (tarfile stops silently at a truncated header)."""
    tar = tarfile.open(fileobj=fileobj, mode="r|*")
    seen, last = 0, None
    for info in tar:
        name = info.name
        if not info.isreg() or (name.startswith("__") and name.endswith("__")):
            continue
        prefix, suffix = base_plus_ext(name)
        state["member"] = name
        if prefix is None or suffix is None:
            continue
        if prefix != last:
            last, seen = prefix, seen + 1
        if seen <= skip:
            continue
        if info.size > MAX_MEMBER_BYTES:  # validated shards never hold one; refuse before reading it
            raise ValueError(f"member {name!r} declares {info.size} bytes, over {MAX_MEMBER_BYTES}")
        yield prefix, suffix.lower(), tar.extractfile(info).read()
        tar.members = []
    if tar.fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
        raise tarfile.ReadError("the archive ends without its end-of-archive marker (truncated or corrupt)")


def iter_raw_samples(url: str, skip: int = 0) -> Iterator[RawSample]:
    """The samples of shard ``url`` undecoded (consecutive members of one key, as webdataset groups them),
    after its first ``skip``; raises :class:`ShardError` naming the shard and the last member read when the
    archive is unreadable, truncated or repeats a member."""
    stream = open_url(url)
    state: dict[str, Any] = {"member": None}
    try:
        records = itertools.groupby(_tar_members(stream, skip, state), key=lambda record: record[0])
        for key, members in records:
            sample: dict[str, bytes] = {}
            for _, ext, data in members:
                if ext in sample:
                    raise ValueError(f"{state['member']}: duplicate file name in tar file {ext}")
                sample[ext] = data
            yield RawSample(key, sample)
    except (tarfile.TarError, OSError, ValueError, EOFError) as exc:
        where = f"at or after member {state['member']!r}" if state["member"] else "before its first member"
        detail = exc.args[0] if exc.args else type(exc).__name__
        raise ShardError(f"shard {url} is malformed ({where}): {detail}") from exc
    finally:
        stream.close()


def sample_keys(url: str) -> set[str]:
    """The sample keys of shard ``url`` (reads headers only, decodes nothing)."""
    try:
        with open_url(url) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            return {base_plus_ext(info.name)[0] for info in tar if info.isreg()} - {None}
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ShardError(f"shard {url} is malformed: {exc}") from exc
