"""The data-validation stage on real tar shards (built here with tarfile) and real Great Expectations.

Every bad-input case checks: the right reason code, a message naming shard and key, the invariant
passed + quarantined == total, a schema-valid validation.json, and that nothing is lost (the
quarantined members are byte-for-byte the input members, the accepted ones too).
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import pytest

from components.data.validation import (
    REASONS,
    ShardReader,
    ShardSpecError,
    ValidationPolicy,
    load_validation_policy,
    split_member_name,
    validate_phase,
)
from schemas import SchemaError, load_schema, schema_errors

GOOD = 40  # good samples per test shard: one bad sample stays under the 5 % threshold


# ---------------------------------------------------------------------------- shard building
def image_bytes(width: int = 32, height: int = 32, fmt: str = "JPEG", seed: int = 0) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (seed * 37 % 256, 90, 200)).save(buffer, fmt)
    return buffer.getvalue()


def sample(
    key: str,
    caption: bytes | str = "a red circle above a blue square",
    image: bytes | None = None,
    metadata: bytes | dict | None = None,
    ext: str = "jpg",
) -> list[tuple[str, bytes]]:
    caption = caption.encode() if isinstance(caption, str) else caption
    metadata = (
        metadata if metadata is not None else {"key": key, "width": 32, "height": 32, "status": "success"}
    )
    metadata = json.dumps(metadata).encode() if isinstance(metadata, dict) else metadata
    return [
        (f"{key}.{ext}", image if image is not None else image_bytes(seed=len(key))),
        (f"{key}.txt", caption),
        (f"{key}.json", metadata),
    ]


def good_samples(prefix: str, count: int = GOOD) -> list[tuple[str, bytes]]:
    return [m for i in range(count) for m in sample(f"{prefix}-{i:06d}")]


def write_shard(path: Path, members: list) -> Path:
    """Members are (name, bytes) pairs, or TarInfo objects for links and devices."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read() if m.isreg() else b"") for m in tar]


# ---------------------------------------------------------------------------- invariants
def check_invariants(summary, inputs: dict[str, list[tuple[str, bytes]]] | None = None) -> dict:
    """Invariants of every run; returns the validation.json document."""
    doc = json.loads(summary.path.read_text())
    assert schema_errors(doc, "validation") == []
    assert doc["passed"] + doc["quarantined"] == doc["total"]
    assert summary.passed + summary.quarantined == summary.total
    assert sum(s["samples"] for s in doc["shards"]) == doc["total"]
    assert sum(s["passed"] for s in doc["shards"]) == doc["passed"]
    assert doc["blocked"] == bool(doc["blocked_reasons"])
    assert not list(summary.out_dir.rglob("*.tmp"))
    accepted = [m for p in summary.accepted_paths for m in tar_members(p)]
    quarantined = [m for p in summary.quarantine_paths for m in tar_members(p)]
    reason_members = [m for m in quarantined if m[0].endswith(".reason.json")]
    assert len(reason_members) == doc["quarantined"]
    assert len({split_member_name(n)[0] for n, _ in accepted}) <= doc["passed"]
    if inputs is not None:  # nothing lost: every input member is in exactly one output, bytes unchanged
        written = sorted(accepted + [m for m in quarantined if not m[0].endswith(".reason.json")])
        expected = sorted(
            m for members in inputs.values() for m in members if not isinstance(m, tarfile.TarInfo)
        )
        links = [m for members in inputs.values() for m in members if isinstance(m, tarfile.TarInfo)]
        assert written == sorted(expected + [(info.name, b"") for info in links])
    return doc


def quarantine_record(summary, key: str) -> tuple[dict, list[tuple[str, bytes]]]:
    """The reason.json document of ``key`` and the quarantined members of that sample."""
    for path in summary.quarantine_paths:
        members = tar_members(path)
        for name, data in members:
            if name == f"{key}.reason.json":
                record = json.loads(data)
                return record, [m for m in members if m[0] in record["members"]]
    raise AssertionError(f"{key} is not in any quarantine shard")


