"""Synthetic-stream generation speed and shard-loader throughput, against raw tar reads of the same shards.

Generates a stream (five phases, one domain each, train split only) in a temp dir, timing
``generate_stream`` on one and on two processes, then reads its train shards with:
  * baseline: a raw ``tarfile`` read (every member's bytes), and the same read plus PIL decoding of
    each image and ``json.loads`` of each metadata member (the decode work with no framework);
  * ``ShardStream`` (tarfile + webdataset key grouping and decoder) and, for reference, a plain
    ``webdataset.WebDataset(..., shardshuffle=False).decode("pil")``;
  * ``iter_batches`` (images to tensors, open_clip BPE tokenizer, batch 256);
  * training batches as ``ShardBatchSource`` makes them (cf-tiny's open_clip training transform at 64 px,
    its BPE tokenizer, batch 256, one pass, no cache), decoded in this process and in 1, 2, ...
    ``--workers`` worker processes, against the loader before parallel decoding (read from git at
    ``--baseline-commit``), with a check that every loader yields the same batches;
  * resuming mid-shard: time to the first sample after skipping half a shard undecoded, against
    reaching the same point by decoding the skipped samples.
Each figure is the median of ``--repeats`` runs. Writes ``benchmarks/results/loader.md``.

    .venv/bin/python benchmarks/loader.py [--samples 10000] [--repeats 3] [--workers 0 1 2]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.baseline import module_at  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "loader.md"
BASELINE_COMMIT = "c0a8a6720c73662c8295a845983db17568438e5b"  # compat/data/loader.py before parallel decoding
PHASES = 5


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def own_cpu_seconds() -> float:
    """User + system CPU time of this process alone."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Median wall seconds, median CPU seconds and the last result of ``repeats`` calls of ``fn``."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        start, cpu = time.perf_counter(), cpu_seconds()
        result = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(cpu_seconds() - cpu)
    return statistics.median(walls), statistics.median(cpus), result


def raw_tar_read(urls: list[str]) -> int:
    keys = set()
    for url in urls:
        with tarfile.open(url, "r|") as tar:
            for info in tar:
                if info.isreg():
                    tar.extractfile(info).read()
                    keys.add(info.name.split(".", 1)[0])
    return len(keys)


def raw_tar_decode(urls: list[str]) -> int:
    from PIL import Image

    n = 0
    for url in urls:
        with tarfile.open(url, "r|") as tar:
            for info in tar:
                if not info.isreg():
                    continue
                data = tar.extractfile(info).read()
                ext = info.name.rsplit(".", 1)[-1]
                if ext == "jpg":
                    Image.open(io.BytesIO(data)).convert("RGB").load()
                    n += 1
                elif ext == "json":
                    json.loads(data)
                elif ext == "txt":
                    data.decode("utf-8")
    return n


def shard_stream(urls: list[str]) -> int:
    from compat.data.loader import ShardStream

    return sum(1 for _ in ShardStream(urls, shuffle_shards=True, seed=0))


def webdataset_plain(urls: list[str]) -> int:
    import webdataset as wds

    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None).decode("pil")
    return sum(1 for _ in dataset)


def batches(urls: list[str]) -> int:
    import numpy as np
    import open_clip
    import torch

    from compat.data.loader import ShardStream, iter_batches

    def to_tensor(image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)

    stream = ShardStream(urls, seed=0)
    return sum(len(b.keys) for b in iter_batches(stream, 256, to_tensor, open_clip.tokenize, "random"))


def train_steps(urls: list[str], loader: Any, bundle: Any, workers: int, steps: int, batch: int) -> int:
    """``steps`` optimizer steps of ``bundle``'s model (CLIP loss, AdamW) on batches from ``loader`` with
    ``workers`` decoding processes: decoding overlaps the model's work only when it runs elsewhere."""
    import torch
    import torch.nn.functional as F

    model = bundle.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = loader.ShardStream(
        urls, seed=0, epochs=None, image_size=bundle.image_size, **({"workers": workers} if workers else {})
    )
    batches = loader.iter_batches(stream, batch, bundle.preprocess_train, bundle.tokenizer, "random")
    done = 0
    for b in batches:
        out = model(b.images, b.texts)
        image, text, scale = (
            (out["image_features"], out["text_features"], out["logit_scale"])
            if isinstance(out, dict)
            else out[:3]
        )
        logits = scale * image @ text.T
        labels = torch.arange(len(b.keys))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done += len(b.keys)
        if done >= steps * batch:
            batches.close()
            return done
    return done


