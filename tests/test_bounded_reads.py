"""Every read of an untrusted shard is bounded: member sizes are checked from the tar header before any
byte is read, a compressed shard that expands too far is refused, and the quarantine copy stays small."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

GiB = 1 << 30


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
            tar.addfile(info, io.BufferedReader(_Zeros(size), buffer_size=1 << 20))
    return path


def test_an_oversized_member_is_quarantined_unread(tmp_path, good_members):
    from components.validation import ValidationPolicy, validate_phase
    from components.validation.shard_reader import MemberLimits, ShardReader

    shard = _shard(
        tmp_path / "big.tar", good_members, [("big.txt", 200_000), ("big.jpg", 10), ("big.json", 2)]
    )
    members = [
        m for group in ShardReader(shard, limits=MemberLimits(caption_bytes=100_000)) for m in group.members
    ]
    big = next(m for m in members if m.name == "big.txt")
    assert big.oversized == 100_000 and big.data == b""

    result = validate_phase([str(shard)], tmp_path / "out", ValidationPolicy(max_quarantined_fraction=1.0))
    doc = result.to_dict()
    reasons = json.dumps(doc)
    assert "member_too_large" in reasons and "'big.txt' declares 200000 bytes" in reasons
    assert doc["passed"] == 3 and doc["quarantined"] == 1
    with tarfile.open(next((tmp_path / "out" / "quarantine").glob("*.tar"))) as tar:
        assert {m.name: m.size for m in tar.getmembers()}["big.txt"] == 0  # kept by name, not copied


def test_a_compressed_shard_that_expands_too_far_is_refused(tmp_path, good_members):
    from components.validation.shard_reader import MemberLimits, ShardReader

    extra = [(f"z{i:02d}.bin", 40_000) for i in range(40)]  # each under the limit, together 1.6 MB of zeros
    shard = _shard(tmp_path / "z.tar.gz", good_members, extra, mode="w:gz")
    limits = MemberLimits(max_expansion=20.0, expansion_floor_bytes=100_000)
    reader = ShardReader(shard, limits=limits)
    members = [m for group in reader for m in group.members]
    assert "decompression bomb" in reader.error and members[-1].oversized
    assert len(members) < len(good_members) + len(extra)  # the rest was not read


@pytest.mark.slow
def test_validate_on_a_one_megabyte_gzip_bomb_stays_under_a_gigabyte(tmp_path, good_members):
    """A 1 GiB caption in a ~1 MB .tar.gz: validation reads no byte of it, quarantines the sample."""
    shard = _shard(
        tmp_path / "bomb.tar.gz",
        good_members,
        [("bomb.txt", GiB), ("bomb.jpg", 10), ("bomb.json", 2)],
        "w:gz",
    )
    assert shard.stat().st_size < 2 << 20
    cli = Path(sys.executable).with_name("compatflow")
    done = subprocess.run(
        [
            "/usr/bin/time",
            "-f",
            "peak_kb=%M",
            str(cli),
            "validate",
            "--shards",
            str(shard),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    peak_kb = int(done.stderr.rsplit("peak_kb=", 1)[1].split()[0])
    assert peak_kb < 1_000_000, f"peak memory {peak_kb} KB"
    summary = json.loads((tmp_path / "o" / "validation.json").read_text())
    assert "member_too_large" in json.dumps(summary) and summary["quarantined"] == 1
    quarantine = sum(p.stat().st_size for p in (tmp_path / "o" / "quarantine").rglob("*") if p.is_file())
    assert quarantine < 5 << 20