def run(tmp_path: Path, shards: dict[str, list], policy: ValidationPolicy | None = None, **kwargs):
    for name, members in shards.items():
        write_shard(tmp_path / "in" / name, members)
    return validate_phase(str(tmp_path / "in" / "*.tar"), tmp_path / "out", policy, **kwargs)


def assert_rejected(tmp_path, summary, inputs, key, code, shard="shard-00000.tar", phrase=""):
    """``key`` is quarantined with ``code`` and named in a message; its members are kept unchanged."""
    doc = check_invariants(summary, inputs)
    record, members = quarantine_record(summary, key)
    assert code in [r["code"] for r in record["reasons"]], record
    assert record["source_shard"].endswith(shard)
    source = [
        m for m in inputs[shard] if not isinstance(m, tarfile.TarInfo) and split_member_name(m[0])[0] == key
    ]
    assert sorted(members) == sorted(source)  # byte-for-byte, same names
    messages = [p["message"] for p in doc["problems"] if p["key"] == key and p["reason"] == code]
    assert messages and messages[0].startswith(f"{tmp_path / 'in' / shard}: key {key}: ")
    assert phrase in messages[0]
    assert doc["by_reason"][code] >= 1
    return doc


# ---------------------------------------------------------------------------- good phase
def test_good_phase_passes_and_accepted_shards_read_with_webdataset(tmp_path):
    import webdataset as wds

    inputs = {
        "shard-00000.tar": good_samples("p01-train", 12),
        "shard-00001.tar": good_samples("p01-eval", 8),
    }
    summary = run(tmp_path, inputs)
    doc = check_invariants(summary, inputs)
    assert (doc["total"], doc["passed"], doc["quarantined"], doc["blocked"]) == (20, 20, 0, False)
    assert doc["accepted_shards"] == ["accepted/shard-00000.tar", "accepted/shard-00001.tar"]
    assert doc["quarantine_shards"] == [] and doc["by_reason"] == {}
    assert all(r["success"] for r in doc["expectations"]), doc["expectations"]
    assert {r["suite"] for r in doc["expectations"]} == {"samples", "phase"}
    loaded = list(wds.WebDataset([str(p) for p in summary.accepted_paths], shardshuffle=False))
    assert [s["__key__"] for s in loaded] == [f"p01-train-{i:06d}" for i in range(12)] + [
        f"p01-eval-{i:06d}" for i in range(8)
    ]
    assert loaded[0]["jpg"] == inputs["shard-00000.tar"][0][1]


def test_gx_records_observed_values_and_quantiles_known_answer(tmp_path):
    captions = ["x" * n for n in (10, 20, 30, 40, 50)]
    inputs = {"shard-00000.tar": [m for i, c in enumerate(captions) for m in sample(f"k{i}", caption=c)]}
    summary = run(tmp_path, inputs)
    records = {r["type"]: r for r in summary.expectations if r["suite"] == "phase"}
    assert records["expect_table_row_count_to_be_between"]["observed_value"] == 5
    assert records["expect_column_mean_to_be_between"]["observed_value"] == pytest.approx(30.0)
    quantiles = records["expect_column_quantile_values_in_ranges"]
    assert quantiles["observed_value"] == {"quantiles": [0.05, 0.5, 0.95], "values": [10, 30, 50]}
    assert quantiles["success"] is True and not summary.blocked


def test_phase_expectation_failure_blocks(tmp_path):
    policy = ValidationPolicy(
        caption_chars_quantile_ranges={"quantiles": [0.5], "value_ranges": [[100, None]]}, min_samples=50
    )
    summary = run(tmp_path, {"shard-00000.tar": good_samples("p", 10)}, policy)
    check_invariants(summary)
    assert summary.blocked and summary.quarantined == 0
    text = "\n".join(summary.blocked_reasons)
    assert "expect_table_row_count_to_be_between" in text and "observed 10" in text
    assert "expect_column_quantile_values_in_ranges(caption_chars)" in text


