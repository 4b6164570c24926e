"""Mod-X vs fine-tuning (CLIP_ct) vs joint training over a stream of shifting domains.

On a stream (``--stream``: the synthetic ``realistic`` default, whose phases share a core vocabulary and
bring new items; the ``disjoint`` hard stream, one vocabulary per phase; or ``fashion-mnist``, real photos,
two new classes per phase, built by benchmarks/fashion_mnist.py) with the same seeds, data order, schedule
and steps, through the real ``continual`` stage:

* CLIP_0 is trained on phase 0 from scratch;
* ``modx`` (alpha 20 unless given) and ``finetune`` (alpha 0) continue phase by phase from their own previous
  model; ``joint`` starts from CLIP_0 at every phase and trains on all phases so far, with ``steps x phase``
  steps (the same number of samples the sequential runs have seen by then): the upper bound;
* ``--extra-alphas``: more Mod-X runs over all phases; ``--sweep-lrs`` / ``--sweep-alphas`` /
  ``--sweep-no-correction``: phase 1 only, from CLIP_0, a learning-rate x alpha grid (and Mod-X without the
  Eq 3 selective correction, an ablation) to investigate the trade-off.

Reported: multi-caption R@1 in both directions on every domain seen so far, after every phase (on
Fashion-MNIST, whose captions name only the class, zero-shot class accuracy instead: among every class the
model has seen / within the phase's own classes); the share of
teacher rows Eq 3 keeps; Spatial Disorder (RAM/SAM/ImAV) on the phase-0 domain for every phase's move and
for CLIP_0 -> final; step time Mod-X vs fine-tuning, interleaved on the same pre-decoded batches (compute
only), and the stage's own median step time (data loading included).

    .venv/bin/python benchmarks/continual.py [--steps 150] [--clip0-steps 400] [--sweep-lrs 1e-3,2.5e-4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("benchmarks.continual")
STREAMS = ("realistic", "disjoint", "fashion-mnist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "compatflow-bench-continual")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "continual.md")
    p.add_argument("--config", default="cf-tiny")
    p.add_argument("--stream", choices=STREAMS, default="realistic", help="which stream (see the module doc)")
    p.add_argument(
        "--old-word-share", type=float, default=0.6, help="realistic stream: captions in earlier words"
    )
    p.add_argument("--fashion-dir", type=Path, default=None, help="fashion-mnist: the package's files")
    p.add_argument("--phases", type=int, default=5, help="phase 0 + (phases - 1) shifted phases")
    p.add_argument("--samples-per-phase", type=int, default=2000)
    p.add_argument("--eval-per-domain", type=int, default=200)
    p.add_argument("--steps", type=int, default=200, help="steps per phase (Mod-X, fine-tuning)")
    p.add_argument("--clip0-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=20.0)
    p.add_argument("--extra-alphas", default="", help="comma-separated Mod-X alphas run as well")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="auto")
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--skip-joint", action="store_true")
    p.add_argument(
        "--extra-lrs", default="", help="comma-separated lrs: Mod-X and fine-tuning over all phases"
    )
    p.add_argument("--sweep-lrs", default="", help="phase-1 sweep: comma-separated learning rates")
    p.add_argument("--sweep-alphas", default="0,20,200", help="phase-1 sweep: alphas (0 = fine-tuning)")
    p.add_argument(
        "--sweep-no-correction", action="store_true", help="phase-1 sweep: add Mod-X without Eq 3 (ablation)"
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=1000,
        help="Mod-X + buffer / fine-tuning + buffer (paper Table 2): pairs kept from earlier phases (0: off)",
    )
    p.add_argument("--replay", type=int, default=16, help="buffer rows in every global batch")
    p.add_argument(
        "--sweep-buffer-alphas",
        default="",
        help="phase-1 sweep with the replay buffer: comma-separated alphas",
    )
    p.add_argument(
        "--buffer-alpha", type=float, default=None, help="alpha of Mod-X + buffer (default: --alpha)"
    )
    return p.parse_args(argv)


def r1(doc: dict[str, Any], domain: str) -> tuple[float, float]:
    """The pair of figures a table cell shows: R@1 t2i / i2t, or class accuracy seen so far / within phase."""
    if "class_accuracy" in doc:
        return tuple(doc["class_accuracy"][domain])  # type: ignore[return-value]
    m = doc["domains"][domain]
    return m["t2i"]["R@1"], m["i2t"]["R@1"]


def make_stream(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The benchmark's stream directory and manifest (generated or built once, reused after)."""
    if args.stream == "fashion-mnist":
        from benchmarks.fashion_mnist import DEFAULT_DIR, build_stream

        stream = args.work / "stream-fashion"
        classes = 2
        manifest = build_stream(
            stream,
            args.fashion_dir or DEFAULT_DIR,
            classes_per_phase=classes,
            class_order=list(range(2 * args.phases)),
            train_per_class=args.samples_per_phase // classes,
            eval_per_class=args.eval_per_domain // classes,
            gallery_per_class=1,
            samples_per_shard=250,
            seed=args.seed,
        )
        return stream, manifest
    from compat.data.synth import generate_stream

    stream = args.work / f"stream-{args.stream}"
    manifest = generate_stream(
        stream,
        args.phases,
        args.samples_per_phase,
        args.seed,
        eval_per_domain=args.eval_per_domain,
        gallery_per_domain=0,
        samples_per_shard=250,
        workers=min(args.threads, 4),
        shift=args.stream,
        old_word_share=args.old_word_share,
    )
    return stream, manifest