def train_batches(
    urls: list[str], loader: Any, bundle: Any, workers: int, digest: Any = None, pixels: Any = None
) -> int:
    """One pass of training batches (batch 256, cf-tiny's training transform and tokenizer) from ``loader``
    (a loader module) with ``workers`` decoding processes; ``digest`` / ``pixels`` (hashlib objects) take
    every batch's keys and token ids / images."""
    stream = loader.ShardStream(
        urls, seed=0, image_size=bundle.image_size, **({"workers": workers} if workers else {})
    )
    n = 0
    for b in loader.iter_batches(stream, 256, bundle.preprocess_train, bundle.tokenizer, "random"):
        n += len(b.keys)
        if digest is not None:
            digest.update("".join(b.keys).encode())
            digest.update(b.texts.numpy().tobytes())
        if pixels is not None:
            pixels.update(b.images.numpy().tobytes())
    return n


def resume_skip(url: str, offset: int) -> str:
    from compat.data.loader import ShardStream, StreamPosition

    return next(iter(ShardStream([url], position=StreamPosition(0, 0, offset, offset)))).key


def resume_decode(url: str, offset: int) -> str:
    from compat.data.loader import ShardStream

    it = iter(ShardStream([url]))
    for _ in range(offset):
        next(it)
    return next(it).key


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} at the end of the run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=10000, help="train samples in all (split over 5 phases)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=sorted({0, 1, 2, os.cpu_count() or 1}),
        help="decoding worker counts to measure the training batches with",
    )
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    parser.add_argument(
        "--train-steps", type=int, default=40, help="optimizer steps (batch 64) per training run"
    )
    args = parser.parse_args()

    import webdataset

    from compat.data.synth import generate_stream, phase_urls

    per_phase = max(1, args.samples // PHASES)
    n = per_phase * PHASES
    rows: list[tuple[str, float, float, int, str]] = []
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
        gen_kw = dict(eval_per_domain=0, gallery_per_domain=0, samples_per_shard=args.per_shard)
        for workers in (1, 2):

            def generate(workers: int = workers) -> dict:
                out = Path(tmp) / f"gen-{workers}-{time.perf_counter_ns()}"
                return generate_stream(out, PHASES, per_phase, 0, workers=workers, **gen_kw)

            t, cpu, _ = median_time(generate, args.repeats)
            label = f"generate_stream, {workers} process{'es' if workers > 1 else ''}"
            rows.append((label, t, cpu, n, "generation"))
        stream_dir = Path(tmp) / "stream"
        generate_stream(stream_dir, PHASES, per_phase, 0, **gen_kw)
        urls = [u for p in range(PHASES) for u in phase_urls(stream_dir, p, "train")]
        size_mb = sum(os.path.getsize(u) for u in urls) / 2**20

        readers = [
            ("baseline: tarfile, member bytes only", raw_tar_read),
            ("baseline: tarfile + PIL decode + json.loads", raw_tar_decode),
            ("ShardStream (webdataset grouping + decoder)", shard_stream),
            ("reference: wds.WebDataset(...).decode('pil')", webdataset_plain),
            ("iter_batches (to tensor + BPE tokenize, batch 256)", batches),
        ]
        for name, fn in readers:
            fn(urls[:1])  # warm imports and caches
            t, cpu, count = median_time(lambda fn=fn: fn(urls), args.repeats)
            if count != n:
                raise SystemExit(f"{name} read {count} samples, expected {n}")
            rows.append((name, t, cpu, n, "read"))

        offset = min(args.per_shard, per_phase) // 2
        t_skip, _, key_skip = median_time(lambda: resume_skip(urls[0], offset), args.repeats)
        t_dec, _, key_dec = median_time(lambda: resume_decode(urls[0], offset), args.repeats)
        if key_skip != key_dec:
            raise SystemExit(f"resume mismatch: {key_skip} != {key_dec}")

        import hashlib

        import compat.data.loader as loader
        from compat.models import build_model

        before = module_at(args.baseline_commit, "compat/data/loader.py", Path(tmp))
        bundle = build_model("cf-tiny", seed=0)
        runs = [(f"before: loader at {args.baseline_commit[:7]}, 1 process", before, 0)]
        runs += [
            (
                f"{w} decoding worker{'s' if w != 1 else ''}" + (" (this process decodes)" if w == 0 else ""),
                loader,
                w,
            )
            for w in args.workers
        ]
        digests, pixel_digests = set(), set()
        for _, module, workers in runs:
            train_batches(urls[:1], module, bundle, workers)  # warm imports, and the pool's first start
            digest, pixels = hashlib.sha256(), hashlib.sha256()
            train_batches(urls, module, bundle, workers, digest, pixels if module is loader else None)
            digests.add(digest.hexdigest())
            if module is loader:
                pixel_digests.add(pixels.hexdigest())
        # Round robin: each repeat runs every loader once, so a change in the machine's load hits them alike.
        timings: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in runs}
        for _ in range(args.repeats):
            for name, module, workers in runs:
                start, own, cpu = time.perf_counter(), own_cpu_seconds(), cpu_seconds()
                count = train_batches(urls, module, bundle, workers)
                if count != n:
                    raise SystemExit(f"training batches, {name}: {count} samples, expected {n}")
                wall = time.perf_counter() - start
                timings[name].append((wall, cpu_seconds() - cpu, own_cpu_seconds() - own))
        batch_rows: list[tuple[str, float, float, float]] = []
        for name, _, _ in runs:
            wall, cpu, own = (statistics.median(t[i] for t in timings[name]) for i in range(3))
            batch_rows.append((name, wall, cpu, own))
            print(f"training batches, {name}: {n / wall:,.0f} samples/s", flush=True)

        steps, batch = args.train_steps, 64
        step_timings: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for _ in range(args.repeats):
            for name, module, workers in runs:
                start = time.perf_counter()
                train_steps(urls, module, bundle, workers, steps, batch)
                step_timings[name].append(time.perf_counter() - start)
        step_rows = [(name, statistics.median(step_timings[name])) for name, _, _ in runs]
        for name, wall in step_rows:
            print(f"training steps, {name}: {steps * batch / wall:,.0f} samples/s", flush=True)

    base = next(cpu for _, _, cpu, _, kind in rows if kind == "read")
    lines = [
        f"Command: `.venv/bin/python benchmarks/loader.py --samples {args.samples} --repeats {args.repeats}"
        f" --per-shard {args.per_shard} --workers {' '.join(map(str, args.workers))}"
        f" --train-steps {args.train_steps}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"webdataset {webdataset.__version__}  ",
        f"Data: {n} train samples, 64x64 JPEG (quality 90, 4:4:4) + caption + metadata, {PHASES} phases "
        f"(one domain each), {len(urls)} shards of <= {args.per_shard}, {size_mb:.1f} MiB; "
        f"median of {args.repeats} runs (the training batches: every loader once per round, in turn), one "
        f"process unless stated. CPU s counts this process and its workers; wall-clock figures depend on "
        f"what else the machine runs ({load_note()}).",
        "",
        "| step | wall s | samples/s (wall) | CPU s | samples per CPU-s | per CPU-s vs raw tar read |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t, cpu, count, kind in rows:
        ratio = f"{base / cpu:.2f}x" if kind == "read" else "-"
        lines.append(f"| {name} | {t:.2f} | {count / t:,.0f} | {cpu:.2f} | {count / cpu:,.0f} | {ratio} |")
    before_t = batch_rows[0][1]
    lines += [
        "",
        "Training batches as `ShardBatchSource` makes them (`ShardStream` + `iter_batches`): cf-tiny's "
        "open_clip training transform (random resized crop to 64 px, normalise), its BPE tokenizer, batch "
        "256, one pass without the decoded-sample cache (the first epoch; later epochs with the cache decode "
        "nothing but still transform, in the workers). Keys and token ids of every batch: "
        + ("identical for every loader" if len(digests) == 1 else f"DIFFER ({len(digests)} variants)")
        + "; images (cropped per (seed, epoch, key) now, by the process's generator before): "
        + (
            "identical for every worker count." if len(pixel_digests) == 1 else "DIFFER across worker counts."
        ),
        "",
        "The training process reads the shards, tokenizes and collates; the workers decode and transform. "
        "Its own CPU time bounds what any number of workers can reach: the last column, samples / its CPU s.",
        "",
        "| training batches | wall s | samples/s (wall) | x before (wall) | CPU s (all) | samples per CPU-s "
        "| training process CPU s | its bound, samples/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t, cpu, own in batch_rows:
        lines.append(
            f"| {name} | {t:.2f} | {n / t:,.0f} | {before_t / t:.2f}x | {cpu:.2f} | {n / cpu:,.0f} "
            f"| {own:.2f} | {n / own:,.0f} |"
        )
    lines += [
        "",
        f"Training on those batches: {args.train_steps} AdamW steps of cf-tiny (batch 64, CLIP loss, on the "
        "CPU), each run from a fresh stream; decoding in workers overlaps the model's forward and backward "
        "pass. Median of the rounds, every loader once per round.",
        "",
        "| training steps | wall s | samples/s (wall) | x before (wall) |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {wall:.2f} | {args.train_steps * 64 / wall:,.0f} | {step_rows[0][1] / wall:.2f}x |"
            for name, wall in step_rows
        ),
    ]
    lines += [
        "",
        f"Resuming {offset} samples into a shard: first sample after {t_skip * 1000:.1f} ms with the skipped "
        f"members passed over undecoded, against {t_dec * 1000:.1f} ms decoding them "
        f"({t_dec / t_skip:.1f}x).",
        "",
    ]
    from benchmarks.sections import write_section

    title = "Synthetic stream generation and shard loader throughput"
    print(write_section(args.out, "loader", "\n".join(lines), title))


if __name__ == "__main__":
    main()
