"""Run bookkeeping: the validated-shard store that later runs replay and compare against."""

import json
import tarfile

import pytest

from compat.data.synth import FORMAT, MANIFEST, VERSION
from components.runs import keep_validated, replay_shards, train_shards_of, validated_dir


def _shard(path, names):
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 0
            tar.addfile(info)
    return path


def _config(tmp_path):
    stream = tmp_path / "stream"
    (stream / "p0").mkdir(parents=True)
    (stream / "p1").mkdir()
    phases = [
        {"train": ["p0/raw-0.tar", "p0/raw-1.tar"], "domain": "geometric"},
        {"train": ["p1/raw-0.tar"], "domain": "signs"},
    ]
    for rel in ("p0/raw-0.tar", "p0/raw-1.tar", "p1/raw-0.tar"):
        _shard(stream / rel, ["a.txt"])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "seed": 0,
        "image_size": 64,
        "phases": [
            {"phase": i, "eval": [], "gallery": [], "counts": {"train": 1, "eval": 0, "gallery": 0}, **entry}
            for i, entry in enumerate(phases)
        ],
    }
    (stream / MANIFEST).write_text(json.dumps(manifest))
    return {"workspace": str(tmp_path / "ws"), "stream": {"uri": str(stream)}}


def test_kept_shards_replace_the_raw_ones_and_a_rerun_replaces_the_copy(tmp_path):
    config = _config(tmp_path)
    raw = train_shards_of(config, 0)
    assert [p.rsplit("/", 1)[1] for p in raw] == ["raw-0.tar", "raw-1.tar"]  # nothing kept yet

    accepted = [_shard(tmp_path / f"accepted-{i}.tar", ["x.txt"]) for i in range(3)]
    kept = keep_validated(config["workspace"], 0, accepted)
    assert [p.rsplit("/", 1)[1] for p in kept] == ["accepted-0.tar", "accepted-1.tar", "accepted-2.tar"]
    assert train_shards_of(config, 0) == kept
    assert replay_shards(config, 2, per_phase=1) == [
        kept[:1],
        [str(tmp_path / "stream" / "p1" / "raw-0.tar")],
    ]
    assert replay_shards(config, 0) == []

    keep_validated(config["workspace"], 0, accepted[:1])  # the phase validated again: only its new output
    assert [p.rsplit("/", 1)[1] for p in train_shards_of(config, 0)] == ["accepted-0.tar"]
    assert not any(p.name.startswith(".") for p in validated_dir(config["workspace"], 0).parent.iterdir())


def test_keep_validated_leaves_the_previous_copy_when_a_shard_is_missing(tmp_path):
    good = [_shard(tmp_path / "a.tar", ["x.txt"])]
    kept = keep_validated(tmp_path / "ws", 1, good)
    with pytest.raises(FileNotFoundError):
        keep_validated(tmp_path / "ws", 1, [tmp_path / "missing.tar"])
    assert sorted(str(p) for p in validated_dir(tmp_path / "ws", 1).glob("*.tar")) == kept