_CLASS_SETS: dict[tuple[str, int], tuple[list[Any], list[str], list[str]]] = {}


def add_class_accuracy(
    args: argparse.Namespace, stream: Path, doc: dict[str, Any], model: Path, phase: int
) -> None:
    """Fashion-MNIST: ``doc["class_accuracy"][domain]`` = (accuracy among every class of phases 0..phase,
    accuracy within the domain's own classes) of ``model`` on each seen phase's eval images."""
    if args.stream != "fashion-mnist":
        return
    from benchmarks.fashion_mnist import class_accuracy
    from compat.data.loader import load_captioned_set
    from compat.data.synth import load_manifest, phase_urls
    from compat.device import resolve_device
    from compat.models import load_checkpoint

    manifest = load_manifest(stream)
    for q in range(phase + 1):
        if (str(stream), q) not in _CLASS_SETS:
            data = load_captioned_set(phase_urls(stream, q, "eval", manifest))
            own = manifest["phases"][q]["classes"]
            _CLASS_SETS[(str(stream), q)] = (data.images, [m["label"] for m in data.metas], own)
    seen = [c for q in range(phase + 1) for c in manifest["phases"][q]["classes"]]
    bundle = load_checkpoint(model)
    device = str(resolve_device(args.device))
    doc["class_accuracy"] = {}
    for q in range(phase + 1):
        images, labels, own = _CLASS_SETS[(str(stream), q)]
        doc["class_accuracy"][manifest["phases"][q]["domain"]] = (
            class_accuracy(bundle, images, labels, seen, device),
            class_accuracy(bundle, images, labels, own, device),
        )


def run_method(
    args,
    stream: Path,
    runs: Path,
    method: str,
    clip0: Path,
    alpha: float | None,
    label: str,
    lr: float | None = None,
) -> list[dict[str, Any]]:
    """Phases 1..N of one method; returns each phase's metrics document."""
    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings, run_continual

    docs, prev = [], clip0
    for phase in range(1, args.phases):
        steps = args.steps * phase if method == "joint" else args.steps
        start = clip0 if method == "joint" else prev
        out = runs / label / f"phase-{phase:02d}"
        t0 = time.perf_counter()
        settings = TrainingSettings.from_section(
            TrainingSection(),
            config_name=args.config,
            method=method,
            alpha=alpha,
            replay_buffer_size=0,  # the buffered variants: run_buffered
            replay_rows=0,
            steps=steps,
            batch_size=args.batch_size,
            lr=args.lr if lr is None else lr,
            checkpoint_every=0,
            seed=args.seed,
            device=args.device,
        )
        doc = run_continual(stream, phase, out, settings, production=start, resume=False)
        doc["wall_s"] = time.perf_counter() - t0
        add_class_accuracy(args, stream, doc, out / "model", phase)
        log.info(
            "%s phase %d: %s (%.0f s)", label, phase, {d: r1(doc, d) for d in doc["domains"]}, doc["wall_s"]
        )
        docs.append(doc)
        prev = out / "model"
    return docs