# ---------------------------------------------------------------------------- bad shards
def test_truncated_tar_keeps_samples_read_before_the_damage(tmp_path):
    members = good_samples("p", 10)
    full = write_shard(tmp_path / "full.tar", members).read_bytes()
    with tarfile.open(tmp_path / "full.tar") as tar:
        cut_member = [m for m in tar if m.name == "p-000006.jpg"][0]
    cut = cut_member.offset_data + 100  # inside the image data of the 7th sample
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "shard-00000.tar").write_bytes(full[:cut])
    summary = validate_phase(str(tmp_path / "in" / "*.tar"), tmp_path / "out")
    doc = check_invariants(summary)
    shard = doc["shards"][0]
    assert shard["samples"] == 7 and shard["passed"] == 6 and shard["quarantined"] == 1
    assert "truncated" in shard["error"] and "p-000006.jpg" in shard["error"]
    assert summary.blocked and any(
        "shard-00000.tar" in r and "not fully readable" in r for r in doc["blocked_reasons"]
    )
    record, kept = quarantine_record(summary, "p-000006")
    assert [r["code"] for r in record["reasons"]] == ["truncated", "caption_missing", "metadata_missing"]
    original = dict(members)["p-000006.jpg"]
    assert kept == [("p-000006.jpg", original[: len(kept[0][1])])] and len(kept[0][1]) == 100
    assert [m for p in summary.accepted_paths for m in tar_members(p)] == members[:18]


def test_tar_cut_at_a_member_boundary_is_detected(tmp_path):
    members = good_samples("p", 4)
    full = write_shard(tmp_path / "full.tar", members).read_bytes()
    with tarfile.open(tmp_path / "full.tar") as tar:
        boundary = [m for m in tar if m.name == "p-000002.jpg"][0].offset  # tarfile alone ends here quietly
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "shard-00000.tar").write_bytes(full[:boundary])
    summary = validate_phase(str(tmp_path / "in" / "*.tar"), tmp_path / "out")
    doc = check_invariants(summary)
    assert doc["shards"][0]["samples"] == 2 and doc["passed"] == 2
    assert "end-of-archive marker" in doc["shards"][0]["error"] and summary.blocked


def test_shard_that_is_not_a_tar(tmp_path):
    inputs = {"shard-00000.tar": good_samples("p", 10)}
    for name, members in inputs.items():
        write_shard(tmp_path / "in" / name, members)
    (tmp_path / "in" / "shard-00001.tar").write_bytes(b"<html>not found</html>\n" * 40)
    (tmp_path / "in" / "shard-00002.tar").write_bytes(b"")
    summary = validate_phase(str(tmp_path / "in" / "shard-*.tar"), tmp_path / "out")
    doc = check_invariants(summary, inputs)
    errors = {Path(s["name"]).name: s["error"] for s in doc["shards"]}
    assert errors["shard-00000.tar"] is None
    assert errors["shard-00001.tar"].startswith("not a tar archive")
    assert errors["shard-00002.tar"].startswith("not a tar archive") and "empty" in errors["shard-00002.tar"]
    assert doc["total"] == doc["passed"] == 10 and summary.blocked
    assert sum("shard-00001.tar" in r for r in doc["blocked_reasons"]) == 1


