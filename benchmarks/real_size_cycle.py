"""The phase-0 cycle on real-size pictures against the same pictures pre-resized and the synthetic stream.

A user's first drop: a folder of camera-size pictures with sidecar captions, imported with the defaults
(``compatflow data import``: stored at ``--max-side 512``), added as phase 0 of a stream and run through
``compatflow run`` on the local config (validate, drift, train CLIP_0, evaluate, register, index, serve).
Beside it in the same run: the same pictures pre-resized to 256 px (short side) before import, and the
synthetic stream's phase 0 (``make run``'s default). Every figure per step is the step's own record
(``<run>/usage/step-*.json``: wall, CPU, peak RSS of the step's process); import and the whole ``compatflow
run`` are timed as processes (``/usr/bin/time -f %M``).

Pictures: Fashion-MNIST's photos (Debian's ``dataset-fashion-mnist``, no download) upscaled bicubic:
4000x3000 JPEG q90 (12 MP) and every fifth 4000x6000 PNG (24 MP), plus ``--huge`` 10000x10000 pictures
(100 MP; half PNG, half JPEG). Captions name the class. The generated folder is kept in ``--cache`` for the
next run. The table goes into ``benchmarks/results/data_import.md`` between markers.

    .venv/bin/python benchmarks/real_size_cycle.py [--images 1000] [--huge 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fashion_mnist import DEFAULT_DIR, LABELS, load_split  # noqa: E402
from benchmarks.large_images import timed  # noqa: E402
from components.runs import read_usage  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "data_import.md"
CLI = str(Path(sys.executable).with_name("compatflow"))
PRE_RESIZED_SIDE = 256
RSS_GOAL_MIB = 2048


def _picture(i: int, size: tuple[int, int], path: Path, small: Path) -> None:
    """Fashion-MNIST photo ``i`` upscaled to ``size`` at ``path``, and its 256 px short-side copy at
    ``small`` (same format), with the caption file beside each."""
    from PIL import Image

    images, labels = load_split(DEFAULT_DIR, "t10k")
    picture = Image.fromarray(images[i % len(images)]).convert("RGB").resize(size, Image.Resampling.BICUBIC)
    scale = PRE_RESIZED_SIDE / min(size)
    reduced = picture.resize((round(size[0] * scale), round(size[1] * scale)), Image.Resampling.BOX)
    for target, image in ((path, picture), (small, reduced)):
        if target.suffix == ".jpg":
            image.save(target, quality=90)
        else:
            image.save(target, compress_level=1)
        target.with_suffix(".txt").write_text(f"a photo of a {LABELS[labels[i % len(labels)]]}")


def make_sources(cache: Path, n: int, huge: int) -> tuple[Path, Path]:
    """The real-size folder and its pre-resized twin (made once per ``n``/``huge``, then reused)."""
    real, small = cache / f"real-{n}-{huge}", cache / f"small-{n}-{huge}"
    done = cache / f"done-{n}-{huge}"
    if done.is_file():
        return real, small
    shutil.rmtree(real, ignore_errors=True)
    shutil.rmtree(small, ignore_errors=True)
    real.mkdir(parents=True)
    small.mkdir(parents=True)
    jobs = []
    for i in range(n):
        if i < huge:
            size, ext = (10000, 10000), (".png" if i % 2 == 0 else ".jpg")
        elif i % 5 == 4:
            size, ext = (4000, 6000), ".png"
        else:
            size, ext = (4000, 3000), ".jpg"
        jobs.append((i, size, real / f"{i:05d}{ext}", small / f"{i:05d}{ext}"))
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_picture, *zip(*jobs, strict=True), chunksize=8))
    done.write_text(json.dumps({"images": n, "huge": huge}))
    return real, small


def cycle(name: str, work: Path, source: Path | None, steps: int | None) -> dict:
    """Import ``source`` (None: the synthetic stream), add it as phase 0 and run the cycle once."""
    ws, stream = work / name / "ws", work / name / "stream"
    config = yaml.safe_load((ROOT / "pipelines" / "configs" / "local.yaml").read_text())
    config["workspace"] = str(ws)
    config["stream"]["uri"] = str(stream)
    config["stream"]["phases"] = 1
    if steps:
        config["training"]["steps"] = steps
    row: dict = {"name": name}
    if source is not None:
        shards = work / name / "shards"
        row["import_s"], peak, _ = timed([CLI, "data", "import", str(source), "--out", str(shards)])
        row["import_rss"] = peak / 2**20
        row["import"] = json.loads((shards / "import.json").read_text())
        timed([CLI, "stream", "add-phase", str(stream), "--shards", str(shards), "--domain", name])
        config["stream"]["generate_if_missing"] = False
    config_file = work / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    row["run_s"], peak, _ = timed([CLI, "run", "--config", str(config_file)])
    row["run_rss"] = peak / 2**20
    (run_dir,) = (p for p in (ws / "runs").iterdir() if (p / "usage").is_dir())
    row["steps"] = {u["step"]: u for u in read_usage(run_dir)}  # in the order the steps ended
    metrics = next(run_dir.rglob("metrics.json"))
    row["median_step_s"] = json.loads(metrics.read_text())["training"]["median_step_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--huge", type=int, default=10, help="how many of them are 100-megapixel pictures")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: local.yaml's)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "compatflow-real-size")
    args = parser.parse_args()
    if not DEFAULT_DIR.is_dir():
        sys.exit(f"{DEFAULT_DIR} is missing: apt-get install -y dataset-fashion-mnist")
    start = time.perf_counter()
    real, small = make_sources(args.cache, args.images, args.huge)
    print(f"sources ready in {time.perf_counter() - start:.0f} s: {real}, {small}", flush=True)
    with tempfile.TemporaryDirectory(prefix="real-size-cycle-") as tmp:
        rows = []
        for name, source in (("synthetic", None), ("pre-resized", small), ("real-size", real)):
            rows.append(cycle(name, Path(tmp), source, args.steps))
            print(f"{name}: run {rows[-1]['run_s']:.0f} s", flush=True)
    write(args, real, rows)


def _mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir()) / 2**20


def write(args: argparse.Namespace, real: Path, rows: list[dict]) -> None:
    synthetic, small, big = rows
    command = f"--images {args.images} --huge {args.huge}" + (f" --steps {args.steps}" if args.steps else "")
    load = os.getloadavg()
    steps = list(big["steps"])
    lines = [
        "## The phase-0 cycle on real-size pictures",
        "",
        f"Command: `.venv/bin/python benchmarks/real_size_cycle.py {command}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load "
        f"average {load[0]:.1f} / {load[1]:.1f} at the end.  ",
        f"Data: {args.images} pictures, {_mib(real) / 1024:.2f} GiB: Fashion-MNIST photos "
        "(dataset-fashion-mnist) upscaled bicubic to 4000x3000 JPEG q90 (12 MP), every fifth to a "
        "4000x6000 PNG (24 MP), the first "
        f"{args.huge} to 10000x10000 (100 MP, PNG and JPEG in turn); pre-resized: the same pictures at "
        "256 px short side. Both imported with the defaults (`--max-side 512`), phase 0 of their own stream, "
        "`compatflow run` on pipelines/configs/local.yaml (cf-tiny, batches of 64). Synthetic: the "
        "generated stream's phase 0 (2,000 pairs at 64 px; its generation is inside its run). Per step: the "
        "step's own record (`usage/step-*.json`).",
        "",
        "| | synthetic | pre-resized 256 px | real size | real / pre-resized |",
        "|---|---:|---:|---:|---:|",
    ]

    def pair(label: str, key: str, fmt: str = "{:.1f}") -> None:
        a, b, c = (r.get(key) for r in rows)
        ratio = f"{c / b:.2f}x" if b else "-"
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b, c)]
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio} |")

    pair("import wall s", "import_s")
    pair("import peak RSS MiB", "import_rss", "{:.0f}")
    pair("`compatflow run` wall s", "run_s")
    pair("training median s per step", "median_step_s", "{:.3f}")
    for step in steps:
        for label, key, fmt in (("wall s", "wall_s", "{:.1f}"), ("peak RSS MiB", "peak_rss_mib", "{:.0f}")):
            values = [r["steps"].get(step, {}).get(key) for r in rows]
            ratio = f"{values[2] / values[1]:.2f}x" if values[1] and values[2] else "-"
            cells = [fmt.format(v) if v is not None else "-" for v in values]
            lines.append(f"| {step}: {label} | {' | '.join(cells)} | {ratio} |")
    peak_step = max(steps, key=lambda s: big["steps"][s].get("peak_rss_mib") or 0)
    peak = big["steps"][peak_step]["peak_rss_mib"]
    cycle_ratio = big["run_s"] / small["run_s"]
    step_ratio = big["median_step_s"] / synthetic["median_step_s"]
    whole = (big["run_s"] + big["import_s"]) / (small["run_s"] + small["import_s"])
    lines += [
        "",
        f"Goals: the cycle within 1.5x of the pre-resized pictures' - {cycle_ratio:.2f}x "
        f"({'met' if cycle_ratio <= 1.5 else 'not met'}; with the import {whole:.2f}x); steady-state "
        f"training within 1.2x of the synthetic stream's step time - {step_ratio:.2f}x "
        f"({'met' if step_ratio <= 1.2 else 'not met'}); every step's peak RSS at most {RSS_GOAL_MIB} MiB - "
        f"largest {peak:.0f} MiB ({peak_step}; import {big['import_rss']:.0f} MiB) "
        f"({'met' if max(peak, big['import_rss']) <= RSS_GOAL_MIB else 'not met'}). Imported: "
        f"{big['import']['imported']} of {args.images}, refused {len(big['import']['refused_files'])}.",
    ]
    from benchmarks.sections import write_section

    print(write_section(RESULTS, "real-size-cycle", "\n".join(lines), "Data import throughput"))


if __name__ == "__main__":
    main()
