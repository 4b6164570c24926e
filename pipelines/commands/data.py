"""``compatflow data ...``: import captioned images into shards, the synthetic stream, stream info."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import echo_json, exit_codes, fail

data_app = typer.Typer(
    help="Captioned-image data: import images into img2dataset-layout tar shards, synthetic streams.",
    no_args_is_help=True,
)


def _stream(name: str, **limits: Any) -> Any:
    return typer.Option(help=f"Default: the config's stream.{name}.", **limits)


@data_app.command("generate")
@exit_codes()
def generate(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Output directory of the stream (created if missing).")],
    phases: Annotated[int | None, _stream("phases", min=1)] = None,
    samples_per_phase: Annotated[int | None, _stream("samples_per_phase", min=1)] = None,
    seed: Annotated[int | None, _stream("seed")] = None,
    eval_per_domain: Annotated[int | None, _stream("eval_per_domain", min=0)] = None,
    gallery_per_domain: Annotated[int | None, _stream("gallery_per_domain", min=0)] = None,
    image_size: Annotated[int | None, _stream("image_size", min=16)] = None,
    shift: Annotated[str | None, _stream("shift")] = None,
    old_word_share: Annotated[float | None, _stream("old_word_share", min=0.0, max=1.0)] = None,
    samples_per_shard: Annotated[int, typer.Option(min=1, help="Samples per tar shard.")] = 1000,
    workers: Annotated[int, typer.Option(min=1, help="Processes writing shards in parallel.")] = 1,
) -> None:
    """Write (or complete, or extend) a synthetic stream; print a summary of its manifest as JSON.
    A setting left out takes the config's default (pipelines/configs/local.yaml); a seed gives
    byte-identical shards."""
    from compat.data.synth import StreamError
    from components.deployment import StreamSection
    from pipelines.commands.stream import stream_summary
    from pipelines.config import generate_stream_of

    given = {k: v for k, v in ctx.params.items() if k in StreamSection.model_fields and v is not None}
    stream = StreamSection().model_copy(update=given)
    start = time.perf_counter()
    try:
        manifest = generate_stream_of(stream, out, samples_per_shard=samples_per_shard, workers=workers)
    except (StreamError, ValueError) as exc:
        fail(str(exc))
    echo_json({"out": str(out), "seconds": round(time.perf_counter() - start, 2), **stream_summary(manifest)})


# `data import`'s longer options, named here so that its signature reads as the list of its settings.
_Source = Annotated[
    Path,
    typer.Argument(
        help="A folder of images (x.jpg + x.txt captions, or class folders), a .csv/.parquet table or a "
        "Karpathy split .json (dataset_coco.json, dataset_flickr30k.json)."
    ),
]
_Format = Annotated[
    str,
    typer.Option(
        "--format",
        help="auto (a folder: sidecar, a .csv/.parquet file: table, a .json file: karpathy) | sidecar | "
        "class-folders | table | karpathy (keeps the file's splits: train+restval, test as eval, val as "
        "gallery).",
    ),
]
_Split = Annotated[
    str,
    typer.Option(
        help="train,eval,gallery fractions of the pictures (a seeded hash of each key; not for karpathy)."
    ),
]
_MaxSide = Annotated[
    int,
    typer.Option(
        min=16, help="img2dataset's --image_size: the size --resize-mode stores pictures at (never enlarged)."
    ),
]
_ResizeMode = Annotated[
    str,
    typer.Option(
        help="img2dataset's: keep_ratio (shorter side to --max-side) | center_crop (then the "
        "centre square) | border (longer side to --max-side, black borders) | no (as they are).",
    ),
]
_KeepOriginals = Annotated[
    bool,
    typer.Option(
        "--keep-originals",
        help="Also keep the untouched files (transparent ones unmatted), in shards of the same keys "
        "under OUT/originals/.",
    ),
]
_MaxPixels = Annotated[
    int,
    typer.Option(
        min=1,
        help="Pictures whose header declares more pixels are refused undecoded (image_pixels); at most "
        "Pillow's decompression-bomb limit, the default.",
    ),
]
_AllowOutside = Annotated[
    list[Path] | None,
    typer.Option(
        "--allow-outside",
        help="A folder outside SRC whose files may be read (table paths, symbolic links into it); "
        "repeatable. Without it every file read must be a regular file inside SRC.",
    ),
]
_ExcludeStream = Annotated[
    Path | None,
    typer.Option(
        "--exclude-stream",
        help="A stream folder (stream.json): pictures it already holds (same key) are left out and "
        "listed in import.json's in_stream_files.",
    ),
]


@data_app.command("import")
@exit_codes({0: "something was imported", 1: "nothing was imported"})
def import_(
    ctx: typer.Context,
    src: _Source,
    out: Annotated[
        Path, typer.Option("--out", help="Output folder: {train,eval,gallery}/*.tar and import.json.")
    ],
    source_format: _Format = "auto",
    template: Annotated[
        str, typer.Option(help="class-folders: the caption of each image, {label} being its folder's name.")
    ] = "a photo of a {label}",
    split: _Split = "0.8,0.1,0.1",
    seed: Annotated[int, typer.Option(help="Seed of the split hash.")] = 0,
    samples_per_shard: Annotated[int, typer.Option(min=1, help="Samples per tar shard.")] = 1000,
    key_prefix: Annotated[
        str, typer.Option(help="Prefix of every sample key (letters, digits, _ and -).")
    ] = "",
    path_column: Annotated[str, typer.Option(help="table: the column of image paths.")] = "path",
    caption_column: Annotated[str, typer.Option(help="table: the column of captions.")] = "caption",
    max_image_bytes: Annotated[
        int, typer.Option(min=1, help="Larger image files are refused (the validation policy's default).")
    ] = 32 * 1024 * 1024,
    max_side: _MaxSide = 512,
    resize_mode: _ResizeMode = "keep_ratio",
    keep_originals: _KeepOriginals = False,
    max_pixels: _MaxPixels = 178_956_970,
    allow_outside: _AllowOutside = None,
    exclude_stream: _ExcludeStream = None,
) -> None:
    """Turn images with captions into webdataset shards split train/eval/gallery; print import.json's counts.

    Deterministic (same input, same bytes) and resumable (a killed import, run again, writes only the
    shards still missing). The files or rows of one picture (same bytes) make one sample with every distinct
    caption; only exact repeats (same picture, same caption) are dropped and counted as duplicates; pictures
    --exclude-stream already holds are left out; every refused file is listed with its reason in
    OUT/import.json. Exit 0 when something was imported, 1 when nothing was.
    """
    from compat.data import importer  # imported here: the CLI starts without it

    start = time.perf_counter()
    exclude = _stream_keys(exclude_stream) if exclude_stream is not None else None
    given = {f.name: ctx.params[f.name] for f in dataclasses.fields(importer.ImportSettings)}  # its options
    try:
        given["source_format"] = importer.detect_format(src) if source_format == "auto" else source_format
        given["split"] = importer.parse_split(split)
        settings = importer.ImportSettings(**given)
        result = importer.import_images(
            src, out, settings, allow_outside=allow_outside or (), exclude=exclude
        )
    except importer.DataImportError as exc:
        fail(str(exc))
    echo_json({"out": str(result.out), "seconds": round(time.perf_counter() - start, 2), **result.summary()})
    if not result.imported:
        reasons = (
            ", ".join(f"{n} {r}" for r, n in result.report["refused_by_reason"].items()) or "no files found"
        )
        fail(
            f"nothing imported from {src} ({reasons}); "
            f"see {result.out / importer.REPORT} for every file's reason",
            code=1,
        )


def _stream_keys(stream_dir: Path) -> dict[str, str]:
    """The sample keys --exclude-stream's stream holds, each with its shard."""
    from compat.data.manifest import StreamError, stream_keys

    try:
        return stream_keys(stream_dir)
    except StreamError as exc:
        fail(f"--exclude-stream: {exc}")