def run_buffered(
    args, stream: Path, runs: Path, clip0: Path, alpha: float, label: str, last_phase: int | None = None
) -> list[dict[str, Any]]:
    """Phases 1..N with a replay buffer of earlier phases (the Mod-X paper's "Mod-X + buffer", Table 2;
    with alpha = 0, experience replay for fine-tuning): ``args.replay`` rows of every global batch come from a
    buffer of ``args.buffer_size`` pairs split evenly over the phases before the current one. Same trainer,
    schedule, seeds and evaluation as the stage; returns documents shaped like the stage's metrics."""
    import statistics as st

    from compat.data.loader import load_captioned_set
    from compat.data.synth import load_manifest, phase_urls
    from compat.device import resolve_device
    from compat.models import load_checkpoint, save_checkpoint
    from compat.training import ReplayBatchSource, ReplayBuffer, TrainConfig, train
    from components.training.continual import EvalSet, evaluate_domains

    manifest = load_manifest(stream)
    dev = str(resolve_device(args.device))
    sets = [
        EvalSet(q, manifest["phases"][q]["domain"], load_captioned_set(phase_urls(stream, q, "eval")))
        for q in range(args.phases)
    ]
    docs, prev = [], clip0
    for phase in range(1, (last_phase or args.phases - 1) + 1):
        out = runs / label.replace(" ", "").replace("+", "-").replace("=", "") / f"phase-{phase:02d}"
        student = load_checkpoint(prev, device=dev)
        teacher = load_checkpoint(prev, device=dev) if alpha > 0 else None
        buffer = ReplayBuffer.from_phases(
            [phase_urls(stream, q, "train") for q in range(phase)], args.buffer_size, seed=args.seed
        )
        source = ReplayBatchSource(
            phase_urls(stream, phase, "train"),
            buffer,
            args.batch_size,
            args.replay,
            student.preprocess_train,
            student.tokenizer,
            seed=args.seed,
        )
        config = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, alpha=alpha, seed=args.seed, log_every=0
        )
        t0 = time.perf_counter()
        result = train(student, source, config, out / "train", teacher=teacher, resume=False)
        save_checkpoint(student, out / "model", version=f"phase-{phase:02d}-{label}")
        metrics, _ = evaluate_domains(student, sets[: phase + 1], dev)
        kept = [h["teacher_rows_kept"] for h in result.state.history if "teacher_rows_kept" in h]
        times = result.step_times[1:] or result.step_times
        doc = {
            "phase": phase,
            "domains": metrics,
            "candidate": {"path": str(out / "model")},
            "training": {
                "teacher_rows_kept_mean": st.mean(kept) if kept else None,
                "median_step_s": st.median(times),
                "buffer_size": len(buffer),
                "replay": args.replay,
            },
            "wall_s": time.perf_counter() - t0,
        }
        add_class_accuracy(args, stream, doc, out / "model", phase)
        log.info("%s phase %d: %s (%.0f s)", label, phase, {d: r1(doc, d) for d in metrics}, doc["wall_s"])
        docs.append(doc)
        prev = out / "model"
    return docs


