"""``compatflow data ...``: generate the synthetic captioned-image stream and inspect streams."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import echo_json, fail

data_app = typer.Typer(
    help="Synthetic captioned-image streams (img2dataset-layout tar shards).", no_args_is_help=True
)
SPLITS = ("train", "eval", "gallery")


@data_app.command("generate")
def generate(
    out: Annotated[Path, typer.Option("--out", help="Output directory of the stream (created if missing).")],
    phases: Annotated[int, typer.Option(min=1, help="Number of phases (one domain each).")] = 5,
    samples_per_phase: Annotated[int, typer.Option(min=1, help="Train samples per phase.")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed; the same seed gives byte-identical shards.")] = 0,
    eval_per_domain: Annotated[int, typer.Option(min=0, help="Eval samples per phase.")] = 200,
    gallery_per_domain: Annotated[int, typer.Option(min=0, help="Gallery samples per phase.")] = 500,
    image_size: Annotated[int, typer.Option(min=16, help="Image side in pixels.")] = 64,
    samples_per_shard: Annotated[int, typer.Option(min=1, help="Samples per tar shard.")] = 1000,
    workers: Annotated[int, typer.Option(min=1, help="Processes writing shards in parallel.")] = 1,
) -> None:
    """Write (or complete, or extend) a synthetic stream; print a summary of its manifest as JSON."""
    import time

    from compat.data.synth import StreamError, generate_stream

    start = time.perf_counter()
    try:
        manifest = generate_stream(
            out,
            phases,
            samples_per_phase,
            seed,
            eval_per_domain=eval_per_domain,
            gallery_per_domain=gallery_per_domain,
            image_size=image_size,
            samples_per_shard=samples_per_shard,
            workers=workers,
        )
    except (StreamError, ValueError) as exc:
        fail(str(exc))
    echo_json({"out": str(out), "seconds": round(time.perf_counter() - start, 2), **_summary(manifest)})


@data_app.command("info")
def info(stream_dir: Annotated[Path, typer.Argument(help="Directory holding stream.json.")]) -> None:
    """Print phases, domains, shard and sample counts of a stream as JSON; exit 1 if shards are missing."""
    from compat.data.synth import StreamError, load_manifest

    try:
        manifest = load_manifest(stream_dir)
    except StreamError as exc:
        fail(str(exc))
    missing = [
        rel
        for p in manifest["phases"]
        for split in SPLITS
        for rel in p[split]
        if not (stream_dir / rel).is_file()
    ]
    echo_json({"dir": str(stream_dir), **_summary(manifest), "missing_shards": missing})
    if missing:
        raise typer.Exit(1)


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": manifest["seed"],
        "image_size": manifest["image_size"],
        "phases": [
            {
                "phase": p["phase"],
                "domain": p["domain"],
                "counts": p["counts"],
                "shards": {s: len(p[s]) for s in SPLITS},
            }
            for p in manifest["phases"]
        ],
    }


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