@data_app.command("info")
@exit_codes({1: "shards are missing"})
def info(stream_dir: Annotated[Path, typer.Argument(help="Directory holding stream.json.")]) -> None:
    """Print phases, domains, shard and sample (picture) counts of a stream as JSON, with its captions per
    phase and split (a picture may carry several) and its vocabulary shift (per phase: new words, share of
    train captions in earlier words only); exit 1 if shards are missing."""
    from pipelines.commands.stream import show_stream

    show_stream(stream_dir, extra=_vocabulary(stream_dir))


def _vocabulary(stream_dir: Path) -> dict[str, Any]:
    """The stream's captions per phase and split, shift setting and measured vocabulary shift; empty when its
    shards cannot be read. Captions are counted shard by shard (nothing kept per sample)."""
    from compat.data.manifest import StreamError, load_manifest, missing_shards
    from compat.data.shards import ShardError
    from compat.data.shift import earlier_word_shares, iter_phase_captions

    try:
        manifest = load_manifest(stream_dir)
        if missing_shards(stream_dir, manifest):
            return {}
        rows = earlier_word_shares(stream_dir, manifest=manifest)
        captions = [
            {
                "phase": row["phase"],
                "train": row["captions"],
                **{
                    split: sum(1 for _ in iter_phase_captions(stream_dir, row["phase"], split, manifest))
                    for split in ("eval", "gallery")
                },
            }
            for row in rows
        ]
    except (StreamError, ShardError):
        return {}
    generator = manifest.get("generator", {})
    return {
        **({"shift": generator.get("shift", "disjoint")} if generator else {}),
        **({"old_word_share": generator["old_word_share"]} if "old_word_share" in generator else {}),
        "captions": captions,
        "vocabulary": rows,
    }


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
