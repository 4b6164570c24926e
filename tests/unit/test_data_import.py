"""Real data in: `compatflow data import` (sidecar folders, class folders, CSV/Parquet tables; duplicates,
refused files, determinism, resumption) and `compatflow stream add-phase/show` (manifest, schema, img2dataset
folders, the pipeline's phase picker)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from _image_folders import KINDS, LABELS, SIZES, image_folder, picture, tree_bytes
from PIL import Image
from typer.testing import CliRunner

from compat.data.images import decode_rgb
from compat.data.importer import PENDING, REPORT, DataImportError, ImportSettings, import_images, split_of
from compat.data.manifest import StreamError, add_phase, load_manifest, phase_urls
from compat.data.shards import write_shard
from components.deployment import Deployment
from pipelines.cli import app
from schemas import schema_errors

runner = CliRunner()


def read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    from compat.data.shards import iter_raw_samples

    return {sample.key: sample.members for sample in iter_raw_samples(str(path))}


def all_samples(out: Path) -> dict[str, dict[str, bytes]]:
    report = json.loads((out / REPORT).read_text())
    return {k: v for s in report["shards"].values() for rel in s for k, v in read_tar(out / rel).items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 good images of ten kinds plus a duplicate and one file of every refusal a folder can hold."""
    root = image_folder(tmp_path_factory.mktemp("src") / "photos", 30)
    (root / "a" / "copy.png").write_bytes((root / "a" / "img0002.png").read_bytes())  # same bytes
    (root / "a" / "copy.txt").write_text("another caption of the same picture")
    picture(900, (30, 30), "RGB").save(root / "a" / "nocaption.jpg")
    picture(901, (30, 30), "RGB").save(root / "a" / "blank.jpg")
    (root / "a" / "blank.txt").write_text("  \n")
    picture(902, (30, 30), "RGB").save(root / "a" / "latin1.jpg")
    (root / "a" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    good = (root / "a" / "img0001.jpeg").read_bytes()
    (root / "a" / "cut.jpg").write_bytes(good[: len(good) // 2])
    (root / "a" / "cut.txt").write_text("half a picture")
    (root / "a" / "notes.md").write_text("not a picture")
    (root / "a" / "notes.txt").write_text("a caption for a text file")
    (root / "a" / "orphan.txt").write_text("a caption without its picture")
    picture(903, (30, 30), "RGB").save(root / "a" / "essay.jpg")
    (root / "a" / "essay.txt").write_text("word " * 300_000)  # 1.5 MB: not a caption
    (root / "a" / "orphan.json").write_text("{}")
    (root / "a" / "lone.json").write_text("{}")
    (root / "a" / "img0004.json").write_text('{"url": "https://example.com/4.png"}')
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("ignored")
    return root


@pytest.fixture(scope="module")
def imported(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("import") / "out"
    result = runner.invoke(
        app, ["data", "import", str(folder), "--out", str(out), "--samples-per-shard", "8"]
    )
    assert result.exit_code == 0, result.output
    return out


def test_sidecar_folder_every_mode_kept_or_stored_losslessly(folder: Path, imported: Path) -> None:
    report = json.loads((imported / REPORT).read_text())
    assert schema_errors(report, "stream_import") == []
    assert report["imported"] == 30 and sum(report["counts"].values()) == 30
    assert all(report["counts"][s] > 0 for s in ("train", "eval", "gallery"))
    assert report["converted_to_png_or_jpeg"] == 9  # the BMP, GIF and TIFF files
    assert report["matted_on_white"] == 6  # the RGBA and LA files
    assert report["captions"] == 31 and sum(report["caption_counts"].values()) == 31
    samples = all_samples(imported)
    assert len(samples) == 30
    for key, members in samples.items():
        meta = json.loads(members["json"])
        assert schema_errors(meta, "sample") == [] and meta["key"] == key
        copy = meta["source"] == "a/copy.png"  # img0002.png's bytes, first in path order: the one kept
        i = 2 if copy else int(meta["source"].rsplit("img", 1)[1][:4])
        mode, ext, fmt, member = KINDS[i % len(KINDS)]
        image_member = next(e for e in members if e not in ("txt", "json"))
        assert image_member == member and set(members) == {member, "txt", "json"}
        assert (meta["mode"], meta["format"]) == (mode, fmt)
        assert (meta["original_width"], meta["original_height"]) == SIZES[i % len(SIZES)]
        source = folder / meta["source"]
        if mode in ("RGBA", "LA"):  # matted on white, as img2dataset stores transparent pictures
            with Image.open(io.BytesIO(members[member])) as stored:
                assert stored.mode == "RGB" and "transparency" not in stored.info
                expected = decode_rgb(source.read_bytes())
                assert np.array_equal(np.asarray(stored), np.asarray(expected))
        elif fmt in ("JPEG", "PNG", "WEBP"):
            assert members[member] == source.read_bytes()  # the original bytes, not re-encoded
        else:
            with Image.open(io.BytesIO(members[member])) as stored, Image.open(source) as original:
                assert stored.size == original.size and stored.mode == original.mode
                if member == "png":
                    assert np.array_equal(np.asarray(stored), np.asarray(original))  # lossless
        caption = f"a {LABELS[i % 4]} thing number {i}"
        # the two files of one picture make one sample with both captions, the first file's first
        captions = ["another caption of the same picture", caption] if copy else [caption]
        assert meta["captions"] == captions
        assert members["txt"].decode() == meta["caption"] == captions[0]
        assert meta["split"] == split_of(key, 0, (0.8, 0.1, 0.1))
        assert meta.get("source_meta") == ({"url": "https://example.com/4.png"} if i == 4 else None)
    tars = sorted(p.relative_to(imported).as_posix() for p in imported.rglob("*.tar"))
    assert tars == sorted(rel for s in report["shards"].values() for rel in s)
    assert not (imported / PENDING).exists() and not list(imported.rglob("*.tmp"))


def test_duplicates_and_every_refused_file_reported_with_its_reason(imported: Path) -> None:
    report = json.loads((imported / REPORT).read_text())
    # a/img0002.png holds a/copy.png's bytes under another caption: grouped with it, not a duplicate
    assert report["grouped"] == 1 and report["duplicates"] == 0 and report["duplicate_files"] == []
    reasons = {r["source"]: r["reason"] for r in report["refused_files"]}
    assert reasons == {
        "a/nocaption.jpg": "caption_missing",
        "a/blank.jpg": "caption_empty",
        "a/latin1.jpg": "caption_not_utf8",
        "a/cut.jpg": "image_unreadable",
        "a/notes.md": "not_an_image",
        "a/orphan.txt": "image_missing",
        "a/lone.json": "image_missing",
        "a/essay.jpg": "caption_too_large",
    }
    assert report["refused"] == 8 and sum(report["refused_by_reason"].values()) == 8
    for refusal in report["refused_files"]:
        assert refusal["message"].startswith(refusal["source"] + ": ")


def test_same_input_gives_identical_bytes_and_a_rerun_writes_nothing(
    folder: Path, imported: Path, tmp_path: Path
) -> None:
    again = import_images(folder, tmp_path / "again", ImportSettings(samples_per_shard=8), progress=False)
    assert tree_bytes(tmp_path / "again") == tree_bytes(imported)
    rerun = import_images(folder, imported, ImportSettings(samples_per_shard=8), progress=False)
    assert rerun.written_shards == 0 and rerun.report == again.report
    other = import_images(
        folder, tmp_path / "seed", ImportSettings(samples_per_shard=8, seed=5), progress=False
    )
    assert other.report["imported"] == 30 and other.report["counts"] != again.report["counts"]
    with pytest.raises(DataImportError, match="finished import of other input"):
        import_images(folder, imported, ImportSettings(samples_per_shard=8, seed=5), progress=False)


def test_class_folders_caption_from_the_template(tmp_path: Path) -> None:
    src = tmp_path / "classes"
    for i, label in enumerate(["ankle_boot", "bag", "ankle_boot", "coat", "bag", "coat"] * 2):
        (src / label).mkdir(parents=True, exist_ok=True)
        picture(i, (24 + i, 24), "RGB").save(src / label / f"{i}.png")
    picture(99, (24, 24), "RGB").save(src / "loose.png")
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["data", "import", str(src), "--out", str(out), "--format", "class-folders", "--template",
         "a photo of a {label}", "--split", "0.5,0.25,0.25"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    assert report["imported"] == 12 and report["settings"]["split"] == [0.5, 0.25, 0.25]
    assert [r["reason"] for r in report["refused_files"]] == ["not_in_class_folder"]
    for members in all_samples(out).values():
        meta = json.loads(members["json"])
        assert meta["caption"] == f"a photo of a {meta['label'].replace('_', ' ')}"
        assert members["txt"].decode() == meta["caption"]
    bad = runner.invoke(
        app, ["data", "import", str(src), "--out", str(tmp_path / "x"), "--format", "class-folders",
              "--template", "a photo"],
    )  # fmt: skip
    assert bad.exit_code == 2 and "{label}" in bad.output


def write_table_images(root: Path) -> list[dict[str, object]]:
    (root / "img").mkdir(parents=True)
    rows: list[dict[str, object]] = []
    for i in range(8):
        picture(i, (30, 20 + i), "RGB").save(root / "img" / f"{i}.jpg")
        rows.append(
            {"path": f"img/{i}.jpg", "caption": f"caption {i}", "url": f"https://x/{i}", "score": i / 2}
        )
    rows.append({"path": "img/missing.jpg", "caption": "gone", "url": "", "score": 0.0})
    rows.append({"path": "img/0.jpg", "caption": "the first one again", "url": "", "score": 1.0})
    rows.append({"path": "img/1.jpg", "caption": "caption 1", "url": "", "score": 2.0})  # an exact repeat
    picture(50, (30, 30), "RGB").save(root / "img" / "nocap.jpg")
    rows.append({"path": "img/nocap.jpg", "caption": "", "url": "", "score": 0.0})
    return rows


def check_table_import(out: Path, result_output: str, exit_code: int) -> None:
    assert exit_code == 0, result_output
    report = json.loads((out / REPORT).read_text())
    # picture 0's second row adds its caption; picture 1's second row repeats its caption: dropped
    assert report["imported"] == 8 and report["captions"] == 9 and report["grouped"] == 1
    assert report["duplicates"] == len(report["duplicate_files"]) == 1
    assert report["duplicate_files"][0]["caption"] == "caption 1"
    assert report["duplicate_files"][0]["source"].endswith("row 11: img/1.jpg")
    assert report["duplicate_files"][0]["duplicate_of"].endswith("row 2: img/1.jpg")
    assert sorted(r["reason"] for r in report["refused_files"]) == ["caption_empty", "image_missing"]
    for members in all_samples(out).values():
        meta = json.loads(members["json"])
        i = int(meta["source"].rsplit("/", 1)[1].split(".")[0])
        assert meta["source"] == f"img/{i}.jpg" and meta["source_row"] == i + 1
        captions = [f"caption {i}", "the first one again"] if i == 0 else [f"caption {i}"]
        assert meta["url"] == f"https://x/{i}" and meta["score"] == i / 2
        assert meta["caption"] == f"caption {i}" and meta["captions"] == captions
        assert (meta["original_width"], meta["original_height"]) == (30, 20 + i)


def test_csv_table_with_extra_columns(tmp_path: Path) -> None:
    import csv

    rows = write_table_images(tmp_path / "data")
    with open(tmp_path / "data" / "pairs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "caption", "url", "score"])
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(tmp_path / "data" / "pairs.csv"), "--out", str(out)])
    # CSV cells are text: the score column comes back as the string the file holds
    assert result.exit_code == 0, result.output
    metas = [json.loads(m["json"]) for m in all_samples(out).values()]
    assert sorted(m["score"] for m in metas) == sorted(str(i / 2) for i in range(8))
    (tmp_path / "bad.csv").write_text("file,text\nimg/0.jpg,x\n")
    bad = runner.invoke(app, ["data", "import", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "bad.csv has no column 'path', 'caption'" in bad.output


def test_parquet_table_with_typed_extra_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = write_table_images(tmp_path / "data")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "pairs.parquet")
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["data", "import", str(tmp_path / "data" / "pairs.parquet"), "--out", str(out)]
    )
    check_table_import(out, result.output, result.exit_code)


def test_nothing_imported_exits_non_zero_naming_the_reasons(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a caption with no image")
    (src / "b.jpg").write_bytes(b"not really a jpeg")
    (src / "b.txt").write_text("b")
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "nothing imported" in result.output and "1 image_missing, 1 not_an_image" in result.output
    for args, message in (
        (["--split", "0.8,0.3,0.1"], "summing to 1"),
        (["--split", "a,b"], "three fractions"),
        (["--key-prefix", "a.b"], "--key-prefix"),
    ):
        bad = runner.invoke(app, ["data", "import", str(src), "--out", str(tmp_path / "o2"), *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("someone's file")
    busy = runner.invoke(app, ["data", "import", str(src), "--out", str(tmp_path / "busy")])
    assert busy.exit_code == 2 and "not empty and holds no import" in busy.output


def test_only_regular_files_inside_src_are_read_and_captions_are_bounded(tmp_path: Path) -> None:
    """A symlinked caption or metadata file, a hard link, a FIFO and a caption over the validation limit are
    refused with their reason; nothing of a file outside SRC reaches a shard."""
    from compat.data.importer import MAX_CAPTION_BYTES
    from components.data.validation.policy import ValidationPolicy

    assert MAX_CAPTION_BYTES == ValidationPolicy().max_caption_bytes == 65536  # one limit, both places
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:the secret line\n")
    (tmp_path / "secret.json").write_text('{"leak": "the secret line"}')
    src = image_folder(tmp_path / "src", 3)
    for seed, name in enumerate(("link", "meta", "hard", "fifo", "long", "edge"), start=500):
        picture(seed, (30, 30), "RGB").save(src / f"{name}.jpg")
    (src / "link.txt").symlink_to(secret)
    (src / "meta.txt").write_text("a caption")
    (src / "meta.json").symlink_to(tmp_path / "secret.json")
    os.link(secret, src / "hard.txt")
    os.mkfifo(src / "fifo.txt")  # a reader that followed it would wait for a writer forever
    (src / "long.txt").write_text("x" * (MAX_CAPTION_BYTES + 1))
    (src / "edge.txt").write_text("y" * MAX_CAPTION_BYTES)  # exactly the limit: kept
    (src / "a").joinpath("img0001.jpeg").rename(src / "a" / "moved.jpeg")
    (src / "a" / "img0001.jpeg").symlink_to(src / "a" / "moved.jpeg")  # a link even inside SRC
    (src / "a" / "moved.txt").write_text("the picture the link inside SRC points to")
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(src), "--out", str(out), "--split", "0,0,1"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    assert schema_errors(report, "stream_import") == []
    reasons = {r["source"]: r["reason"] for r in report["refused_files"]}
    assert reasons == {
        "link.jpg": "not_a_regular_file",
        "meta.jpg": "not_a_regular_file",
        "hard.jpg": "not_a_regular_file",
        "fifo.jpg": "not_a_regular_file",
        "long.jpg": "caption_too_large",
        "a/img0001.jpeg": "not_a_regular_file",
    }
    messages = {r["source"]: r["message"] for r in report["refused_files"]}
    assert "symbolic link" in messages["link.jpg"] and "--allow-outside" in messages["link.jpg"]
    assert "hard.txt is a hard link (2 names" in messages["hard.jpg"]
    samples = all_samples(out)
    assert len(samples) == 4  # img0000, img0002, a/moved.jpeg and edge
    assert not any(b"the secret line" in data for m in samples.values() for data in m.values())
    assert max(len(m["txt"]) for m in samples.values()) == MAX_CAPTION_BYTES


def test_table_paths_outside_its_folder_need_allow_outside(tmp_path: Path) -> None:
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    picture(1, (30, 30), "RGB").save(data / "in.jpg")
    picture(2, (30, 30), "RGB").save(elsewhere / "out.jpg")
    picture(3, (30, 30), "RGB").save(elsewhere / "abs.jpg")
    (data / "linked").symlink_to(elsewhere, target_is_directory=True)
    table = data / "pairs.csv"
    table.write_text(
        "path,caption\n"
        f"in.jpg,inside\n../elsewhere/out.jpg,dot dot\n{elsewhere / 'abs.jpg'},absolute\n"
        "linked/out.jpg,through a folder link\n"
        f"../data/in.jpg,{'z' * (65536 + 1)}\n"
    )
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "import", str(table), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / REPORT).read_text())
    reasons = {r["source"]: r["reason"] for r in report["refused_files"]}
    assert reasons == {
        "pairs.csv row 2: ../elsewhere/out.jpg": "outside_source",
        f"pairs.csv row 3: {elsewhere / 'abs.jpg'}": "outside_source",
        "pairs.csv row 4: linked/out.jpg": "not_a_regular_file",
        "pairs.csv row 5: ../data/in.jpg": "caption_too_large",
    }
    assert report["imported"] == 1
    allowed = runner.invoke(
        app, ["data", "import", str(table), "--out", str(tmp_path / "o2"), "--allow-outside", str(elsewhere)]
    )
    assert allowed.exit_code == 0, allowed.output
    report = json.loads((tmp_path / "o2" / REPORT).read_text())
    # linked/out.jpg is out.jpg's bytes under another caption: one picture, two captions
    assert report["imported"] == 3 and report["captions"] == 4 and report["grouped"] == 1
    assert [r["reason"] for r in report["refused_files"]] == ["caption_too_large"]
    missing = runner.invoke(
        app, ["data", "import", str(table), "--out", str(tmp_path / "o3"), "--allow-outside", "/no/such"]
    )
    assert missing.exit_code == 2 and "--allow-outside /no/such is not a folder" in missing.output


# ------------------------------------------------------------------------------------------- streams


def import_drop(tmp_path: Path, name: str, start: int) -> Path:
    src = image_folder(tmp_path / f"{name}-src", 40, start=start)
    out = tmp_path / name
    import_images(src, out, ImportSettings(split=(0.6, 0.2, 0.2), samples_per_shard=10), progress=False)
    return out


def test_add_phase_appends_a_schema_valid_phase_and_the_phase_picker_takes_it(tmp_path: Path) -> None:
    from components.runs import plan_run, record_phase
    from pipelines.config import load_config, resolve
    from pipelines.local_runner import ensure_stream

    drop1, drop2 = import_drop(tmp_path, "drop1", 0), import_drop(tmp_path, "drop2", 1000)
    stream = tmp_path / "stream"
    added = runner.invoke(
        app, ["stream", "add-phase", str(stream), "--shards", str(drop1), "--domain", "drop-1"]
    )
    assert added.exit_code == 0, added.output
    manifest = load_manifest(stream)
    assert schema_errors(manifest, "stream") == []
    assert "seed" not in manifest and "image_size" not in manifest
    counts = json.loads((drop1 / REPORT).read_text())["counts"]
    assert manifest["phases"][0]["counts"] == counts and manifest["phases"][0]["domain"] == "drop-1"

    config = resolve(load_config("local")).to_dict()
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(stream), generate_if_missing=False)
    assert ensure_stream(Deployment.coerce(config)) == stream
    plan = plan_run(Deployment.coerce(config)).model_dump()
    assert plan["phase"] == 0 and plan["domain"] == "drop-1"
    assert plan["gallery_shards"] == phase_urls(stream, 0, "gallery")
    record_phase(Path(config["workspace"]), 0, "succeeded", plan["run_id"])
    assert plan_run(Deployment.coerce(config)) is None  # nothing pending until the next phase lands

    added = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(drop2)])
    assert added.exit_code == 0, added.output
    manifest = load_manifest(stream)
    assert schema_errors(manifest, "stream") == [] and len(manifest["phases"]) == 2
    assert manifest["phases"][1]["domain"] == "drop2"  # the --shards folder's name by default
    for split in ("train", "eval", "gallery"):
        urls = phase_urls(stream, 1, split)
        assert all(u.startswith(str((stream / "phase-01").resolve())) for u in urls)
        assert sum(len(read_tar(Path(u))) for u in urls) == manifest["phases"][1]["counts"][split]
        assert all(os.stat(u).st_nlink == 2 for u in urls)  # hard links, not copies
    plan = plan_run(Deployment.coerce(config)).model_dump()
    assert plan["phase"] == 1 and plan["domain"] == "drop2"
    assert plan["train_shards"] == phase_urls(stream, 1, "train")
    assert plan["eval_shards"] == phase_urls(stream, 0, "eval") + phase_urls(stream, 1, "eval")

    shown = runner.invoke(app, ["stream", "show", str(stream)])
    info = runner.invoke(app, ["data", "info", str(stream)])
    assert shown.exit_code == info.exit_code == 0
    doc, info_doc = json.loads(shown.stdout), json.loads(info.stdout)
    assert [p["domain"] for p in doc["phases"]] == ["drop-1", "drop2"] and doc["missing_shards"] == []
    assert {k: info_doc[k] for k in doc} == doc  # data info shows the same, and the vocabulary shift


def test_an_img2dataset_folder_works_as_it_is(tmp_path: Path) -> None:
    """img2dataset writes {00000..N}.tar with .parquet and _stats.json beside them: the splits are named."""
    folder = tmp_path / "img2dataset-out"
    for shard in range(4):
        samples = []
        for j in range(5):
            idx = shard * 5 + j
            buf = io.BytesIO()
            picture(idx, (40, 30), "RGB").save(buf, format="JPEG")
            key = f"{shard:05d}{j:04d}"
            meta = {"key": key, "caption": f"photo {idx}", "status": "success", "width": 40, "height": 30}
            samples.append(
                (
                    key,
                    {
                        "jpg": buf.getvalue(),
                        "txt": meta["caption"].encode(),
                        "json": json.dumps(meta).encode(),
                    },
                )
            )
        write_shard(folder / f"{shard:05d}.tar", samples)
        (folder / f"{shard:05d}.parquet").write_bytes(b"PAR1")
        (folder / f"{shard:05d}_stats.json").write_text("{}")
    stream = tmp_path / "stream"
    plain = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(folder)])
    assert plain.exit_code == 2 and "--train" in plain.output and "directly" in plain.output
    ok = runner.invoke(
        app,
        ["stream", "add-phase", str(stream), "--domain", "web", "--in-place",
         "--train", f"{folder}/{{00000..00001}}.tar", "--eval", str(folder / "00002.tar"),
         "--gallery", str(folder / "00003.tar")],
    )  # fmt: skip
    assert ok.exit_code == 0, ok.output
    entry = load_manifest(stream)["phases"][0]
    assert entry["counts"] == {"train": 10, "eval": 5, "gallery": 5}
    assert entry["train"] == [str(folder / "00000.tar"), str(folder / "00001.tar")]  # listed where they are
    assert schema_errors(load_manifest(stream), "stream") == []


