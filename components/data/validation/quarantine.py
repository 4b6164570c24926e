"""Output shards of the validation step, written atomically with members unchanged: accepted samples in
``accepted/shard-NNNNN.tar``, rejected ones in ``quarantine/quarantine-NNNNN.tar`` with a
``{key}.reason.json`` (``NNNNN``: the input shard's index, so reruns write the same files). A quarantine
shard holds no more than the reader read, and no link an extraction would follow (kept empty, its kind
recorded in the reason file)."""

from __future__ import annotations

import copy
import io
import json
import tarfile
from pathlib import Path

from compat.io import replace_durably
from components.data.validation.checks import Reason
from components.data.validation.shard_reader import Member, SampleGroup

ACCEPTED_DIR = "accepted"
QUARANTINE_DIR = "quarantine"
REASON_SUFFIX = ".reason.json"
OUTPUT_PATTERNS = (
    "accepted/shard-*.tar",
    "quarantine/quarantine-*.tar",
    "accepted/*.tmp",
    "quarantine/*.tmp",
)


def accepted_name(shard_index: int) -> str:
    return f"{ACCEPTED_DIR}/shard-{shard_index:05d}.tar"


def quarantine_name(shard_index: int) -> str:
    return f"{QUARANTINE_DIR}/quarantine-{shard_index:05d}.tar"


class AtomicTarWriter:
    """A tar written to ``path + '.tmp'`` and renamed into place by :meth:`commit` (opened on first add)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._tar: tarfile.TarFile | None = None
        self.samples = 0

    def _open(self) -> tarfile.TarFile:
        if self._tar is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tar = tarfile.open(self._tmp, "w", format=tarfile.PAX_FORMAT)
        return self._tar

    def add_member(self, member: Member) -> None:
        """Copy a member as read: same name, header and bytes (a cut-off member keeps what was read; an
        unread one is kept as an empty member: the reasons file says what it declared)."""
        info = copy.copy(member.info)
        if info.isreg():
            info.size = len(member.data)
            # A pax ``size`` record would outrank info.size and declare bytes that are not copied.
            info.pax_headers = {k: v for k, v in info.pax_headers.items() if k != "size"}
            self._open().addfile(info, io.BytesIO(member.data))
        else:  # stored as metadata (the reasons file), never as a link
            kept = tarfile.TarInfo(info.name)
            kept.mtime, kept.mode = info.mtime, 0o644
            self._open().addfile(kept, io.BytesIO(b""))

    def add_bytes(self, name: str, data: bytes, mtime: float) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), mtime, 0o644
        self._open().addfile(info, io.BytesIO(data))

    def add_sample(self, group: SampleGroup) -> None:
        for member in group.members:
            self.add_member(member)
        self.samples += 1

    def commit(self) -> Path | None:
        """Close and move into place; returns the path, or None when nothing was added."""
        if self._tar is None:
            return None
        self._tar.close()
        replace_durably(self._tmp, self.path)
        self._tar = None
        return self.path

    def abort(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        self._tmp.unlink(missing_ok=True)


_TYPES = {
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char_device",
    tarfile.BLKTYPE: "block_device",
    tarfile.FIFOTYPE: "fifo",
    tarfile.DIRTYPE: "directory",
}


def _links(group: SampleGroup) -> dict[str, dict[str, str]]:
    """What each member that is not a regular file was, and its link target (kept as metadata only)."""
    return {
        m.name: {"type": _TYPES.get(m.info.type, repr(m.info.type)), "linkname": m.info.linkname}
        for m in group.members
        if not m.info.isreg()
    }


def quarantine_sample(writer: AtomicTarWriter, group: SampleGroup, shard: str, reasons: list[Reason]) -> None:
    """Write the sample's members unchanged, then ``{key}.reason.json`` (deterministic bytes and mtime)."""
    writer.add_sample(group)
    document = {
        "key": group.key,
        "source_shard": shard,
        "sample_index": group.index,
        "members": [m.name for m in group.members],
        "reasons": [r.to_dict() for r in reasons],
        **({"links": links} if (links := _links(group)) else {}),
    }
    mtime = max((m.info.mtime for m in group.members), default=0)
    data = json.dumps(document, indent=2, sort_keys=True).encode()
    writer.add_bytes(group.key + REASON_SUFFIX, data, mtime)


def remove_stale_outputs(out_dir: Path, keep: set[str]) -> list[str]:
    """Delete output shards (and temp files) of earlier runs that this run did not write."""
    removed = []
    for pattern in OUTPUT_PATTERNS:
        for path in sorted(out_dir.glob(pattern)):
            relative = path.relative_to(out_dir).as_posix()
            if relative not in keep:
                path.unlink()
                removed.append(relative)
    return removed
