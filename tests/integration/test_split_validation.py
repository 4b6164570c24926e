"""Every split of a phase validated; a gallery defect is quarantined, not indexed; long captions counted."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from compat.data.manifest import add_phase, phase_urls
from components.data.validation import ValidationPolicy, validate_phase, validate_splits

LONG_CAPTION = " ".join(["a very long and winding description of a red circle"] * 10)  # ~100 tokens


def _sample(key: str, caption: str = "a red circle above a blue square", size: int = 32) -> dict[str, bytes]:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (len(key) * 37 % 256, 90, 200)).save(buffer, "JPEG")
    meta = {"key": key, "width": size, "height": size, "status": "success"}
    return {"jpg": buffer.getvalue(), "txt": caption.encode(), "json": json.dumps(meta).encode()}


def _shard(path: Path, samples: dict[str, dict[str, bytes]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_over_long_captions_are_counted_and_judged(tmp_path):
    samples = {f"k{i:03d}": _sample(f"k{i:03d}") for i in range(8)}
    samples.update({f"long{i}": _sample(f"long{i}", LONG_CAPTION) for i in range(2)})
    shard = _shard(tmp_path / "in" / "shard-00000.tar", samples)

    strict = validate_phase(shard, tmp_path / "strict", ValidationPolicy())  # 77 tokens, at most 10% over
    assert strict.quarantined == 0  # a long caption is not a broken sample: it is counted, not quarantined
    assert strict.document["captions"]["over_context"] == 2
    assert strict.document["captions"]["context_tokens"] == 77
    assert strict.document["captions"]["max_tokens"] > 77
    record = next(r for r in strict.expectations if r["column"] == "caption_tokens")
    assert record["suite"] == "phase" and not record["success"] and record["unexpected_count"] == 2
    assert strict.blocked and any("caption_tokens" in r for r in strict.blocked_reasons)

    lenient = validate_phase(shard, tmp_path / "lenient", ValidationPolicy(max_over_context_fraction=0.25))
    assert not lenient.blocked and lenient.document["captions"]["over_context"] == 2
    with pytest.raises(Exception, match="max_over_context_fraction"):
        ValidationPolicy(max_over_context_fraction=1.5)


def test_every_split_validated_and_counted(tmp_path):
    inputs = tmp_path / "in"
    train = _shard(inputs / "train.tar", {f"t{i:03d}": _sample(f"t{i:03d}") for i in range(20)})
    bad_eval = {f"e{i:03d}": _sample(f"e{i:03d}") for i in range(4)}
    bad_eval["e-tiny"] = _sample("e-tiny", size=8)  # 1 of 5: over the 5% threshold
    evals = _shard(inputs / "eval.tar", bad_eval)
    gallery = {f"g{i:03d}": _sample(f"g{i:03d}") for i in range(30)}
    gallery["g-tiny"] = _sample("g-tiny", size=8)
    galleries = _shard(inputs / "gallery.tar", gallery)

    summary = validate_splits({"train": train, "eval": evals, "gallery": galleries}, tmp_path / "out")
    splits = summary.document["splits"]
    assert {k: (v["total"], v["passed"], v["quarantined"]) for k, v in splits.items()} == {
        "train": (20, 20, 0),
        "eval": (5, 4, 1),
        "gallery": (31, 30, 1),
    }
    assert splits["gallery"]["by_reason"] == {"image_size": 1} and not splits["gallery"]["blocked"]
    assert splits["eval"]["blocked"] and summary.blocked  # one split blocked blocks the phase
    assert all(r.startswith("eval split: ") for r in summary.blocked_reasons)
    assert (summary.total, summary.passed) == (20, 20)  # the top level stays the train split's
    on_disk = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert on_disk["splits"] == splits
    again = validate_splits({"train": train, "eval": evals, "gallery": galleries}, tmp_path / "out")
    assert again.reused and again.blocked_reasons == summary.blocked_reasons  # reasons not repeated
    with pytest.raises(ValueError, match="train"):
        validate_splits({"gallery": galleries}, tmp_path / "x")


def test_gallery_defect_is_quarantined_and_not_indexed(tmp_path):
    from compat.models import build_model, save_checkpoint
    from components.adapters.index import GalleryIndex
    from components.deployment import Deployment
    from components.rollout.operations import index_new_items
    from components.runs import validated_shards
    from components.serving.record import read_serving
    from components.state.workspace import Workspace
    from components.steps import validate_step

    inputs, stream = tmp_path / "in", tmp_path / "stream"
    gallery = {f"g{i:03d}": _sample(f"g{i:03d}") for i in range(30)}
    gallery["g-tiny"] = _sample("g-tiny", size=8)  # under the 16-px minimum
    add_phase(
        stream,
        {
            "train": [_shard(inputs / "train.tar", {f"t{i:03d}": _sample(f"t{i:03d}") for i in range(20)})],
            "eval": [_shard(inputs / "eval.tar", {f"e{i:03d}": _sample(f"e{i:03d}") for i in range(4)})],
            "gallery": [_shard(inputs / "gallery.tar", gallery)],
        },
        "shapes",
    )
    config = Deployment.coerce({"workspace": str(tmp_path / "ws"), "stream": {"uri": str(stream)}})
    validated_dir = Workspace.of(config).validated_dir
    run_dir = tmp_path / "ws" / "runs" / "r0"
    document = validate_step(
        config, run_dir, 0, phase_urls(stream, 0, "train"), tmp_path / "validated", tmp_path / "summary.json"
    )
    assert not document["blocked"]
    assert document["splits"]["gallery"]["quarantined"] == 1
    assert document["captions"]["context_tokens"] == 32  # cf-tiny's text context
    assert (validated_dir(0) / "gallery").is_dir()

    raw = phase_urls(stream, 0, "gallery")
    kept = validated_shards(config, raw, "gallery")
    assert kept and all(str(validated_dir(0)) in p for p in kept)
    model = tmp_path / "model"
    save_checkpoint(build_model("cf-tiny", seed=0), model, version="v1")
    record = index_new_items(config.workspace, model, "v1", "v1", kept)
    assert record["n_new"] == 30
    alias = read_serving(tmp_path / "ws" / "serving.json").alias  # the deployment's own
    with GalleryIndex(str(tmp_path / "ws" / "milvus" / "gallery.db"), alias) as index:
        ids = {str(r["item_id"]) for batch in index.iter_rows(()) for r in batch}
    assert "g-tiny" not in ids and len(ids) == 30


def test_the_report_shows_every_split(tmp_path):
    from components.report.inputs import Source
    from components.report.sections import Table, _validation_section

    inputs = tmp_path / "in"
    gallery = {f"g{i:03d}": _sample(f"g{i:03d}", LONG_CAPTION if i < 6 else "a dot") for i in range(30)}
    gallery["g-tiny"] = _sample("g-tiny", size=8)
    summary = validate_splits(
        {
            "train": _shard(inputs / "train.tar", {f"t{i:03d}": _sample(f"t{i:03d}") for i in range(20)}),
            "gallery": _shard(inputs / "gallery.tar", gallery),
        },
        tmp_path / "out",
    )
    section = _validation_section(Source("validation", summary.path, summary.document))
    tables = [item for item in section.items if isinstance(item, Table)]
    assert tables[0].headers[0] == "split" and "captions over 77 tokens" in tables[0].headers
    assert [row[:4] for row in tables[0].rows] == [["train", 20, 20, 0], ["gallery", 31, 30, 1]]
    assert tables[1].rows == [["gallery", "image_size", 1]]
    # 6 of 30 gallery captions are cut at the context: counted, but only the train split is judged on it
    assert tables[0].rows[1][5] == 6 and not summary.blocked