def test_add_phase_refuses_unreadable_or_too_small_splits_and_writes_nothing(tmp_path: Path) -> None:
    drop = import_drop(tmp_path, "drop", 0)
    stream = tmp_path / "stream"
    shards = {s: sorted(str(p) for p in (drop / s).glob("*.tar")) for s in ("train", "eval", "gallery")}
    cut = tmp_path / "cut.tar"
    data = Path(shards["train"][0]).read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(StreamError, match=r"train shard is unreadable: shard .*cut\.tar is malformed"):
        add_phase(stream, {**shards, "train": [*shards["train"], str(cut)]}, "x")
    with pytest.raises(StreamError, match="the eval split holds 0 samples; a phase needs at least 2"):
        add_phase(stream, {**shards, "eval": []}, "x")
    assert not stream.exists()
    add_phase(stream, shards, "ok")
    with pytest.raises(StreamError, match=r"nothing new: all \d+ samples of the new phase are already in"):
        add_phase(stream, shards, "the same samples again")  # evaluation and the gallery key samples by it
    twice = {**shards, "gallery": [*shards["gallery"], shards["eval"][0]]}
    with pytest.raises(StreamError, match="is in two splits of the new phase"):
        add_phase(tmp_path / "other", twice, "x")
    assert len(load_manifest(stream)["phases"]) == 1
    drop2 = import_drop(tmp_path, "drop2", 1000)
    shards2 = {s: sorted(str(p) for p in (drop2 / s).glob("*.tar")) for s in ("train", "eval", "gallery")}
    (stream / "phase-01" / "train").mkdir(parents=True)  # left by an add that was killed before stream.json
    entry = add_phase(stream, shards2, "again")
    assert entry["phase"] == 1 and len(list((stream / "phase-01" / "train").glob("*.tar"))) == len(
        shards2["train"]
    )


