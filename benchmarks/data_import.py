"""Throughput of `compatflow data import`, in items/s per core, against a raw tar read of the same data.

Writes N captioned images as a sidecar folder (``x.png|jpg`` + ``x.txt``, alternately PNG and JPEG) from
Fashion-MNIST when the Debian package ``dataset-fashion-mnist`` is installed (real 28x28 grayscale photos of
clothes, captioned "a photo of a <class>"), else from smooth random colour fields; once at the native size
and once upscaled to 224x224 RGB (a CLIP-sized photo). Then, per data set, median of the repeats:

  * baseline: a raw tar read (``tarfile``, every member's bytes) of the shards the import wrote;
  * reference: reading every source file's bytes (the least any import does);
  * ``import_images`` end to end, and its two passes: the scan (read, SHA-256, full decode check, caption)
    and the writes (re-read, verify, tar shards, import.json);
  * a re-run on the finished import (a rescan that writes nothing).

The import runs in one process: items per CPU-second is the per-core figure, whatever the load.

    .venv/bin/python benchmarks/data_import.py [--samples 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.validation import raw_tar_read  # noqa: E402


def source_images(samples: int):
    """``samples`` (uint8 HxW array, caption) pairs and the name of their source."""
    import numpy as np

    from benchmarks.fashion_mnist import DEFAULT_DIR, LABELS, FashionMNISTMissing, load_split

    try:
        pixels, classes = load_split(DEFAULT_DIR, "train")
    except FashionMNISTMissing:
        pass
    else:
        pairs = [(255 - pixels[i], f"a photo of a {LABELS[classes[i]]}") for i in range(samples)]
        return pairs, "Fashion-MNIST (dataset-fashion-mnist), 28x28 grayscale"
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 256, (28, 28), dtype=np.uint8), f"random field {i}") for i in range(samples)]
    return pairs, "random 28x28 grayscale fields (dataset-fashion-mnist not installed)"


def write_folder(folder: Path, pairs, size: int | None) -> int:
    """The sidecar folder: even items PNG, odd JPEG; ``size`` upscales to size x size RGB. Returns bytes."""
    from PIL import Image

    folder.mkdir(parents=True)
    for i, (pixels, caption) in enumerate(pairs):
        image = Image.fromarray(pixels)
        if size is not None:
            image = image.resize((size, size), Image.BICUBIC).convert("RGB")
        image.save(folder / f"{i:06d}.{'png' if i % 2 == 0 else 'jpg'}")
        (folder / f"{i:06d}.txt").write_text(caption + "\n")
    return sum(p.stat().st_size for p in folder.iterdir())


def raw_file_read(folder: Path) -> int:
    return sum(len(p.read_bytes()) for p in sorted(folder.iterdir()))


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of ``repeats`` calls, and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), result


def measure(tmp: Path, name: str, pairs, size: int | None, repeats: int) -> dict:
    from compat.data.importer import ImportSettings, import_images

    folder = tmp / f"{name}-src"
    source_bytes = write_folder(folder, pairs, size)
    settings = ImportSettings(samples_per_shard=1000)
    runs = []
    for r in range(repeats):
        out = tmp / f"{name}-out{r}"
        wall, cpu = time.perf_counter(), time.process_time()
        result = import_images(folder, out, settings, progress=False)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu, result))
        assert result.imported == len(pairs), result.report["refused_by_reason"]
    wall, cpu, result = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    out = result.out
    shards = sorted(out.rglob("*.tar"))
    raw_s, raw_cpu, _ = timed(lambda: raw_tar_read(shards), repeats)
    src_s, src_cpu, _ = timed(lambda: raw_file_read(folder), repeats)
    rerun_s, rerun_cpu, rerun = timed(lambda: import_images(folder, out, settings, progress=False), repeats)
    assert rerun.written_shards == 0
    for r in range(repeats):
        shutil.rmtree(tmp / f"{name}-out{r}")
    t = result.timings
    return {
        "name": name,
        "n": len(pairs),
        "source_mb": source_bytes / 1e6,
        "shards": len(shards),
        "rows": [
            ("baseline: raw tar read of the written shards (tarfile, all member bytes)", raw_s, raw_cpu),
            ("reference: read every source file's bytes", src_s, src_cpu),
            ("import_images, end to end", wall, cpu),
            ("  scan: read, SHA-256, full decode check, caption", t["scan_s"], t["scan_cpu_s"]),
            ("  write: re-read, verify, tar shards, import.json", t["write_s"], t["write_cpu_s"]),
            ("re-run on the finished import (rescan, nothing written)", rerun_s, rerun_cpu),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--large-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_import.md")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    pairs, source = source_images(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            measure(Path(tmp), "native", pairs, None, args.repeats),
            measure(Path(tmp), "large", pairs, args.large_size, args.repeats),
        ]
    lines = [
        f"{args.samples} captioned images from {source}, as a sidecar folder (x.png|jpg + x.txt, half "
        f"PNG, half JPEG), imported into shards of 1000 samples split 0.8/0.1/0.1; median of {args.repeats} "
        "runs, page cache warm. One process: items per CPU-second is the per-core rate. Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end (the cores are "
        "shared: wall-clock figures scale with load, CPU-second figures much less, so the ratios are taken "
        "on CPU time).",
    ]
    for res in results:
        n = res["n"]
        raw_cpu = res["rows"][0][2]
        label = (
            "native 28x28 grayscale"
            if res["name"] == "native"
            else f"upscaled to {args.large_size}x" + (f"{args.large_size} RGB")
        )
        lines += [
            "",
            f"## {label}: {n} images, {res['source_mb']:.1f} MB of source files, {res['shards']} shards",
            "",
            "| step | items per CPU-second (per core) | CPU us per item | x raw tar read (CPU) "
            "| items/s (wall) |",
            "|---|---:|---:|---:|---:|",
        ]
        for step, wall, cpu in res["rows"]:
            lines.append(
                f"| {step} | {n / max(cpu, 1e-9):,.0f} | {1e6 * cpu / n:.0f} | {cpu / raw_cpu:.1f} | "
                f"{n / wall:,.0f} |"
            )
        end_to_end = res["rows"][2][2]
        lines += [
            "",
            f"Import on one core: {n / end_to_end:,.0f} items/s, {end_to_end / raw_cpu:.1f}x the CPU time "
            "of a raw tar read of the shards it wrote.",
        ]
    lines += [
        "",
        "Command: `.venv/bin/python benchmarks/data_import.py"
        + (f" --samples {args.samples}" if args.samples != 4000 else "")
        + "`",
        "",
    ]
    from benchmarks.sections import write_section

    print(write_section(args.out, "data-import", "\n".join(lines), "Data import throughput"))


if __name__ == "__main__":
    main()
