"""CUDA throughput of the cluster's CLIP model: the GPU figures the gallery-scale projection rests on.

Measures, on one GPU, open_clip ``ViT-B-32`` (the cluster config's ``training.model_config``) from random
initialisation (``pretrained=None``: nothing is downloaded) at its input size, 224 px:
  * the image encoder, as a backfill runs it (``encode_image(..., normalize=True)`` under
    ``torch.inference_mode``): images/s at each ``--batches`` size, in fp32 (torch's default: TF32 matmuls
    off), in fp32 with TF32 matmuls on, and under ``torch.autocast`` bf16 and fp16; with the input batch
    already on the GPU, and again with what a backfill worker pays per batch on top: a uint8 batch copied
    from pinned host memory (``non_blocking``, not overlapped with compute), scaled and normalised on the
    GPU. JPEG decoding and resizing stay on the CPU and are not counted (``benchmarks/loader.py`` has them);
  * the copy alone (uint8, pinned and pageable host memory), in GB/s;
  * the text encoder: queries/s at ``--text-batch`` (tokens already on the GPU), and the BPE tokenizer's
    captions/s on the CPU;
  * ``--train-steps`` training steps at ``--train-batch``: CLIP contrastive loss (``open_clip.ClipLoss``),
    AdamW, under autocast (fp16 with a GradScaler), and fp32 for reference: seconds per step, samples/s.
Every timed loop runs ``--warmup`` iterations first and is framed by ``torch.cuda.synchronize()``; each row
gives the peak GPU memory of its loop (``torch.cuda.max_memory_allocated`` after a reset). The whole run stops
measuring after ``--budget-s`` seconds (default 420), so it ends inside 8 minutes even on a slower GPU, and
lists the rows it skipped.

    python benchmarks/gpu_check.py [--batches 256,512,1024] [--json FILE] [--out FILE.md]

Prints a Markdown section (device name, torch / CUDA / open_clip versions, the command, one table per
encoder and one for training); ``--out FILE.md`` also writes it as the ``gpu-check`` section of that file
(for example ``benchmarks/results/gallery_scale.md``), ``--json FILE`` the same figures as records.
Without CUDA it refuses with exit status 2. ``--device cpu --quick`` is a smoke mode that checks this script
on a CPU (one thread): a tiny CLIP (2-layer towers, width 64, 64 px input), batch 8, 2 iterations.

Needs: Python >= 3.10, torch (a CUDA build for the real run) and ``open_clip_torch`` with what it imports
(torchvision, timm, ftfy, regex, huggingface_hub, safetensors). Nothing else of this project is imported,
except ``benchmarks/sections.py`` (standard library only) when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "ViT-B-32"  # pipelines/configs/cluster.yaml: training.model_config
SMOKE_MODEL = "smoke-tiny"  # --quick: a CLIP small enough to check the script on a CPU in seconds
SMOKE_CFG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
NEEDS_CUDA = (
    "benchmarks/gpu_check.py measures CUDA throughput and needs a CUDA GPU, but torch.cuda.is_available() "
    "is false here; run it on a GPU machine (`--device cpu --quick` only checks the script itself)."
)
SECTION = "gpu-check"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="smoke mode: tiny model, batch 8, 2 iterations (any device)"
    )
    parser.add_argument(
        "--model", help=f"open_clip model config (default {MODEL}; {SMOKE_MODEL} with --quick)"
    )
    parser.add_argument("--batches", help="image encoder batch sizes, comma-separated (default 256,512,1024)")
    parser.add_argument("--text-batch", type=int, help="text encoder batch (default 256)")
    parser.add_argument("--train-batch", type=int, help="training batch (default 256)")
    parser.add_argument("--train-steps", type=int, help="timed training steps (default 10)")
    parser.add_argument("--iters", type=int, help="timed iterations per encoder row (default 20)")
    parser.add_argument("--warmup", type=int, help="untimed iterations before each timed loop (default 5)")
    parser.add_argument(
        "--precisions",
        help="encoder precisions, comma-separated: fp32, tf32 (fp32 with TF32 matmuls), bf16, fp16 "
        "(autocast); default all four on CUDA",
    )
    parser.add_argument(
        "--train-precisions", help="training precisions, comma-separated (default bf16,fp32 on CUDA)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="stop measuring after this many seconds"
    )
    parser.add_argument("--json", type=Path, help="also write the figures as JSON records to this file")
    parser.add_argument("--out", type=Path, help="also write the Markdown as section gpu-check of this file")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu is only the smoke mode that checks this script: add --quick")
    quick = args.quick
    cuda = args.device == "cuda"
    args.model = args.model or (SMOKE_MODEL if quick else MODEL)
    args.batches = [int(b) for b in (args.batches or ("8" if quick else "256,512,1024")).split(",")]
    args.text_batch = args.text_batch or (8 if quick else 256)
    args.train_batch = args.train_batch or (8 if quick else 256)
    args.train_steps = args.train_steps or (2 if quick else 10)
    args.iters = args.iters or (2 if quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    default_precisions = "fp32,tf32,bf16,fp16" if cuda else "fp32,bf16"
    args.precisions = (args.precisions or default_precisions).split(",")
    args.train_precisions = (args.train_precisions or "bf16,fp32").split(",")
    for name in args.precisions + args.train_precisions:
        if name not in ("fp32", "tf32", "bf16", "fp16"):
            parser.error(f"unknown precision {name!r}: use fp32, tf32, bf16 or fp16")
        if name in ("fp16", "tf32") and not cuda:
            parser.error(f"{name} is measured on CUDA only: use fp32 or bf16 with --device cpu")
    return args


class Run:
    """The device, its synchronisation and peak-memory counters, the time budget and the records so far."""

    def __init__(self, torch: Any, device: str, budget_s: float) -> None:
        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.perf_counter() + budget_s
        self.records: list[dict[str, Any]] = []
        self.skipped: list[str] = []

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def autocast(self, precision: str):
        """The context a row of ``precision`` runs in: autocast for bf16 / fp16, TF32 matmuls for tf32."""
        import contextlib

        if precision == "fp32":
            return contextlib.nullcontext()
        if precision == "tf32":
            return self._tf32()
        dtype = self.torch.bfloat16 if precision == "bf16" else self.torch.float16
        return self.torch.autocast(device_type=self.device.type, dtype=dtype)

    def _tf32(self):
        import contextlib

        torch = self.torch

        @contextlib.contextmanager
        def on():
            saved = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high")  # TF32 matmuls (cuDNN convolutions use TF32 already)
            try:
                yield
            finally:
                torch.set_float32_matmul_precision(saved)

        return on()

    def measure(self, fields: dict[str, Any], step: Callable[[], object], warmup: int, iters: int) -> None:
        """Time ``iters`` calls of ``step`` after ``warmup`` untimed ones and record them with ``fields``
        (``items`` per call); a row past the budget is skipped and one that runs out of memory says so."""
        label = f"{fields['what']} ({fields['inputs']}), {fields['precision']}, batch {fields['batch']}"
        if time.perf_counter() > self.deadline:
            self.skipped.append(label)
            return
        torch = self.torch
        record = dict(fields, iters=iters, warmup=warmup)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(warmup):
                step()
            self.sync()
            start = time.perf_counter()
            for _ in range(iters):
                step()
            self.sync()
            seconds = time.perf_counter() - start
        except torch.cuda.OutOfMemoryError as exc:
            record["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        else:
            record.update(
                seconds=round(seconds, 4),
                ms_per_batch=round(1000 * seconds / iters, 3),
                items_per_s=round(fields["items"] * iters / seconds, 1),
            )
        if self.cuda:
            record["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        self.records.append(record)
        shown = record.get("error") or f"{record['items_per_s']:,.0f}/s"
        print(f"  {label}: {shown}", file=sys.stderr, flush=True)


def build_model(open_clip: Any, name: str, device: Any) -> Any:
    """The model from random initialisation; nothing is downloaded."""
    if name == SMOKE_MODEL:
        return open_clip.CLIP(**SMOKE_CFG, output_dict=True).to(device)
    return open_clip.create_model(
        name, pretrained=None, pretrained_text=False, device=device, output_dict=True, load_weights=False
    )


def image_rows(run: Run, model: Any, open_clip: Any, args: argparse.Namespace) -> None:
    torch, device = run.torch, run.device
    size = model.visual.image_size
    height, width = (size, size) if isinstance(size, int) else size
    cfg = getattr(model.visual, "preprocess_cfg", None) or {}
    mean = torch.tensor(cfg.get("mean", open_clip.OPENAI_DATASET_MEAN), device=device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.get("std", open_clip.OPENAI_DATASET_STD), device=device).view(1, 3, 1, 1)
    gen = torch.Generator().manual_seed(0)
    model.eval()
    for batch in args.batches:
        ready = torch.randn(batch, 3, height, width, generator=gen).to(device)
        host = torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=gen)
        pinned = host.pin_memory() if run.cuda else host
        for precision in args.precisions:

            def on_device(ready=ready, precision=precision):
                with torch.inference_mode(), run.autocast(precision):
                    return model.encode_image(ready, normalize=True)

            def from_host(pinned=pinned, precision=precision):
                with torch.inference_mode():
                    x = pinned.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
                    with run.autocast(precision):
                        return model.encode_image(x, normalize=True)

            common = dict(section="image", precision=precision, batch=batch, items=batch)
            run.measure(
                dict(common, what="image encoder", inputs="float batch on the device"),
                on_device,
                args.warmup,
                args.iters,
            )
            run.measure(
                dict(common, what="image encoder + copy", inputs="uint8 batch from pinned host memory"),
                from_host,
                args.warmup,
                args.iters,
            )
        if run.cuda:
            nbytes = host.numel()
            for kind, source in (("pinned", pinned), ("pageable", host)):

                def copy(source=source):
                    return source.to(device, non_blocking=True)

                run.measure(
                    dict(
                        section="copy", what="host->device copy", precision="uint8", batch=batch, items=batch
                    )
                    | dict(inputs=f"uint8 batch from {kind} host memory", bytes_per_batch=nbytes),
                    copy,
                    args.warmup,
                    args.iters,
                )
        del ready, host, pinned


def captions(n: int) -> list[str]:
    colours = ("red", "blue", "green", "black", "white", "striped", "yellow", "grey")
    things = ("shirt", "dress", "sneaker", "bag", "coat", "sandal", "trousers", "pullover")
    return [
        f"a photo of a {colours[i % 8]} {things[(i // 8) % 8]}, item {i}, on a plain background"
        for i in range(n)
    ]


def text_rows(run: Run, model: Any, open_clip: Any, args: argparse.Namespace) -> None:
    torch = run.torch
    tokenizer = open_clip.tokenize if args.model == SMOKE_MODEL else open_clip.get_tokenizer(args.model)
    texts = captions(args.text_batch)
    tokens = tokenizer(texts).to(run.device)
    model.eval()
    for precision in args.precisions:

        def encode(precision=precision):
            with torch.inference_mode(), run.autocast(precision):
                return model.encode_text(tokens, normalize=True)

        run.measure(
            dict(
                section="text",
                what="text encoder",
                precision=precision,
                batch=args.text_batch,
                items=args.text_batch,
                inputs="tokens on the device",
            ),
            encode,
            args.warmup,
            args.iters,
        )
    cpu_run = Run(torch, "cpu", max(0.0, run.deadline - time.perf_counter()))
    cpu_run.measure(
        dict(
            section="text",
            what="BPE tokenizer (CPU, one process)",
            precision="-",
            batch=args.text_batch,
            items=args.text_batch,
            inputs="caption strings",
        ),
        lambda: tokenizer(texts),
        1,
        max(2, args.iters // 4),
    )
    run.records += cpu_run.records
    run.skipped += cpu_run.skipped


def train_rows(run: Run, model: Any, open_clip: Any, args: argparse.Namespace) -> None:
    torch, device = run.torch, run.device
    batch = args.train_batch
    size = model.visual.image_size
    height, width = (size, size) if isinstance(size, int) else size
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, height, width, generator=gen).to(device)
    tokenizer = open_clip.tokenize if args.model == SMOKE_MODEL else open_clip.get_tokenizer(args.model)
    tokens = tokenizer(captions(batch)).to(device)
    loss_fn = open_clip.ClipLoss()
    model.train()
    for precision in args.train_precisions:
        model.zero_grad(set_to_none=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.2)
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        losses: list[Any] = []

        def step(optimizer=optimizer, scaler=scaler, precision=precision, losses=losses):
            optimizer.zero_grad(set_to_none=True)
            with run.autocast(precision):
                out = model(images, tokens)
                loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            losses.append(loss.detach())

        run.measure(
            dict(
                section="train",
                what="training step (CLIP loss, AdamW)",
                precision=f"{precision} autocast" if precision in ("bf16", "fp16") else precision,
                batch=batch,
                items=batch,
                inputs="float images and tokens on the device",
            ),
            step,
            min(args.warmup, 3),
            args.train_steps,
        )
        if losses and not all(bool(torch.isfinite(v)) for v in losses):
            run.records[-1]["error"] = "a loss was not finite"
        model.zero_grad(set_to_none=True)
        del optimizer, scaler, losses
    model.eval()


def environment(torch: Any, open_clip: Any, run: Run, args: argparse.Namespace, argv: list[str]) -> dict:
    script = Path(__file__).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    env: dict[str, Any] = {
        "command": f"python {shown} {shlex.join(argv)}".strip(),
        "model": args.model,
        "quick": args.quick,
        "params_m": None,
        "torch": torch.__version__,
        "open_clip": getattr(open_clip, "__version__", "unknown"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "tf32_matmul": torch.get_float32_matmul_precision() != "highest",
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }
    if run.cuda:
        props = torch.cuda.get_device_properties(run.device)
        env.update(
            device=torch.cuda.get_device_name(run.device),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        threads = torch.get_num_threads()
        plural = "s" if threads > 1 else ""
        env.update(device=f"CPU ({platform.machine()}, {os.cpu_count()} cores, {threads} thread{plural})")
    return env


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(env: dict[str, Any], records: list[dict[str, Any]], skipped: list[str]) -> str:
    smoke = env["quick"]
    tf32_rows = " (tf32 rows: on)" if any(r["precision"] == "tf32" for r in records) else ""
    lines = [
        f"## GPU check: {env['model']} on {env['device']}",
        "",
        f"Command: `{env['command']}`  ",
        f"Device: {env['device']}"
        + (
            f" ({env['gpu_memory_gib']} GiB, compute capability {env['compute_capability']}, "
            f"cuDNN {env['cudnn']})"
            if "gpu_memory_gib" in env
            else ""
        )
        + f"; torch {env['torch']} (CUDA {env['cuda'] or 'none'}), open_clip {env['open_clip']}, "
        f"Python {env['python']}  ",
        f"Model: {env['model']}, {env['params_m']}M parameters, random init (pretrained=None); fp32 rows "
        f"with TF32 matmuls {'on' if env['tf32_matmul'] else 'off'}{tf32_rows}, cudnn.benchmark "
        f"{'on' if env['cudnn_benchmark'] else 'off'}. Each row: the mean over its timed iterations after "
        "its warm-up"
        + (", framed by torch.cuda.synchronize(); peak GPU memory of that loop alone." if not smoke else "."),
    ]
    if smoke:
        lines.append("")
        lines.append(
            "**Smoke run: a tiny model, 2 iterations; these figures check the script, nothing else.**"
        )
    tables = [
        ("image", "Image encoder (backfill: `encode_image`, normalised)", "images/s"),
        ("copy", "Host->device copy alone (uint8 images)", "images/s"),
        ("text", "Text encoder (queries: `encode_text`, normalised)", "queries/s"),
        ("train", "Training steps (forward, CLIP loss, backward, AdamW step)", "samples/s"),
    ]
    for section, title, unit in tables:
        rows = [r for r in records if r["section"] == section]
        if not rows:
            continue
        extra = " | GB/s" if section == "copy" else ""
        per = "s / step" if section == "train" else "ms / batch"
        lines += [
            "",
            f"### {title}",
            "",
            f"| what | inputs | precision | batch | iters | {per} | {unit}{extra} | peak GPU MiB |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "error" in r:
                cells = f"{r['error']} | " + (" | " if extra else "")
            else:
                timing = r["ms_per_batch"] / 1000 if section == "train" else r["ms_per_batch"]
                cells = f"{timing:.3f} | {r['items_per_s']:,.0f}"
                if extra:
                    cells += f" | {r['bytes_per_batch'] * r['iters'] / r['seconds'] / 1e9:.1f}"
            lines.append(
                f"| {r['what']} | {r['inputs']} | {r['precision']} | {r['batch']} | {r['iters']} | {cells} "
                f"| {_fmt(r.get('peak_gpu_mib'), ',.0f')} |"
            )
    backfill = [r for r in records if r["what"] == "image encoder + copy" and "error" not in r]
    if backfill:
        best = max(backfill, key=lambda r: r["items_per_s"])
        lines += [
            "",
            f"Backfill rate for the projection: {best['items_per_s']:,.0f} images/s per "
            f"{'GPU' if not smoke else 'device (smoke run)'} ({best['precision']}, batch {best['batch']}, "
            "uint8 images copied from pinned host memory each batch, decoding and resizing not included).",
        ]
    if skipped:
        lines += ["", "Skipped (over the time budget): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NEEDS_CUDA, file=sys.stderr)
        return 2
    import open_clip

    started = time.perf_counter()
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = args.device == "cuda"
    if args.device == "cpu":
        torch.set_num_threads(1)  # the smoke run: steady on a shared machine, where threads contend
    try:
        run = Run(torch, args.device, args.budget_s)
        model = build_model(open_clip, args.model, run.device)
        env = environment(torch, open_clip, run, args, argv)
        env["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        print(f"{args.model} on {env['device']}:", file=sys.stderr, flush=True)
        image_rows(run, model, open_clip, args)
        text_rows(run, model, open_clip, args)
        train_rows(run, model, open_clip, args)
    finally:  # called in-process (a test), leave torch as it was
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
    env["wall_seconds"] = round(time.perf_counter() - started, 1)
    text = render(env, run.records, run.skipped)
    print(text)
    if args.out:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from benchmarks.sections import write_section

        write_section(args.out, SECTION, text, "GPU check")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(env, records=run.records, skipped=run.skipped)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