def overlapping_drops(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders of 40 captioned pictures sharing 16: the repeats under other file names and captions."""
    first = image_folder(tmp_path / "week1", 40)
    second = image_folder(tmp_path / "week2", 24, start=100)
    for n, old in enumerate(sorted(first.rglob("img*"))[:32]):  # 16 pictures with their captions
        if old.suffix != ".txt":
            (second / "recrawl").mkdir(exist_ok=True)
            (second / "recrawl" / f"again{n}{old.suffix}").write_bytes(old.read_bytes())
            (second / "recrawl" / f"again{n}.txt").write_text(f"the same picture, crawled again ({n})\n")
    return first, second


def stream_samples(stream: Path) -> list[tuple[str, bytes]]:
    """Every sample of the stream as (key, picture bytes), in manifest order."""
    from compat.data.manifest import IMAGE_MEMBERS

    found = []
    for entry in load_manifest(stream)["phases"]:
        for split in ("train", "eval", "gallery"):
            for url in phase_urls(stream, entry["phase"], split):
                for key, members in read_tar(Path(url)).items():
                    found.append((key, next(members[e] for e in IMAGE_MEMBERS if e in members)))
    return found


def test_two_overlapping_drops_import_and_add_as_two_phases_repeats_counted_nothing_twice(
    tmp_path: Path,
) -> None:
    first, second = overlapping_drops(tmp_path)
    stream, split = tmp_path / "stream", ["--split", "0.5,0.25,0.25", "--samples-per-shard", "8"]
    for name, src in (("s1", first), ("s2", second)):
        done = runner.invoke(app, ["data", "import", str(src), "--out", str(tmp_path / name), *split])
        assert done.exit_code == 0, done.output
        added = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(tmp_path / name)])
        assert added.exit_code == 0, added.output
    out = json.loads(added.stdout)["added"]
    manifest = load_manifest(stream)
    entry = manifest["phases"][1]
    assert schema_errors(manifest, "stream") == []
    assert out["repeats_skipped"] == entry["repeats_skipped"] and sum(entry["repeats_skipped"].values()) == 16
    assert manifest["phases"][0]["repeats_skipped"] == {"train": 0, "eval": 0, "gallery": 0}
    assert sum(entry["counts"].values()) == 24
    samples = stream_samples(stream)
    keys = [k for k, _ in samples]
    assert len(keys) == len(set(keys)) == 64  # every picture once
    assert len({image for _, image in samples}) == 64
    for split_name in ("train", "eval", "gallery"):  # counts match the (rewritten) shards
        held = sum(len(read_tar(Path(u))) for u in phase_urls(stream, 1, split_name))
        assert held == entry["counts"][split_name]

    again = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(tmp_path / "s2")])
    assert again.exit_code == 2 and "nothing new: all 40 samples" in again.output, again.output
    assert len(load_manifest(stream)["phases"]) == 2

    # The same picture stored as other bytes (other resize settings) under its key is refused.
    small = ["data", "import", str(second), "--out", str(tmp_path / "small"), *split, "--max-side", "16"]
    assert runner.invoke(app, small).exit_code == 0
    other = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(tmp_path / "small")])
    assert other.exit_code == 2 and "for other picture bytes" in other.output, other.output
    assert "--max-side" in other.output and len(load_manifest(stream)["phases"]) == 2


def test_import_exclude_stream_leaves_out_what_the_stream_holds(tmp_path: Path) -> None:
    first, second = overlapping_drops(tmp_path)
    stream, split = tmp_path / "stream", ["--split", "0.5,0.25,0.25"]
    assert (
        runner.invoke(app, ["data", "import", str(first), "--out", str(tmp_path / "s1"), *split]).exit_code
        == 0
    )
    assert (
        runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(tmp_path / "s1")]).exit_code
        == 0
    )
    done = runner.invoke(
        app,
        [
            "data",
            "import",
            str(second),
            "--out",
            str(tmp_path / "s2"),
            *split,
            "--exclude-stream",
            str(stream),
        ],
    )
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["in_stream"] == 16 and json.loads(done.stdout)["imported"] == 24
    report = json.loads((tmp_path / "s2" / REPORT).read_text())
    assert schema_errors(report, "stream_import") == [] and len(report["in_stream_files"]) == 16
    assert all(f["source"].startswith("recrawl/again") for f in report["in_stream_files"])
    added = runner.invoke(app, ["stream", "add-phase", str(stream), "--shards", str(tmp_path / "s2")])
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["added"]["repeats_skipped"] == {"train": 0, "eval": 0, "gallery": 0}
    keys = [k for k, _ in stream_samples(stream)]
    assert len(keys) == len(set(keys)) == 64
    missing = runner.invoke(
        app, ["data", "import", str(second), "--out", str(tmp_path / "s3"), "--exclude-stream", str(tmp_path)]
    )
    assert missing.exit_code == 2 and "--exclude-stream" in missing.output and "stream.json" in missing.output


def test_a_compressed_shard_in_a_shards_folder_is_named_not_skipped(tmp_path: Path) -> None:
    import gzip

    drop = import_drop(tmp_path, "drop", 0)
    first = next((drop / "train").glob("*.tar"))
    (drop / "train" / "extra.tar.gz").write_bytes(gzip.compress(first.read_bytes()))
    result = runner.invoke(app, ["stream", "add-phase", str(tmp_path / "stream"), "--shards", str(drop)])
    assert result.exit_code == 2 and "compressed tar file(s) extra.tar.gz" in result.output, result.output
    assert not (tmp_path / "stream" / "stream.json").exists()


def test_synthetic_manifests_still_read_and_match_the_schema(tmp_path: Path) -> None:
    from compat.data.synth import generate_stream

    manifest = generate_stream(
        tmp_path / "s", phases=1, samples_per_phase=4, seed=1, eval_per_domain=2, gallery_per_domain=2
    )
    assert schema_errors(manifest, "stream") == [] and load_manifest(tmp_path / "s") == manifest
    generate_stream(
        tmp_path / "t", phases=2, samples_per_phase=4, seed=1, eval_per_domain=2, gallery_per_domain=2
    )  # its phase 1 holds samples that phase 0 of "s" does not
    entry = add_phase(
        tmp_path / "s", {s: phase_urls(tmp_path / "t", 1, s) for s in ("train", "eval", "gallery")}, "real"
    )
    manifest = load_manifest(tmp_path / "s")
    assert entry["phase"] == 1 and manifest["seed"] == 1 and schema_errors(manifest, "stream") == []
    bad = {**manifest, "image_size": "64"}
    (tmp_path / "s" / "stream.json").write_text(json.dumps(bad))
    with pytest.raises(StreamError, match="'image_size' must be an integer"):
        load_manifest(tmp_path / "s")
