"""Every read of an untrusted shard is bounded: member sizes are checked from the tar header before any
byte is read, a compressed shard that expands too far is refused, pax and GNU long-name headers are capped,
and the quarantine copy stays small."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

GiB = 1 << 30
MiB = 1 << 20


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, read in chunks (a 1 GiB member without 1 GiB in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - io protocol
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


@pytest.fixture(scope="module")
def good_members(tmp_path_factory) -> list[tuple[tarfile.TarInfo, bytes]]:
    """The members of a few valid samples of the synthetic stream."""
    from compat.data.synth import generate_stream

    out = tmp_path_factory.mktemp("bounded") / "stream"
    generate_stream(out, phases=1, samples_per_phase=8, seed=0, eval_per_domain=2, gallery_per_domain=2)
    shard = sorted((out / "phase-00" / "train").glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()[:9]]  # three whole samples


def _shard(path: Path, good, extra: list[tuple[str, int]], mode: str = "w") -> Path:
    """``good`` members, then members of zeros named with their declared sizes (gzip at level 9)."""
    with tarfile.open(path, mode, **({"compresslevel": 9} if mode.endswith("gz") else {})) as tar:
        for info, data in good:
            tar.addfile(info, io.BytesIO(data))
        for name, size in extra:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BufferedReader(_Zeros(size), buffer_size=MiB))
    return path


def _extended_header(kind: bytes, size: int) -> bytes:
    """The 512-byte header of a pax (``x``, ``g``) or GNU long-name (``L``, ``K``) record of ``size``."""
    info = tarfile.TarInfo("././@LongLink" if kind in (b"L", b"K") else "././@PaxHeader")
    info.type, info.size = kind, size
    return info.tobuf(tarfile.GNU_FORMAT if kind in (b"L", b"K") else tarfile.USTAR_FORMAT)


def _members(reader) -> list:
    return [m for group in reader for m in group.members]


# ---------------------------------------------------------------------------- per-member limits
def test_an_oversized_member_is_quarantined_unread(tmp_path, good_members):
    from components.data.validation import ValidationPolicy, validate_phase
    from components.data.validation.shard_reader import MemberLimits, ShardReader

    shard = _shard(
        tmp_path / "big.tar", good_members, [("big.txt", 200_000), ("big.jpg", 10), ("big.json", 2)]
    )
    big = next(
        m
        for m in _members(ShardReader(shard, limits=MemberLimits(caption_bytes=100_000)))
        if m.name == "big.txt"
    )
    assert big.oversized == 100_000 and big.data == b"" and "over the 100000-byte limit" in big.unread

    result = validate_phase([str(shard)], tmp_path / "out", ValidationPolicy(max_quarantined_fraction=1.0))
    doc = result.to_dict()
    reasons = json.dumps(doc)
    assert "member_too_large" in reasons
    assert "'big.txt' declares 200000 bytes, over the 65536-byte limit for .txt members" in reasons
    assert doc["passed"] == 3 and doc["quarantined"] == 1
    with tarfile.open(next((tmp_path / "out" / "quarantine").glob("*.tar"))) as tar:
        assert {m.name: m.size for m in tar.getmembers()}["big.txt"] == 0  # kept by name, not copied


def test_member_limits_come_from_the_policy():
    from pydantic import ValidationError

    from components.data.validation import ValidationPolicy

    limits = ValidationPolicy(max_caption_bytes=300_000, max_image_bytes=5, max_expansion=7).member_limits()
    assert (limits.for_ext("txt"), limits.for_ext("jpg"), limits.for_ext("json")) == (300_000, 5, MiB)
    assert limits.max_expansion == 7
    with pytest.raises(ValidationError, match="max_metadata_bytes"):
        ValidationPolicy(max_metadata_bytes=0)


def test_a_pax_size_record_does_not_outlive_the_unread_bytes(tmp_path, good_members):
    """A member whose size comes from a pax record is copied as 0 bytes without a stale ``size`` record."""
    from components.data.validation import ValidationPolicy, validate_phase

    path = tmp_path / "pax.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in good_members:
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("big.txt")
        info.size, info.pax_headers = 200_000, {"size": "200000"}
        tar.addfile(info, io.BufferedReader(_Zeros(200_000)))
    validate_phase([str(path)], tmp_path / "out", ValidationPolicy(max_quarantined_fraction=1.0))
    with tarfile.open(next((tmp_path / "out" / "quarantine").glob("*.tar"))) as tar:
        members = {m.name: m.size for m in tar.getmembers()}
        reason = json.load(tar.extractfile("big.reason.json"))
    assert members == {"big.txt": 0, "big.reason.json": members["big.reason.json"]}
    assert [r["code"] for r in reason["reasons"]][0] == "member_too_large"


# ---------------------------------------------------------------------------- headers tarfile reads whole
@pytest.mark.parametrize("kind", [b"L", b"K", b"x", b"g"])
def test_a_huge_extended_header_is_refused_before_it_is_read(tmp_path, good_members, kind):
    from components.data.validation import validate_phase
    from components.data.validation.shard_reader import ShardReader

    path = _shard(tmp_path / "ext.tar", good_members, [])
    body = path.read_bytes().rstrip(b"\0")
    body += bytes(-len(body) % 512)
    path.write_bytes(body + _extended_header(kind, GiB) + bytes(4096))  # declares 1 GiB, holds 4 KiB

    reader = ShardReader(path)
    assert len(_members(reader)) == len(good_members)
    assert reader.error.startswith(f"refused after {len(good_members)} members")
    assert "needs 1073741824 more bytes, over its 1048576-byte limit" in reader.error
    summary = validate_phase([str(path)], tmp_path / "out")
    assert summary.passed == 3 and summary.blocked and "refused" in summary.shards[0]["error"]


def test_a_chain_of_extended_headers_is_damage_not_a_crash(tmp_path):
    from components.data.validation.shard_reader import ShardReader

    record = b"20 comment=aaaaaaaa\n"
    link = _extended_header(b"x", len(record)) + record.ljust(512, b"\0")
    (tmp_path / "chain.tar").write_bytes(link * 2000 + bytes(1024))  # tarfile recurses once per header
    reader = ShardReader(tmp_path / "chain.tar")
    assert _members(reader) == [] and "too long a chain of pax" in reader.error


# ---------------------------------------------------------------------------- decompression
def test_a_compressed_shard_that_expands_too_far_is_refused(tmp_path, good_members):
    from components.data.validation.shard_reader import MemberLimits, ShardReader

    extra = [(f"z{i:02d}.bin", 40_000) for i in range(40)]  # each under the limit, together 1.6 MB of zeros
    shard = _shard(tmp_path / "z.tar.gz", good_members, extra, mode="w:gz")
    limits = MemberLimits(max_expansion=20.0, expansion_floor_bytes=100_000)
    reader = ShardReader(shard, limits=limits)
    members = _members(reader)
    assert "decompression bomb" in reader.error and "20x" in reader.error
    assert members[-1].data == b"" and "decompression cap" in members[-1].unread
    assert len(members) < len(good_members) + len(extra)  # the rest was not read
    assert MemberLimits().decompressed_cap(0) == float("inf")  # a plain tar has no ratio to break
    assert MemberLimits().decompressed_cap(MiB) == 100 * MiB


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_compressed_shards_are_streamed(tmp_path, good_members, mode):
    from components.data.validation.shard_reader import ShardReader

    reader = ShardReader(_shard(tmp_path / f"s.tar.{mode[2:]}", good_members, [], mode))
    assert [(m.name, m.data) for m in _members(reader)] == [(i.name, d) for i, d in good_members]
    assert reader.error is None


# ---------------------------------------------------------------------------- end to end
_PEAK = """import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print("peak_kb=%d" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(rc)
"""


def test_validate_on_one_megabyte_gzip_bombs_stays_under_a_gigabyte(tmp_path, good_members):
    """A 1 GiB caption, and a 1 GiB GNU long name, each in a ~1 MB .tar.gz: validation reads no byte of
    either, quarantines the caption's sample with a reason naming the limit, and writes a small quarantine."""
    shards = tmp_path / "in"
    shards.mkdir()
    caption = _shard(
        shards / "shard-0.tar.gz",
        good_members,
        [("bomb.txt", GiB), ("bomb.jpg", 10), ("bomb.json", 2)],
        "w:gz",
    )
    with gzip.open(shards / "shard-1.tar.gz", "wb", compresslevel=9) as out:
        out.write(_extended_header(b"L", GiB))
        zeros = bytes(MiB)
        for _ in range(GiB // MiB):
            out.write(zeros)
    assert max(caption.stat().st_size, (shards / "shard-1.tar.gz").stat().st_size) < 2 * MiB

    cli = Path(sys.executable).with_name("compatflow")
    command = [sys.executable, "-c", _PEAK, str(cli), "validate", "--shards", f"{shards}/*.tar.gz"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300
    )
    peak_kb = int(done.stderr.rsplit("peak_kb=", 1)[1].split()[0])
    assert peak_kb < 1_000_000, f"peak memory {peak_kb} KB"

    summary = json.loads((tmp_path / "o" / "validation.json").read_text())
    assert summary["quarantined"] == 1 and summary["passed"] == 3 and summary["blocked"]
    text = json.dumps(summary)
    assert "'bomb.txt' declares 1073741824 bytes, over the 65536-byte limit for .txt members" in text
    caption_shard, name_shard = summary["shards"]
    assert "decompression bomb" in caption_shard["error"]
    assert (
        name_shard["error"].startswith("refused at offset 0") and "1048576-byte limit" in name_shard["error"]
    )
    quarantine = sum(p.stat().st_size for p in (tmp_path / "o" / "quarantine").rglob("*") if p.is_file())
    assert quarantine < 5 * MiB


def test_training_reader_refuses_a_member_declaring_too_much(tmp_path, good_members) -> None:
    """The training loader reads validated shards, yet refuses a member declared over its cap unread."""
    from compat.data.shards import MAX_MEMBER_BYTES, ShardError, iter_raw_samples

    raw = b""
    for info, data in good_members:  # members written by hand: no end marker, so the header comes next
        raw += info.tobuf(format=tarfile.PAX_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)
    info = tarfile.TarInfo("huge.jpg")
    info.size = MAX_MEMBER_BYTES + 1
    path = tmp_path / "big.tar"
    path.write_bytes(raw + info.tobuf(format=tarfile.PAX_FORMAT))
    with pytest.raises(ShardError, match="huge.jpg.*declares"):
        list(iter_raw_samples(str(path)))
