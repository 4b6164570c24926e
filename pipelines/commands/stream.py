"""``compatflow stream ...``: append a phase of shards to a stream (``stream.json``) and show a stream."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from compat.data.manifest import SPLITS
from pipelines.commands._common import echo_json, exit_codes, fail, refusing

stream_app = typer.Typer(
    help="Data streams: the phases a scheduled run picks up (stream.json, schemas/stream.schema.json).",
    no_args_is_help=True,
)
SplitOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="This split's shards: a folder of .tar files, a glob or a brace pattern (repeatable); "
        "overrides the split's folder under --shards."
    ),
]


COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


def split_shards(shards: Path | None, specs: dict[str, list[str] | None]) -> tuple[dict[str, list[str]], str]:
    """Each split's local tar paths from ``--shards DIR`` (``DIR/{train,eval,gallery}/*.tar``) and the
    per-split options; a folder holding tar files directly must name its split with ``--train`` etc."""
    from compat.data.loader import LoaderError, expand_urls
    from compat.data.shards import is_local

    found: dict[str, list[str]] = {s: [] for s in SPLITS}
    if shards is not None:
        if not shards.is_dir():
            fail(f"--shards {shards} is not a folder")
        present = [s for s in SPLITS if (shards / s).is_dir()]
        if not present and not any(specs.values()):
            loose = sorted(shards.glob("*.tar"))
            if loose:
                names = [p.name for p in loose]
                train = names[0] if len(names) < 4 else f"{{{loose[0].stem}..{loose[-3].stem}}}.tar"
                example = (
                    f"--train '{shards}/{train}' --eval '{shards}/{names[-2]}' "
                    f"--gallery '{shards}/{names[-1]}'"
                    if len(names) >= 3
                    else "--train DIR_OR_GLOB --eval DIR_OR_GLOB --gallery DIR_OR_GLOB"
                )
                fail(
                    f"{shards} holds {len(loose)} tar shards directly (an img2dataset output folder?) and no "
                    f"train/eval/gallery folders: say which split each part is, e.g. {example} "
                    "(or `compatflow data import` the images to split them)"
                )
            fail(
                f"{shards} has no train/eval/gallery folders of .tar shards; a folder of images is imported "
                f"first: `compatflow data import {shards} --out SHARDS`, then `--shards SHARDS`"
            )
        for split in present:
            found[split] = sorted(str(p) for p in (shards / split).glob("*.tar"))
            packed = sorted(p.name for p in (shards / split).iterdir() if p.name.endswith(COMPRESSED_TARS))
            if packed:
                fail(
                    f"{shards / split} holds compressed tar file(s) {', '.join(packed[:5])}: --shards takes "
                    "uncompressed .tar shards only; decompress them there (gunzip) and add the phase again"
                )
    for split, spec in specs.items():
        if spec:
            try:
                urls = expand_urls(spec)
            except LoaderError as exc:
                fail(f"--{split}: {exc}")
            remote = [u for u in urls if not is_local(u)]
            if remote:
                fail(f"--{split}: {remote[0]} is not a local path; copy remote shards here first")
            found[split] = urls
    return found, str(shards.resolve()) if shards is not None else ""


@stream_app.command("add-phase")
@exit_codes()
def add_phase(
    stream_dir: Annotated[
        Path, typer.Argument(help="Stream folder (created, with its stream.json, if missing).")
    ],
    shards: Annotated[
        Path | None,
        typer.Option(help="A folder with train/, eval/ and gallery/ sub-folders of .tar shards (an import)."),
    ] = None,
    train: SplitOpt = None,
    eval_: Annotated[
        list[str] | None, typer.Option("--eval", help="The eval split's shards (as --train).")
    ] = None,
    gallery: Annotated[
        list[str] | None, typer.Option(help="The gallery split's shards (as --train).")
    ] = None,
    domain: Annotated[
        str | None, typer.Option(help="The phase's name in reports (default: the --shards folder's name).")
    ] = None,
    description: Annotated[str, typer.Option(help="A sentence on what the phase holds.")] = "",
    in_place: Annotated[
        bool,
        typer.Option(
            help="List the shards where they are instead of linking them into STREAM_DIR/phase-PP/."
        ),
    ] = False,
) -> None:
    """Append the next phase: every shard read to its end (counts computed, unreadable shards refused),
    samples the stream already holds (same key, same picture) left out and counted (repeats_skipped),
    shards hard-linked (or copied, or rewritten without repeats) into STREAM_DIR/phase-PP/, stream.json
    replaced atomically. Refused when nothing new remains or a key is reused for other picture bytes."""
    from compat.data.manifest import StreamError
    from compat.data.manifest import add_phase as append

    if shards is None and not (train or eval_ or gallery):
        fail(
            "give --shards DIR (train/eval/gallery folders) or the splits' shards with "
            "--train/--eval/--gallery"
        )
    found, source = split_shards(shards, {"train": train, "eval": eval_, "gallery": gallery})
    name = domain if domain is not None else (shards.resolve().name if shards is not None else "")
    with refusing(StreamError):
        entry = append(
            stream_dir,
            found,
            name or f"phase-{_next_phase(stream_dir):02d}",
            description=description,
            source=source,
            in_place=in_place,
        )
    manifest = str(stream_dir / "stream.json")
    echo_json({"stream": str(stream_dir), "added": _phase_summary(entry), "manifest": manifest})


def _next_phase(stream_dir: Path) -> int:
    from compat.data.manifest import StreamError, load_manifest, manifest_path

    if not manifest_path(stream_dir).is_file():
        return 0
    with refusing(StreamError):
        return len(load_manifest(stream_dir)["phases"])


def _phase_summary(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": entry["phase"],
        "domain": entry["domain"],
        "counts": entry.get("counts"),
        **({"repeats_skipped": entry["repeats_skipped"]} if "repeats_skipped" in entry else {}),
        "shards": {s: len(entry[s]) for s in SPLITS},
        **{k: entry[k] for k in ("source", "added") if k in entry},
    }


def stream_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """A stream's seed and image size (when it has them) and each phase's counts and shards."""
    return {
        **{k: manifest[k] for k in ("seed", "image_size") if k in manifest},
        "phases": [_phase_summary(p) for p in manifest["phases"]],
    }


def show_stream(stream_dir: Path, extra: dict[str, Any] | None = None) -> None:
    """Print a stream's phases, missing shards and ``extra`` fields as JSON; exit 1 if a shard is missing."""
    from compat.data.manifest import StreamError, load_manifest, missing_shards

    with refusing(StreamError):
        manifest = load_manifest(stream_dir)
    missing = missing_shards(stream_dir, manifest)
    echo_json(
        {"dir": str(stream_dir), **stream_summary(manifest), "missing_shards": missing, **(extra or {})}
    )
    if missing:
        raise typer.Exit(1)


@stream_app.command("show")
@exit_codes({1: "shards are missing"})
def show(stream_dir: Annotated[Path, typer.Argument(help="Stream folder (holds stream.json).")]) -> None:
    """Print the stream's phases, domains, sample and shard counts as JSON; exit 1 if shards are missing."""
    show_stream(stream_dir)


def register(app: typer.Typer) -> None:
    app.add_typer(stream_app, name="stream")