def test_compressed_shards_are_read_and_their_damage_detected(tmp_path):
    import gzip

    members = good_samples("p", 6)
    plain = write_shard(tmp_path / "plain.tar", members).read_bytes()
    packed = gzip.compress(plain, mtime=0)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "shard-00000.tar.gz").write_bytes(packed)
    other = gzip.compress(write_shard(tmp_path / "other.tar", good_samples("q", 6)).read_bytes(), mtime=0)
    (tmp_path / "in" / "shard-00001.tar.gz").write_bytes(other[: len(other) * 9 // 10])
    summary = validate_phase(str(tmp_path / "in" / "*.tar.gz"), tmp_path / "out")
    doc = check_invariants(summary)
    whole, cut = doc["shards"]
    assert whole["error"] is None and whole["passed"] == 6
    assert "Compressed file ended" in cut["error"] and 0 < cut["samples"] < 6 and summary.blocked
    assert [m for m in tar_members(summary.accepted_paths[0])] == members


# ---------------------------------------------------------------------------- bad samples
def test_key_missing_its_caption(tmp_path):
    inputs = {
        "shard-00000.tar": good_samples("p") + [m for m in sample("p-lonely") if not m[0].endswith(".txt")]
    }
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-lonely", "caption_missing", phrase="no caption member")
    assert summary.by_reason == {"caption_missing": 1} and not summary.blocked


def test_key_missing_its_image(tmp_path):
    inputs = {
        "shard-00000.tar": good_samples("p") + [m for m in sample("p-noimg") if not m[0].endswith(".jpg")]
    }
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-noimg", "image_missing")
    assert summary.by_reason == {"image_missing": 1}


def test_undecodable_image(tmp_path):
    truncated_jpeg = image_bytes(64, 64)[:200]
    inputs = {
        "shard-00000.tar": good_samples("p")
        + sample("p-garbage", image=b"\x89PNG not really" * 20)
        + sample("p-cut", image=truncated_jpeg)
    }
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-garbage", "image_undecodable", phrase="cannot be decoded")
    assert_rejected(tmp_path, summary, inputs, "p-cut", "image_undecodable")
    assert summary.quarantined == 2


def test_zero_byte_image(tmp_path):
    inputs = {"shard-00000.tar": good_samples("p") + sample("p-empty", image=b"")}
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-empty", "image_empty", phrase="empty (0 bytes)")


def test_image_outside_size_bounds(tmp_path):
    inputs = {
        "shard-00000.tar": good_samples("p") + sample("p-tiny", image=image_bytes(8, 40, "PNG"), ext="png")
    }
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-tiny", "image_size", phrase="image is 8x40 pixels")


@pytest.mark.parametrize(
    ("caption", "code", "phrase"),
    [
        (b"", "caption_empty", "caption is empty"),
        (b" \t\n  ", "caption_blank", "caption is blank"),
        ("y" * 10_000, "caption_length", "caption has 10000 characters; allowed 1..1000"),
        (b"caf\xe9 au lait", "caption_not_utf8", "not valid UTF-8"),
    ],
    ids=["empty", "whitespace", "10k-chars", "non-utf8"],
)
def test_bad_captions(tmp_path, caption, code, phrase):
    inputs = {"shard-00000.tar": good_samples("p") + sample("p-bad", caption=caption)}
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-bad", code, phrase=phrase)
    assert list(summary.by_reason) == [code]


def test_duplicate_keys_within_a_shard(tmp_path):
    dup = sample("p-000003", caption="another caption for the same key")
    inputs = {"shard-00000.tar": good_samples("p", 10) + dup + good_samples("q", 30)}
    summary = run(tmp_path, inputs, ValidationPolicy(max_quarantined_fraction=0.1))
    doc = check_invariants(summary, inputs)
    with tarfile.open(summary.quarantine_paths[0]) as tar:
        reasons = [json.load(tar.extractfile(m)) for m in tar if m.name.endswith(".reason.json")]
    assert [(r["key"], r["sample_index"]) for r in reasons] == [("p-000003", 3), ("p-000003", 10)]
    assert all(r["reasons"][0]["code"] == "duplicate_key" for r in reasons)
    assert "occurs 2 times" in reasons[0]["reasons"][0]["message"]
    assert [
        m for p in summary.quarantine_paths for m in tar_members(p) if not m[0].endswith("reason.json")
    ] == sample("p-000003") + dup
    assert doc["by_reason"] == {"duplicate_key": 2}


def test_duplicate_keys_across_shards(tmp_path):
    inputs = {"shard-00000.tar": good_samples("p"), "shard-00001.tar": good_samples("q") + sample("p-000007")}
    summary = run(tmp_path, inputs)
    doc = check_invariants(summary, inputs)
    first, _ = quarantine_record(summary, "p-000007")
    assert first["reasons"][0]["code"] == "duplicate_key"
    message = first["reasons"][0]["message"]
    assert "shard-00000.tar#7" in message and "shard-00001.tar#40" in message
    assert [s["quarantined"] for s in doc["shards"]] == [1, 1]
    assert doc["quarantine_shards"] == ["quarantine/quarantine-00000.tar", "quarantine/quarantine-00001.tar"]


def test_path_traversal_and_link_members(tmp_path):
    link = tarfile.TarInfo("p-link.jpg")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    bad = [
        ("../evil.jpg", image_bytes()),
        ("../evil.txt", b"a caption"),
        ("/abs.txt", b"absolute"),
        link,
        ("p-link.txt", b"a linked image"),
        ("p-link.json", json.dumps({"key": "p-link"}).encode()),
    ]
    inputs = {"shard-00000.tar": good_samples("p") + bad}
    summary = run(tmp_path, inputs, ValidationPolicy(max_quarantined_fraction=0.1))
    doc = assert_rejected(tmp_path, summary, inputs, "../evil", "unsafe_member", phrase="'..' path component")
    assert_rejected(tmp_path, summary, inputs, "/abs", "unsafe_member", phrase="absolute path")
    record, members = quarantine_record(summary, "p-link")
    assert record["reasons"][0] == {
        "code": "unsafe_member",
        "message": "member 'p-link.jpg' is a symbolic link to '/etc/passwd', not a regular file",
    }
    with tarfile.open(summary.quarantine_paths[0]) as tar:  # kept as metadata, never as a link
        kept = tar.getmember("p-link.jpg")
        assert kept.isreg() and kept.size == 0 and not kept.linkname
    assert record["links"] == {"p-link.jpg": {"type": "symlink", "linkname": "/etc/passwd"}}
    assert doc["quarantined"] == 3 and doc["passed"] == GOOD


def test_metadata_not_json_or_breaking_the_schema(tmp_path):
    inputs = {
        "shard-00000.tar": good_samples("p", 60)
        + sample("p-notjson", metadata=b"{'key': 'single quotes'}")
        + sample("p-schema", metadata={"key": "p-schema", "width": -3, "split": "holdout"})
        + sample("p-other", metadata={"key": "p-somebody-else"})
    }
    summary = run(tmp_path, inputs)
    assert_rejected(tmp_path, summary, inputs, "p-notjson", "metadata_not_json", phrase="is not JSON")
    doc = assert_rejected(
        tmp_path, summary, inputs, "p-schema", "metadata_schema", phrase="sample.schema.json"
    )
    message = [p["message"] for p in doc["problems"] if p["key"] == "p-schema"][0]
    assert "width" in message and "split" in message
    assert_rejected(tmp_path, summary, inputs, "p-other", "metadata_key_mismatch", phrase="'p-somebody-else'")
    assert summary.quarantined == 3 and not summary.blocked


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(ShardSpecError, match=r"no shard file matches '.*nowhere/\*\.tar'"):
        validate_phase(str(tmp_path / "nowhere" / "*.tar"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fsspec_urls_validate_like_local_paths(tmp_path):
    """memory:// and file:// shard URLs (fsspec's real filesystems) expand and validate as a local glob
    does: same counts, same accepted bytes, messages naming the URL; a rerun over unchanged URLs is reused,
    a changed shard is validated again, a URL naming nothing is refused."""
    import fsspec

    inputs = {
        "shard-00000.tar": good_samples("p", 20) + sample("p-blank", caption=b"   "),
        "shard-00001.tar": good_samples("q", 20),
    }
    policy = ValidationPolicy(max_quarantined_fraction=0.5)
    local = run(tmp_path, inputs, policy)
    memory = fsspec.filesystem("memory")
    root = f"/validation-{tmp_path.name}"
    try:
        for name in inputs:
            memory.pipe(f"{root}/in/{name}", (tmp_path / "in" / name).read_bytes())
        urls = {
            "memory": f"memory://{root}/in/shard-*.tar",
            "memory-braces": f"memory://{root}/in/shard-{{00000..00001}}.tar",
            "file": f"file://{tmp_path}/in/*.tar",
        }
        for label, url in urls.items():
            summary = validate_phase(url, tmp_path / label, policy)
            doc = check_invariants(summary, inputs)
            assert (doc["total"], doc["passed"], doc["by_reason"]) == (41, 40, {"caption_blank": 1}), label
            accepted = [tar_members(p) for p in summary.accepted_paths]
            assert accepted == [tar_members(p) for p in local.accepted_paths], label
            names = [s["name"] for s in doc["shards"]]
            assert names == sorted(names) and len(names) == 2
            assert all(n.startswith("memory://" if label.startswith("memory") else "file://") for n in names)
            assert doc["problems"][0]["message"].startswith(f"{names[0]}: key p-blank: ")
        assert validate_phase(urls["memory"], tmp_path / "memory", policy).reused
        longer = write_shard(tmp_path / "longer.tar", good_samples("r", 22))
        memory.pipe(f"{root}/in/shard-00001.tar", longer.read_bytes())
        changed = validate_phase(urls["memory"], tmp_path / "memory", policy)
        assert not changed.reused and changed.total == 43 and changed.quarantined == 1
        with pytest.raises(ShardSpecError, match=r"shard-00009\.tar.*no such shard file"):
            validate_phase(f"memory://{root}/in/shard-00009.tar", tmp_path / "missing", policy)
        with pytest.raises(ShardSpecError, match=r"no shard file matches 'memory://.*/nowhere/\*\.tar'"):
            validate_phase(f"memory://{root}/nowhere/*.tar", tmp_path / "missing", policy)
    finally:
        memory.rm(root, recursive=True)


# ---------------------------------------------------------------------------- thresholds, reruns, policy
def test_threshold_blocks_and_messages_are_logged(tmp_path, caplog):
    bad = [m for i in range(3) for m in sample(f"p-bad{i}", caption=b"   ")]
    inputs = {"shard-00000.tar": good_samples("p", 37) + bad}
    with caplog.at_level(logging.WARNING, logger="components.data.validation"):
        summary = run(tmp_path, inputs)
    doc = check_invariants(summary, inputs)
    assert doc["quarantined_fraction"] == pytest.approx(3 / 40) and summary.blocked
    assert any("7.50%" in r and "exceeds the threshold 5.00%" in r for r in doc["blocked_reasons"])
    shard = tmp_path / "in" / "shard-00000.tar"
    assert f"{shard}: key p-bad1: caption is blank (whitespace only)" in caplog.text
    lenient = validate_phase(str(shard), tmp_path / "out2", ValidationPolicy(max_quarantined_fraction=0.08))
    assert not lenient.blocked and lenient.quarantined == 3


def test_rerun_is_idempotent_and_removes_stale_outputs(tmp_path):
    inputs = {
        "shard-00000.tar": good_samples("p", 10) + sample("p-x", image=b""),
        "shard-00001.tar": good_samples("q", 10),
    }
    first = run(tmp_path, inputs, ValidationPolicy(max_quarantined_fraction=0.5))
    snapshot = {p: p.read_bytes() for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()}
    again = validate_phase(
        str(tmp_path / "in" / "*.tar"), tmp_path / "out", ValidationPolicy(max_quarantined_fraction=0.5)
    )
    assert again.reused and again.to_dict() == first.to_dict()
    forced = validate_phase(
        str(tmp_path / "in" / "*.tar"),
        tmp_path / "out",
        ValidationPolicy(max_quarantined_fraction=0.5),
        force=True,
    )
    assert not forced.reused
    assert {p: p.read_bytes() for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()} == snapshot
    (tmp_path / "in" / "shard-00001.tar").unlink()
    fewer = validate_phase(
        str(tmp_path / "in" / "*.tar"), tmp_path / "out", ValidationPolicy(max_quarantined_fraction=0.5)
    )
    assert fewer.total == 11 and not (tmp_path / "out" / "accepted" / "shard-00001.tar").exists()
    check_invariants(fewer)


def test_policy_files(tmp_path):
    (tmp_path / "p.yaml").write_text("max_quarantined_fraction: 0.2\nmax_caption_chars: 50\n")
    policy = load_validation_policy(tmp_path / "p.yaml")
    assert (
        policy.max_quarantined_fraction == 0.2 and policy.max_caption_chars == 50 and policy.min_width == 16
    )
    (tmp_path / "bad.json").write_text(json.dumps({"max_caption_char": 50}))
    with pytest.raises(SchemaError, match=r"(?s)bad\.json.*max_caption_char"):
        load_validation_policy(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="min_width=64 exceeds max_width=32"):
        ValidationPolicy(min_width=64, max_width=32)


def test_cli_exit_codes(tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    write_shard(tmp_path / "in" / "shard-00000.tar", good_samples("p", 18) + sample("p-bad", caption=b""))
    glob_ = str(tmp_path / "in" / "*.tar")
    runner = CliRunner()
    blocked = runner.invoke(app, ["validate", "--shards", glob_, "--out", str(tmp_path / "a")])
    assert blocked.exit_code == 3, blocked.output
    assert "19 samples in 1 shards: 18 passed, 1 quarantined" in blocked.output
    ok = runner.invoke(
        app,
        ["validate", "--shards", glob_, "--out", str(tmp_path / "b"), "--max-quarantined-fraction", "0.1"],
    )
    assert ok.exit_code == 0, ok.output
    assert (
        json.loads((tmp_path / "b" / "validation.json").read_text())["policy"]["max_quarantined_fraction"]
        == 0.1
    )
    missing = runner.invoke(
        app, ["validate", "--shards", str(tmp_path / "none-*.tar"), "--out", str(tmp_path / "c")]
    )
    assert missing.exit_code == 2 and "none-*.tar" in missing.output
    (tmp_path / "policy.json").write_text("{not json")
    bad_policy = runner.invoke(
        app,
        [
            "validate",
            "--shards",
            glob_,
            "--out",
            str(tmp_path / "d"),
            "--policy",
            str(tmp_path / "policy.json"),
        ],
    )
    assert bad_policy.exit_code == 2 and "policy.json" in bad_policy.output


# ---------------------------------------------------------------------------- reader and registries
def test_reader_groups_like_webdataset(tmp_path):
    path = write_shard(
        tmp_path / "s.tar",
        [("a.jpg", b"1"), ("a.txt", b"2"), ("b.seg.png", b"3"), ("README", b"4"), ("a.json", b"5")],
    )
    reader = ShardReader(path)
    groups = [(g.key, g.index, [m.name for m in g.members]) for g in reader]
    assert groups == [
        ("a", 0, ["a.jpg", "a.txt"]),
        ("b", 1, ["b.seg.png"]),
        ("README", 2, ["README"]),
        ("a", 3, ["a.json"]),
    ]
    assert reader.error is None and reader.samples == 4 and reader.members == 5
    assert split_member_name("dir/x.y.JPG") == ("dir/x", "y.jpg")


def test_reason_codes_agree_with_schema_and_suites():
    from components.data.validation.suite import EXPECTATIONS_DIR

    assert set(load_schema("validation")["$defs"]["reason_code"]["enum"]) == set(REASONS)
    suite = json.loads((EXPECTATIONS_DIR / "samples.json").read_text())
    assert {e["meta"]["reason"] for e in suite["expectations"]} <= set(REASONS)


def test_a_stored_picture_with_transparency_is_flagged_not_quarantined(tmp_path, caplog):
    from PIL import Image

    def png(mode: str, **save) -> bytes:
        buffer = io.BytesIO()
        Image.new(mode, (32, 32), 0).save(buffer, "PNG", **save)
        return buffer.getvalue()

    inputs = {
        "shard-00000.tar": good_samples("p01", 10)
        + sample("alpha-000001", image=png("RGBA"), ext="png")
        + sample("trns-000001", image=png("P", transparency=0), ext="png")
        + sample("flat-000001", image=png("RGB"), ext="png")
    }
    with caplog.at_level(logging.WARNING):
        summary = run(tmp_path, inputs)
    doc = check_invariants(summary, inputs)
    assert (doc["passed"], doc["quarantined"]) == (13, 0)
    assert doc["images"] == {"transparent": 2, "transparent_keys": ["alpha-000001", "trns-000001"]}
    assert "2 of 13 accepted pictures are stored with transparency" in caplog.text
