"""Cost of the validation stage per 10k samples, against a raw tar read of the same shards.

Makes N captioned 64x64 JPEG samples (img2dataset layout) in a temp dir, then times:
  * baseline: a raw tar read (``tarfile``, every member's bytes); for reference, webdataset
    iteration without and with ``decode("pil")`` (what a training loader pays anyway);
  * ``validate_phase`` end to end, with its breakdown: pass 1 (tar read + checks; image decode
    separately), Great Expectations (both suites), pass 2 (re-read + writing accepted/quarantine).
The Great Expectations import (one-off per process) is reported on its own.

    .venv/bin/python benchmarks/validation.py [--samples 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import random
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sections import publish  # noqa: E402

WORDS = (
    "red green blue purple small large circle square triangle wedge disc above below left right of "
    "the a on black white striped outlined plain background near beside two three shapes"
).split()


def make_shards(directory: Path, samples: int, per_shard: int, seed: int = 0) -> list[Path]:
    """Write ``samples`` captioned 64x64 JPEGs (smooth random colour fields) into tar shards."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    words = random.Random(seed)
    paths = []
    for shard in range((samples + per_shard - 1) // per_shard):
        path = directory / f"shard-{shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
                key = f"p00-train-{i:06d}"
                low = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
                image = Image.fromarray(low).resize((64, 64), Image.BILINEAR)
                buffer = io.BytesIO()
                image.save(buffer, "JPEG", quality=90)
                jpg = buffer.getvalue()
                caption = " ".join(words.choice(WORDS) for _ in range(words.randint(4, 20)))
                meta = {
                    "key": key,
                    "caption": caption,
                    "width": 64,
                    "height": 64,
                    "status": "success",
                    "sha256": hashlib.sha256(jpg).hexdigest(),
                    "phase": 0,
                    "split": "train",
                }
                for name, data in (
                    (f"{key}.jpg", jpg),
                    (f"{key}.txt", caption.encode()),
                    (f"{key}.json", json.dumps(meta).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def raw_tar_read(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                total += len(tar.extractfile(member).read())
    return total


def webdataset_read(paths: list[Path], decode: bool) -> int:
    import webdataset as wds

    dataset = wds.WebDataset([str(p) for p in paths], shardshuffle=False)
    return sum(1 for _ in (dataset.decode("pil") if decode else dataset))


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "validation.md")
    args = parser.parse_args()
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import logging

    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        start = time.perf_counter()
        paths = make_shards(tmp / "in", args.samples, args.per_shard)
        make_s = time.perf_counter() - start
        size_mb = sum(p.stat().st_size for p in paths) / 1e6

        raw_s, _ = timed(lambda: raw_tar_read(paths), args.repeats)
        wds_raw_s, count = timed(lambda: webdataset_read(paths, decode=False), args.repeats)
        wds_s, decoded = timed(lambda: webdataset_read(paths, decode=True), args.repeats)
        assert count == decoded == args.samples

        start = time.perf_counter()
        import great_expectations  # noqa: F401  (one-off per process; validate_phase imports it lazily)

        gx_import_s = time.perf_counter() - start
        from components.data.validation import validate_phase

        validate_phase(str(tmp / "in" / "*.tar"), tmp / "warm", force=True)  # warm caches (GX registries)
        runs = []
        for i in range(args.repeats):
            start = time.perf_counter()
            summary = validate_phase(str(tmp / "in" / "*.tar"), tmp / f"out{i}", force=True)
            runs.append((time.perf_counter() - start, summary.timings))
            assert summary.total == args.samples and summary.passed == args.samples and not summary.blocked
        total_s, timings = sorted(runs, key=lambda r: r[0])[len(runs) // 2]

    scale = 10_000 / args.samples
    read_only = timings["read_and_check_s"] - timings["decode_s"] - timings["other_checks_s"]
    rows = [
        ("baseline: raw tar read (tarfile, all member bytes)", raw_s),
        ("reference: webdataset iteration (grouped samples, no decode)", wds_raw_s),
        ("reference: webdataset iteration + decode('pil')", wds_s),
        ("validate_phase, end to end", total_s),
        ("  pass 1: tar read and grouping", read_only),
        ("  pass 1: image decode (PIL, full decode)", timings["decode_s"]),
        ("  pass 1: caption UTF-8, metadata JSON + schema, tar safety", timings["other_checks_s"]),
        ("  Great Expectations (samples + phase suites)", timings["gx_s"]),
        ("  pass 2: re-read + write accepted/quarantine shards", timings["write_s"]),
    ]
    other = total_s - sum(timings[k] for k in ("read_and_check_s", "gx_s", "write_s"))
    rows.append(("  other (glob, fingerprint, summary, schema check)", max(other, 0.0)))
    lines = [
        "# Validation stage cost",
        "",
        f"{args.samples} samples (64x64 JPEG, caption, metadata JSON) in {len(paths)} shards, "
        f"{size_mb:.1f} MB; median of {args.repeats} runs; page cache warm. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end (the cores "
        f"are shared: figures scale with load). Generating the data took {make_s:.1f} s.",
        "",
        "| step | s per 10k samples | us per sample | x raw tar read |",
        "|---|---:|---:|---:|",
    ]
    for name, seconds in rows:
        per10k = seconds * scale
        lines.append(
            f"| {name} | {per10k:.3f} | {1e6 * seconds / args.samples:.0f} | {seconds / raw_s:.1f} |"
        )
    lines += [
        "",
        f"One-off per process: `import great_expectations` {gx_import_s:.1f} s (not in the figures above).",
        "",
        "Command: `.venv/bin/python benchmarks/validation.py"
        + (f" --samples {args.samples}" if args.samples != 10_000 else "")
        + "`",
        "",
    ]
    publish(args.out, lines)


if __name__ == "__main__":
    main()