def sweep_phase1(
    args, stream: Path, runs: Path, clip0: Path, results: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Phase 1 only, from CLIP_0: every (lr, alpha) of the sweep; runs of the main comparison are reused."""
    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings, run_continual

    reuse: dict[tuple[float, float, bool], list[dict[str, Any]]] = {}
    for label, docs in results.items():
        method, _, setting = label.partition(" ")
        lr = float(setting[3:]) if setting.startswith("lr=") else args.lr
        alpha = float(setting[2:]) if setting.startswith("a=") else args.alpha
        if method in ("finetune", "modx") and "buffer" not in label:
            reuse[(lr, 0.0 if method == "finetune" else alpha, True)] = docs
    variants = [(float(x), True) for x in args.sweep_alphas.split(",") if x.strip()]
    if args.sweep_no_correction:
        variants.append((args.alpha, False))
    rows = []
    for lr in [float(x) for x in args.sweep_lrs.split(",") if x.strip()]:
        for alpha, corr in variants:
            if (lr, alpha, corr) in reuse:
                doc = reuse[(lr, alpha, corr)][0]
            else:
                settings = TrainingSettings.from_section(
                    TrainingSection(),
                    config_name=args.config,
                    method="modx" if alpha > 0 else "finetune",
                    alpha=alpha if alpha > 0 else None,
                    replay_buffer_size=0,
                    replay_rows=0,
                    steps=args.steps,
                    batch_size=args.batch_size,
                    lr=lr,
                    checkpoint_every=0,
                    seed=args.seed,
                    device=args.device,
                    selective_correction=corr,
                )
                out = runs / "sweep" / f"lr{lr:g}-a{alpha:g}{'' if corr else '-noeq3'}"
                doc = run_continual(stream, 1, out, settings, production=clip0, resume=False)
            rows.append({"lr": lr, "alpha": alpha, "eq3": corr, "doc": doc})
            log.info(
                "sweep lr %g alpha %g eq3 %s: %s", lr, alpha, corr, {d: r1(doc, d) for d in doc["domains"]}
            )
    return rows


def time_steps(args, clip0: Path, stream: Path) -> dict[str, Any]:
    """Median compute time of one optimizer step, fine-tuning vs Mod-X, interleaved on the same batches."""
    import torch

    from compat.data.synth import phase_urls
    from compat.device import resolve_device
    from compat.losses import ModXLoss
    from compat.models import load_checkpoint
    from compat.training import (
        ShardBatchSource,
        TrainConfig,
        build_optimizer,
        clamp_logit_scale,
        loss_and_backward,
    )

    device = str(resolve_device(args.device))
    teacher = load_checkpoint(clip0, device=device)
    teacher.model.eval().requires_grad_(False)
    students = {m: load_checkpoint(clip0, device=device) for m in ("finetune", "modx")}
    source = ShardBatchSource(
        phase_urls(stream, 1, "train"),
        args.batch_size,
        teacher.preprocess_train,
        teacher.tokenizer,
        seed=args.seed,
    )
    it = source.batches(None)
    batches = [next(it) for _ in range(4)]
    cfg = TrainConfig(steps=1, batch_size=args.batch_size, lr=args.lr)
    opts = {m: build_optimizer(b.model, cfg) for m, b in students.items()}
    losses = {"finetune": ModXLoss(0.0), "modx": ModXLoss(args.alpha)}
    times: dict[str, list[float]] = {"finetune": [], "modx": []}
    for i in range(args.timing_steps + 2):
        for method in ("finetune", "modx") if i % 2 == 0 else ("modx", "finetune"):
            b = batches[i % len(batches)]
            model = students[method].model.train()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opts[method].zero_grad(set_to_none=True)
            loss_and_backward(
                model, b.images.to(device), b.texts.to(device), losses[method], teacher=teacher.model
            )
            opts[method].step()
            clamp_logit_scale(model)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:  # two warm-up rounds
                times[method].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"median_s": med, "ratio": med["modx"] / med["finetune"], "steps_each": args.timing_steps}


def domain0_disorder(
    clip0: Path, docs: list[dict[str, Any]], stream: Path, device: str
) -> list[tuple[str, dict[str, Any]]]:
    """Spatial Disorder on the phase-0 domain's eval set (the paper measures it on COCO, the old domain):
    every phase's move (t-1, t) and the whole way from CLIP_0 to the final model (0, N)."""
    from compat.data.loader import load_captioned_set
    from compat.data.synth import phase_urls
    from compat.metrics import spatial_disorder
    from compat.models import load_checkpoint
    from components.training.continual import embed_set

    data = load_captioned_set(phase_urls(stream, 0, "eval"))
    models = [clip0] + [Path(d["candidate"]["path"]) for d in docs]
    emb = [embed_set(load_checkpoint(m), data, device) for m in models]
    moves = [(t - 1, t) for t in range(1, len(models))] + [(0, len(models) - 1)]
    return [
        (
            f"({a},{b})",
            spatial_disorder(emb[a].images, emb[a].first_captions(), emb[b].images, emb[b].first_captions()),
        )
        for a, b in moves
    ]


# ------------------------------------------------------------------------------------------------ report
def _kept(doc: dict[str, Any]) -> str:
    """The share of teacher rows Eq 3 kept in a run, as a table cell (empty when none was measured)."""
    kept = doc["training"].get("teacher_rows_kept_mean")
    return "" if kept is None else f"{100 * kept:.1f}%"


def _cell(pair: tuple[float, float] | None) -> str:
    return "" if pair is None else f"{pair[0]:.1f} / {pair[1]:.1f}"


def _hist(h: list[float]) -> str:
    return " · ".join(f"{v:.1f}" for v in h)


def render(
    args,
    meta: dict[str, Any],
    clip0_doc: dict[str, Any],
    results: dict[str, list[dict[str, Any]]],
    timing: dict[str, Any],
    sd_rows: dict[str, list[tuple[str, dict[str, Any]]]],
    sweep: list[dict[str, Any]],
    buffer_sweep: list[dict[str, Any]] | None = None,
) -> str:
    domains = meta["domains"]
    d0 = domains[0]
    n = args.phases - 1
    labels = list(results)
    fashion = args.stream == "fashion-mnist"
    metric = "class accuracy" if fashion else "R@1"
    shares = ", ".join("-" if s is None else f"{100 * s:.0f}%" for s in meta.get("shares", []))
    lines = ["# Continual training: Mod-X vs fine-tuning vs joint training", ""]
    lines += [
        f"Stream `{args.stream}`"
        + (f" (old_word_share {args.old_word_share:g})" if args.stream == "realistic" else "")
        + f"; share of each phase's train captions in earlier phases' words only, measured: {shares}.",
        "",
        f"Stream: {args.phases} phases (phase 0 + {n} shifted domains: {', '.join(domains)}), "
        f"{args.samples_per_phase} train pairs per phase, {args.eval_per_domain} eval images per domain x 5 "
        f"captions, stream seed {args.seed}. Model `{args.config}` "
        f"({meta['parameters'] / 1e6:.2f}M parameters). CLIP_0: {args.clip0_steps} steps on phase 0. "
        f"Per phase: {args.steps} steps x batch {args.batch_size} for Mod-X and fine-tuning; "
        f"joint training restarts from CLIP_0 at phase p with {args.steps} x p steps "
        f"on phases 0..p. AdamW lr {args.lr:g} (betas 0.9/0.99, wd 0.2), cosine with 20% warmup per phase, "
        f"seed {args.seed} for every run. Mod-X alpha {args.alpha:g}."
        + (
            f" Replay buffer (the Mod-X paper's Table 2 variant): {args.buffer_size} pairs split evenly over "
            f"the earlier phases, {args.replay} of every {args.batch_size} rows drawn from it; Mod-X + buffer"
            " "
            f"alpha {args.alpha if args.buffer_alpha is None else args.buffer_alpha:g}."
            if args.buffer_size > 0
            else ""
        ),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}, device "
        f"{meta['device']}; Python {platform.python_version()}. Wall time {meta['wall_s'] / 60:.1f} min.",
        "",
        (
            "## Zero-shot class accuracy after every phase (among every class seen so far / within the "
            "domain's own classes, %)"
            if fashion
            else "## R@1 after every phase (text-to-image / image-to-text, %)"
        ),
        "",
        "| after phase | method | " + " | ".join(domains) + " |",
        "|---|---|" + "---:|" * len(domains),
        f"| 0 | CLIP_0 | {_cell(r1(clip0_doc, d0))} |" + " |" * (len(domains) - 1),
    ]
    for p in range(1, n + 1):
        for label in labels:
            doc = results[label][p - 1]
            cells = [_cell(r1(doc, d)) if d in doc["domains"] else "" for d in domains]
            lines.append(f"| {p} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "Newest domain in each row: the last filled column.", ""]

    # Summary after the final phase.
    base0 = r1(clip0_doc, d0)
    lines += [
        "## After the final phase",
        "",
        f"| method | phase-0 domain {metric} (CLIP_0: "
        + _cell(base0)
        + f") | earlier domains: mean {metric} | "
        f"earlier domains: mean drop from own peak | newest domain {metric} |",
        "|---|---:|---:|---:|---:|",
    ]
    summary = {}
    for label in labels:
        docs = results[label]
        last = docs[-1]
        earlier = domains[:n]
        mean_r1 = [statistics.mean(r1(last, d)[k] for d in earlier) for k in (0, 1)]
        peaks = {d0: base0, **{domains[p]: r1(results[label][p - 1], domains[p]) for p in range(1, n)}}
        drop = [statistics.mean(peaks[d][k] - r1(last, d)[k] for d in earlier) for k in (0, 1)]
        newest = r1(last, domains[n])
        summary[label] = {"d0": r1(last, d0), "earlier": mean_r1, "drop": drop, "newest": newest}
        lines.append(
            f"| {label} | {_cell(r1(last, d0))} | {_cell(tuple(mean_r1))} | {_cell(tuple(drop))} | "
            f"{_cell(newest)} |"
        )
    lines.append("")
    if "finetune" in summary:
        ft = summary["finetune"]
        lines += [
            "Goals (issue 13): earlier-domain figures as a share of CLIP_0's on the phase-0 domain and of "
            "each domain's own peak; newest domain against fine-tuning (t2i / i2t"
            + (", or seen-classes / within-phase accuracy" if fashion else "")
            + "):",
            "",
            "| method | phase-0 domain, % of CLIP_0 | earlier domains, % of own peak "
            "| newest minus fine-tuning |",
            "|---|---:|---:|---:|",
        ]
        for label, sm in summary.items():
            keep0 = [100 * sm["d0"][k] / base0[k] if base0[k] else float("nan") for k in (0, 1)]
            keep = [
                100 * sm["earlier"][k] / (sm["earlier"][k] + sm["drop"][k])
                if sm["earlier"][k] + sm["drop"][k]
                else float("nan")
                for k in (0, 1)
            ]
            gap = [sm["newest"][k] - ft["newest"][k] for k in (0, 1)]
            lines.append(
                f"| {label} | {keep0[0]:.0f}% / {keep0[1]:.0f}% | {keep[0]:.0f}% / {keep[1]:.0f}% | "
                f"{gap[0]:+.1f} / {gap[1]:+.1f} |"
            )
        lines.append("")
    pairs = [("modx", "finetune", f"lr {args.lr:g}")]
    pairs += [("modx + buffer", "finetune + buffer", f"lr {args.lr:g}, both with the replay buffer")]
    pairs += [
        (label, "finetune" + label[4:], label[5:].replace("=", " "))
        for label in labels
        if label.startswith("modx lr=")
    ]
    for mx_label, ft_label, what in pairs:
        if mx_label not in summary or ft_label not in summary:
            continue
        mx, ft = summary[mx_label], summary[ft_label]
        closer = [abs(base0[k] - mx["d0"][k]) < abs(base0[k] - ft["d0"][k]) for k in (0, 1)]
        lines += [
            f"- {what}: phase-0 domain, Mod-X closer to CLIP_0 than fine-tuning in {sum(closer)} of 2 "
            f"directions; earlier domains, mean R@1 Mod-X minus fine-tuning "
            f"{mx['earlier'][0] - ft['earlier'][0]:+.1f} (t2i) / "
            f"{mx['earlier'][1] - ft['earlier'][1]:+.1f} (i2t); newest domain "
            f"{mx['newest'][0] - ft['newest'][0]:+.1f} / {mx['newest'][1] - ft['newest'][1]:+.1f}."
        ]
    for mx_label in ("modx", "modx + buffer"):
        if "joint" not in summary or mx_label not in summary:
            continue
        jt, mx = summary["joint"], summary[mx_label]
        lines.append(
            f"- Gap to joint training (joint minus {mx_label}, lr {args.lr:g}): earlier domains "
            f"{jt['earlier'][0] - mx['earlier'][0]:+.1f} / {jt['earlier'][1] - mx['earlier'][1]:+.1f}, "
            f"newest {jt['newest'][0] - mx['newest'][0]:+.1f} / {jt['newest'][1] - mx['newest'][1]:+.1f}."
        )
    lines.append("")

    # Eq 3 selective correction: how much of the batch the teacher understands.
    modx_labels = [x for x in labels if x.startswith("modx")]
    if modx_labels:
        lines += [
            "## Teacher rows kept by the selective correction (Eq 3)",
            "",
            "Share of teacher rows whose argmax is their own pair, mean over the phase's steps and both "
            "directions: the Mod-X KL only sees these rows.",
            "",
            "| method | " + " | ".join(f"phase {p}" for p in range(1, n + 1)) + " |",
            "|---|" + "---:|" * n,
        ]
        for label in modx_labels:
            lines.append(f"| {label} | " + " | ".join(_kept(d) for d in results[label]) + " |")
        lines.append("")

    if sweep:
        lines += [
            "## Phase-1 sweep: learning rate x alpha (from CLIP_0, "
            f"{args.steps} steps; alpha 0 = fine-tuning)",
            "",
            f"| lr | alpha | {d0} R@1 (CLIP_0: {_cell(base0)}) | {domains[1]} R@1 | teacher rows kept |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in sweep:
            doc = row["doc"]
            lines.append(
                f"| {row['lr']:g} | {row['alpha']:g}{'' if row['eq3'] else ' without Eq 3 (ablation)'} | "
                f"{_cell(r1(doc, d0))} | {_cell(r1(doc, domains[1]))} | {_kept(doc)}"
                f"{'' if row['eq3'] else ' (all rows distilled)'} |"
            )
        lines.append("")
        kept_all = [r["doc"]["training"]["teacher_rows_kept_mean"] for r in sweep if r["alpha"] > 0]
        if kept_all:
            k = statistics.mean(kept_all)
            lines.append(
                f"- Eq 3 keeps {100 * k:.1f}% of the teacher's rows on phase-1 batches: the Mod-X KL acts on "
                f"about {k * args.batch_size:.1f} of {args.batch_size} rows per direction."
            )
        for lr in sorted({r["lr"] for r in sweep}, reverse=True):
            at = {(r["alpha"], r["eq3"]): r["doc"] for r in sweep if r["lr"] == lr}
            ft, mx, abl = at.get((0.0, True)), at.get((args.alpha, True)), at.get((args.alpha, False))
            if ft and mx:
                lines.append(
                    f"- lr {lr:g}, Mod-X alpha {args.alpha:g} minus fine-tuning: {d0} "
                    f"{r1(mx, d0)[0] - r1(ft, d0)[0]:+.1f} / {r1(mx, d0)[1] - r1(ft, d0)[1]:+.1f}, "
                    f"{domains[1]} {r1(mx, domains[1])[0] - r1(ft, domains[1])[0]:+.1f} / "
                    f"{r1(mx, domains[1])[1] - r1(ft, domains[1])[1]:+.1f}."
                )
            if abl and ft:
                lines.append(
                    f"- lr {lr:g}, without Eq 3: {d0} {_cell(r1(abl, d0))} (CLIP_0 {_cell(base0)}), "
                    f"{domains[1]} {_cell(r1(abl, domains[1]))} (fine-tuning {_cell(r1(ft, domains[1]))})."
                )
        lines.append("")

    if buffer_sweep:
        lines += [
            f"## Phase-1 sweep with the replay buffer: alpha (from CLIP_0, {args.steps} steps, "
            f"lr {args.lr:g},"
            " "
            f"{args.replay} of {args.batch_size} rows from {args.buffer_size} phase-0 pairs; alpha 0 = "
            "fine-tuning + buffer)",
            "",
            f"| alpha | {d0} R@1 (CLIP_0: {_cell(base0)}) | {domains[1]} R@1 | teacher rows kept |",
            "|---:|---:|---:|---:|",
        ]
        for row in buffer_sweep:
            doc = row["doc"]
            lines.append(
                f"| {row['alpha']:g} | {_cell(r1(doc, d0))} | {_cell(r1(doc, domains[1]))} | {_kept(doc)} |"
            )
        lines.append("")

    # Spatial disorder.
    lines += [
        f"## Spatial Disorder on the phase-0 domain ({d0}; App B.2 bins, % of its eval samples)",
        "",
        "Each phase's move (t-1, t) and CLIP_0 -> final model (0, N), measured on the phase-0 domain as the "
        "paper measures on COCO. (Each run's `spatial_disorder.json` holds the same histograms on the newest "
        "domain.) RAM bins [0,15] (15,20] (20,25] (25,30] (30,180] deg; SAM and ImAV bins [0,5] (5,10] "
        "(10,15] (15,20] (20,180] deg; ImAV over the samples the old model of the move retrieved correctly "
        "(i2t top-1 among the paired captions), n of them in brackets.",
        "",
        "| method | move | RAM image | RAM text | SAM image | SAM text | ImAV (n) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in sd_rows.items():
        for move, sd in rows:
            lines.append(
                f"| {label} | {move} | {_hist(sd['ram']['image'])} | {_hist(sd['ram']['text'])} | "
                f"{_hist(sd['sam']['image'])} | {_hist(sd['sam']['text'])} | {_hist(sd['imav'])} "
                f"({sd['imav_samples']}) |"
            )
    lines.append("")

    # Step time.
    med = timing["median_s"]
    lines += [
        "## Step time",
        "",
        f"Compute only (forward + backward + AdamW, pre-decoded batches of {args.batch_size}), interleaved, "
        f"median of {timing['steps_each']} steps each after 2 warm-up rounds:",
        "",
        "| method | s / step | x fine-tuning |",
        "|---|---:|---:|",
        f"| fine-tuning | {med['finetune']:.4f} | 1.00 |",
        f"| Mod-X (teacher forward + KL) | {med['modx']:.4f} | {timing['ratio']:.2f} |",
        "",
    ]
    stage = {
        label: statistics.median(d["training"]["median_step_s"] for d in results[label])
        for label in labels
        if label != "joint"
    }
    if "finetune" in stage:
        lines += [
            "Whole stage step (shard reading, JPEG decode, augmentation included), median over phases:",
            "",
            "| method | s / step | x fine-tuning |",
            "|---|---:|---:|",
        ]
        for label, v in stage.items():
            lines.append(f"| {label} | {v:.4f} | {v / stage['finetune']:.2f} |")
        lines.append("")
    lines += [
        f"Command: `.venv/bin/python benchmarks/continual.py {' '.join(meta['argv'])}`".rstrip() + "",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger().setLevel(logging.WARNING)  # open_clip logs model creation on the root logger
    log.setLevel(logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from compat.data.shift import earlier_word_shares
    from compat.device import resolve_device
    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings, run_continual

    t_start = time.perf_counter()
    runs = args.work / "runs"
    stream, manifest = make_stream(args)
    if runs.exists():
        shutil.rmtree(runs)
    settings = TrainingSettings.from_section(
        TrainingSection(),
        config_name=args.config,
        steps=args.clip0_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        checkpoint_every=0,
        seed=args.seed,
        device=args.device,
    )
    clip0_doc = run_continual(stream, 0, runs / "clip0", settings, resume=False)
    clip0 = runs / "clip0" / "model"
    add_class_accuracy(args, stream, clip0_doc, clip0, 0)
    log.info("CLIP_0: %s", r1(clip0_doc, manifest["phases"][0]["domain"]))
    results: dict[str, list[dict[str, Any]]] = {}
    results["finetune"] = run_method(args, stream, runs, "finetune", clip0, None, "finetune")
    results["modx"] = run_method(args, stream, runs, "modx", clip0, args.alpha, "modx")
    for lr in [float(x) for x in args.extra_lrs.split(",") if x.strip()]:
        results[f"finetune lr={lr:g}"] = run_method(
            args, stream, runs, "finetune", clip0, None, f"finetune-lr{lr:g}", lr
        )
        results[f"modx lr={lr:g}"] = run_method(
            args, stream, runs, "modx", clip0, args.alpha, f"modx-lr{lr:g}", lr
        )
    for a in [float(x) for x in args.extra_alphas.split(",") if x.strip()]:
        results[f"modx a={a:g}"] = run_method(args, stream, runs, "modx", clip0, a, f"modx-a{a:g}")
    if args.buffer_size > 0:
        results["finetune + buffer"] = run_buffered(args, stream, runs, clip0, 0.0, "finetune + buffer")
        buffer_alpha = args.alpha if args.buffer_alpha is None else args.buffer_alpha
        results["modx + buffer"] = run_buffered(args, stream, runs, clip0, buffer_alpha, "modx + buffer")
    if not args.skip_joint:
        results["joint"] = run_method(args, stream, runs, "joint", clip0, None, "joint")
    sweep = sweep_phase1(args, stream, runs, clip0, results) if args.sweep_lrs else []
    buffer_sweep = []
    for a in [float(x) for x in args.sweep_buffer_alphas.split(",") if x.strip()] if args.buffer_size else []:
        if a == 0:
            doc = results["finetune + buffer"][0]
        elif a == (args.alpha if args.buffer_alpha is None else args.buffer_alpha):
            doc = results["modx + buffer"][0]
        else:
            doc = run_buffered(args, stream, runs / "sweep", clip0, a, f"modx + buffer a={a:g}", 1)[0]
        buffer_sweep.append({"alpha": a, "doc": doc})
    device = str(resolve_device(args.device))
    sd_rows = {
        label: domain0_disorder(clip0, results[label], stream, device)
        for label in ("finetune", "modx", "finetune + buffer", "modx + buffer")
        if label in results
    }
    timing = time_steps(args, clip0, stream)
    from compat.models import read_sidecar

    meta = {
        "domains": [p["domain"] for p in manifest["phases"]],
        "shares": [r["earlier_word_share"] for r in earlier_word_shares(stream, manifest=manifest)],
        "device": device,
        "parameters": read_sidecar(clip0)["parameters"],
        "wall_s": time.perf_counter() - t_start,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(render(args, meta, clip0_doc, results, timing, sd_rows, sweep, buffer_sweep))
    raw = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "meta": meta,
        "clip0": clip0_doc,
        "results": results,
        "timing": timing,
        "sd_rows": sd_rows,
        "sweep": sweep,
        "buffer_sweep": buffer_sweep,
    }
    (args.work / "continual.json").write_text(json.dumps(raw, indent=1, default=str))
    log.info(
        "wrote %s (%.1f min); raw figures in %s",
        args.results,
        meta["wall_s"] / 60,
        args.work / "continual.json",
    )


if __name__ == "__main__":
    main()
