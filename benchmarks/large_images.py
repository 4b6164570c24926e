"""Real-size pictures through import and the training loader: today's full decode against the bounded decode
path and the decoded-sample cache, side by side in one run.

Pictures are generated from Debian's Fashion-MNIST (``apt-get install -y dataset-fashion-mnist``): each
28x28 photo upscaled (bicubic) to a 4000x3000 (12 MP) JPEG, every fifth to a 3000x2000 (6 MP) PNG,
captioned with its class. They are imported twice, as they are (``--resize-mode no``, what import did before)
and with the default resize (``--max-side 512 --resize-mode keep_ratio``), and each shard set is read for
``--epochs`` epochs through ``ShardStream`` + cf-tiny's training transform, in a fresh process per loader
(peak RSS by ``/usr/bin/time -f %M``). The table goes into ``benchmarks/results/loader.md`` between markers.

    .venv/bin/python benchmarks/large_images.py [--images 60] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fashion_mnist import DEFAULT_DIR, LABELS, load_split  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "loader.md"
LOADERS = {
    "today": {"image_size": None, "cache": False, "what": "full decode (the loader before bounded decoding)"},
    "bounded": {"image_size": 64, "cache": False, "what": "decoded to the model input (JPEG draft)"},
    "bounded+cache": {"image_size": 64, "cache": True, "what": "decoded to the model input, then cached"},
}


def make_source(out: Path, n: int) -> None:
    """``n`` captioned pictures from Fashion-MNIST's test file, upscaled (see the module doc)."""
    from PIL import Image

    images, labels = load_split(DEFAULT_DIR, "t10k")  # the checked IDX reader
    out.mkdir(parents=True)
    for i in range(n):
        picture = Image.fromarray(images[i]).convert("RGB")
        if i % 5 == 4:
            picture.resize((3000, 2000), Image.Resampling.BICUBIC).save(out / f"{i:05d}.png")
        else:
            picture.resize((4000, 3000), Image.Resampling.BICUBIC).save(out / f"{i:05d}.jpg", quality=90)
        (out / f"{i:05d}.txt").write_text(f"a photo of a {LABELS[labels[i]]}")


def timed(command: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of ``command`` run under ``/usr/bin/time -f %M``; a command
    that fails ends the benchmark with its output's tail."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *command], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    peak_kb = int(re.findall(r"^(\d+)$", proc.stderr, re.M)[-1])
    return time.perf_counter() - start, peak_kb * 1024, proc.stdout


def worker(shards: str, loader: str, epochs: int) -> None:
    """Read ``shards`` for ``epochs`` epochs through one loader; print seconds and CPU seconds per epoch."""
    from compat.data.cache import SampleCache
    from compat.data.loader import ShardStream
    from compat.models import build_model

    spec = LOADERS[loader]
    bundle = build_model("cf-tiny")
    cache = SampleCache() if spec["cache"] else None
    epochs_out = []
    for epoch in range(epochs):
        stream = ShardStream(shards, shuffle_shards=False, image_size=spec["image_size"], cache=cache)
        wall, cpu, n = time.perf_counter(), time.process_time(), 0
        for sample in stream:
            bundle.preprocess_train(sample.image)
            n += 1
        epochs_out.append(
            {"epoch": epoch, "n": n, "s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        )
    print(json.dumps(epochs_out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("SHARDS", "LOADER", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    if not DEFAULT_DIR.is_dir():
        sys.exit(f"{DEFAULT_DIR} is missing: apt-get install -y dataset-fashion-mnist")
    python, cli = sys.executable, str(Path(sys.executable).with_name("compatflow"))
    rows_import, rows_loader = [], []
    with tempfile.TemporaryDirectory(prefix="large-images-") as tmp:
        src = Path(tmp) / "src"
        make_source(src, args.images)
        source_mb = sum(f.stat().st_size for f in src.iterdir()) / 2**20
        imports = {"as they are (--resize-mode no)": ["--resize-mode", "no"], "default (--max-side 512)": []}
        outs = {}
        for name, extra in imports.items():
            out = Path(tmp) / f"out-{len(outs)}"
            split = ["--split", "1,0,0"]
            wall, peak, _ = timed([cli, "data", "import", str(src), "--out", str(out), *split, *extra])
            report = json.loads((out / "import.json").read_text())
            mb = sum(f.stat().st_size for f in (out / "train").glob("*.tar")) / 2**20
            rows_import.append((name, report["imported"], report.get("resized", 0), wall, peak, mb))
            outs[name] = str(out / "train" / "*.tar")
        for name, shards in outs.items():
            for loader in LOADERS:
                _, peak, stdout = timed([python, __file__, "--worker", shards, loader, str(args.epochs)])
                rows_loader.append((name, loader, json.loads(stdout), peak))
    write(args, source_mb, rows_import, rows_loader)


def write(args: argparse.Namespace, source_mb: float, rows_import: list, rows_loader: list) -> None:
    load = os.getloadavg()
    lines = [
        "## Real-size pictures: import resize, bounded decode, decoded-sample cache",
        "",
        "Command: `.venv/bin/python benchmarks/large_images.py "
        f"--images {args.images} --epochs {args.epochs}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"shared with other work while it ran (load average {load[0]:.1f} / {load[1]:.1f} at the end): "
        "wall figures scale with load, CPU-second figures much less.  ",
        f"Data: {args.images} generated pictures, {source_mb:.1f} MiB: Fashion-MNIST photos "
        "(dataset-fashion-mnist) upscaled bicubic to 4000x3000 JPEG q90 (12 MP), every fifth to a 3000x2000 "
        "PNG (6 MP); the model input is cf-tiny's 64 px. Import figures include the CLI's start-up (~1 s). "
        "Each loader runs in its own process (peak RSS: `/usr/bin/time -f %M`, the process "
        "whole, model included); per epoch: every sample decoded and through cf-tiny's training transform.",
        "",
        "| import | imported | resized | wall s | images/s (wall) | peak RSS MiB | shards MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n, resized, wall, peak, mb in rows_import:
        lines.append(
            f"| {name} | {n} | {resized} | {wall:.1f} | {n / wall:.1f} | {peak / 2**20:.0f} | {mb:.1f} |"
        )
    lines += [
        "",
        "| shards | loader | epoch 1 samples/s | later epochs samples/s | later epochs samples per CPU-s | "
        "x today (later epochs, CPU) | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base: dict[str, float] = {}
    for shards, loader, epochs, peak in rows_loader:
        first, later = epochs[0], epochs[1:] or epochs
        n = sum(e["n"] for e in later)
        rate, per_cpu = n / sum(e["s"] for e in later), n / max(sum(e["cpu_s"] for e in later), 1e-9)
        base.setdefault(shards, per_cpu)
        lines.append(
            f"| {shards} | {loader}: {LOADERS[loader]['what']} | {first['n'] / first['s']:,.0f} | "
            f"{rate:,.0f} | {per_cpu:,.0f} | {per_cpu / base[shards]:.1f}x | {peak / 2**20:.0f} |"
        )
    from benchmarks.sections import write_section

    title = "Synthetic stream generation and shard loader throughput"
    print(write_section(RESULTS, "large-images", "\n".join(lines), title))


if __name__ == "__main__":
    main()
