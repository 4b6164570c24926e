"""Compatibility benchmark: the methods of compat.methods on two upgrades, side by side, in one run.

Writes benchmarks/results/compat.md. All models are trained here, from random init, on the synthetic stream
(phase 0 and phase 1, two domains; ``--stream realistic``, the default, shares a core vocabulary between
them, ``--stream disjoint`` shares no word: the hard stream); every method is evaluated with
compat.evaluation on the eval splits of both phases (multi-caption protocol, paired bootstrap of the
new/old - old/old margins).

- production ("old"): ``--old-config`` (cf-tiny) trained on phase 0 (CLIP loss).
- scenario (a) continual: the Mod-X + buffer candidate of phase 1 (started from production, production as
  teacher, ``replay`` rows of every batch from a buffer of phase-0 pairs: the Mod-X paper's Table 2 variant;
  plain Mod-X forgets phase 0 on this stream, see results/continual.md); compatibility methods train on
  phase 1 plus the buffer (one phase-0 shard).
- scenario (b) foundation swap: ``--foundation-config`` (cf-foundation-minilm: wider/deeper vision tower and
  the pretrained MiniLM text tower) trained from its initialisation on phases 0 + 1; methods train on both.

Rows per scenario: no compatibility training (``none``: the independent new model), BCT (the baseline of
every paper), lambda-orth (strict B or relaxed B_lambda, forward adapter F) with the paper's FCT baseline,
BT^2, XBT with its "Base" baseline (L_Direct, random phi) and TaCA. Columns:
new/old and new/new R@1/5/10 both ways, the ECC at R@1 with its 95 % interval, new/new R@1 retention
against the independent new model, trainable parameters and fit time (``--rows`` selects rows of ``ROWS``).
lambda-orth and FCT rows also get the paper's own columns (F(old)/old ... B(new)/B(new) and the backfill
metric M~: benchmarks/lambda_orth_table.py), the entries where the paper reports lambda-orth ahead.

Run: ``.venv/bin/python benchmarks/compat.py [--quick]``; trained base models are cached in ``--workdir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "compat.md"
log = logging.getLogger("benchmarks.compat")

# label -> (registered method, settings); scenario-specific step counts are added by ``fit_row``
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "none (independent new)": ("none", {}),
    "bct": ("bct", {}),
    "bct + synthesised classifier (BCT new-class rule)": ("bct", {"synthesize_unmatched": True}),
    "fct (lambda-orth baseline)": ("lambda_orth", {"variant": "fct"}),
    "lambda_orth (strict)": ("lambda_orth", {"variant": "strict"}),
    "lambda_orth (relaxed: lambda 12)": ("lambda_orth", {"variant": "relaxed", "lam": 12.0}),
    "lambda_orth (strict: ablation w3 = 0)": ("lambda_orth", {"variant": "strict", "w_contrastive": 0.0}),
    "lambda_orth (strict: old gallery as is)": (
        "lambda_orth",
        {"variant": "strict", "old_vector_rule": "as_is"},
    ),
    "bt2": ("bt2", {}),
    "xbt base (L_Direct with random phi)": ("xbt_base", {}),
    "xbt": ("xbt", {}),
    "taca": ("taca", {}),
}
DEFAULT_FOUNDATION = "cf-foundation-minilm"
BACKBONE_METHODS = {"bct", "bt2", "xbt", "xbt_base", "taca"}  # methods whose ``steps`` train a network


@dataclasses.dataclass
class Sizes:
    samples_per_phase: int
    eval_per_domain: int
    batch_size: int
    old_steps: int
    candidate_steps: int
    foundation_steps: int
    compat_steps: int
    adapter_steps: int
    bootstrap: int
    buffer_size: int = 1000  # replay buffer of phase-0 pairs kept for the phase-1 upgrade (scenario a)
    replay: int = 16  # buffer rows in every batch of the Mod-X candidate


FULL = Sizes(2000, 200, 64, 800, 400, 800, 300, 1500, 1000)
QUICK = Sizes(512, 60, 32, 120, 60, 120, 30, 200, 200, 128, 8)
CANDIDATE_ALPHA = 2.0  # Mod-X + buffer: the phase-1 sweep of benchmarks/continual.py (results/continual.md)
CANDIDATE_LR = 5e-4


# ------------------------------------------------------------------------------------------------ models
def _fingerprint(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def train_clip(
    config_name: str,
    urls: list[str],
    steps: int,
    sizes: Sizes,
    out: Path,
    *,
    seed: int,
    start: Path | None = None,
    teacher: Any = None,
    alpha: float = 0.0,
    lr: float = 1e-3,
    buffer_urls: list[str] | None = None,
    buffer_size: int = 0,
    replay: int = 0,
) -> Path:
    """Train (or reuse from ``out``) a CLIP with compat.training; return its checkpoint directory.

    With ``buffer_size`` and ``replay``, ``replay`` rows of every batch come from a buffer of ``buffer_size``
    pairs of ``buffer_urls`` (Mod-X + buffer, the Mod-X paper's Table 2)."""
    from compat.models import build_model, load_checkpoint, read_sidecar, save_checkpoint
    from compat.training import ReplayBatchSource, ReplayBuffer, ShardBatchSource, TrainConfig, train

    key = _fingerprint(
        {
            "stream": Path(urls[0]).parents[2].name,
            "config": config_name,
            "urls": [Path(u).name for u in urls],
            "steps": steps,
            "seed": seed,
            "start": str(start),
            "alpha": alpha,
            "lr": lr,
            "batch": sizes.batch_size,
            **(
                {
                    "buffer": [Path(u).name for u in buffer_urls or []],
                    "buffer_size": buffer_size,
                    "replay": replay,
                }
                if replay
                else {}
            ),
        }
    )
    ckpt = out / "model"
    if (ckpt / "model.json").is_file() and read_sidecar(ckpt)["extra"].get("fingerprint") == key:
        log.info("reusing %s", ckpt)
        return ckpt
    bundle = load_checkpoint(start) if start is not None else build_model(config_name, seed=seed)
    if replay:
        buffer = ReplayBuffer.from_phases([buffer_urls], buffer_size, seed=seed)
        source = ReplayBatchSource(
            urls, buffer, sizes.batch_size, replay, bundle.preprocess_train, bundle.tokenizer, seed=seed
        )
    else:
        source = ShardBatchSource(
            urls, sizes.batch_size, bundle.preprocess_train, bundle.tokenizer, seed=seed
        )
    config = TrainConfig(
        steps=steps, batch_size=sizes.batch_size, lr=lr, alpha=alpha, seed=seed, log_every=50
    )
    t0 = time.perf_counter()
    train(bundle, source, config, out / "train", teacher=teacher, resume=False)
    seconds = time.perf_counter() - t0
    save_checkpoint(bundle, ckpt, version=out.name, extra={"fingerprint": key, "train_seconds": seconds})
    return ckpt


def prepare(
    workdir: Path,
    sizes: Sizes,
    old_config: str,
    foundation_config: str,
    shift: str = "disjoint",
    old_word_share: float = 0.6,
    foundation: bool = True,
) -> dict[str, Any]:
    """The stream (``shift``: the command line's default is realistic; this default keeps callers such as
    benchmarks/i2t_ceiling.py on the hard stream they were written for), production, the Mod-X candidate
    and (``foundation``) the foundation model, cached by settings."""
    from compat.data.synth import generate_stream, phase_urls
    from compat.models import load_checkpoint

    name = f"stream-{sizes.samples_per_phase}-{sizes.eval_per_domain}"
    stream = workdir / (name if shift == "disjoint" else f"{name}-{shift}-{old_word_share:g}")
    generate_stream(
        stream,
        phases=2,
        samples_per_phase=sizes.samples_per_phase,
        seed=0,
        eval_per_domain=sizes.eval_per_domain,
        gallery_per_domain=0,
        shift=shift,
        old_word_share=old_word_share,
    )
    p0, p1 = phase_urls(stream, 0, "train"), phase_urls(stream, 1, "train")
    print("training production on phase 0", flush=True)
    old = train_clip(old_config, p0, sizes.old_steps, sizes, workdir / "production", seed=0)
    print("training the Mod-X candidate on phase 1", flush=True)
    teacher = load_checkpoint(old)
    candidate = train_clip(
        old_config,
        p1,
        sizes.candidate_steps,
        sizes,
        workdir / "candidate",
        seed=1,
        start=old,
        teacher=teacher,
        alpha=CANDIDATE_ALPHA,
        lr=CANDIDATE_LR,
        buffer_urls=p0,
        buffer_size=sizes.buffer_size,
        replay=sizes.replay,
    )
    if foundation:
        print(f"training the foundation model ({foundation_config}) on phases 0 + 1", flush=True)
        foundation_ckpt = train_clip(
            foundation_config, p0 + p1, sizes.foundation_steps, sizes, workdir / "foundation", seed=2, lr=5e-4
        )
    evals = phase_urls(stream, 0, "eval") + phase_urls(stream, 1, "eval")
    return {
        "old": old,
        "candidate": candidate,
        "foundation": foundation_ckpt if foundation else None,
        "p1": p1,
        # scenario (a) trains on the new phase plus the replay buffer: the first phase-0 shard
        "p1_buffer": p1 + p0[:1],
        "p01": p0 + p1,
        "eval": evals,
        "stream": stream,
    }


# -------------------------------------------------------------------------------------------- scenarios
def fit_row(
    label: str,
    new_ckpt: Path,
    old_ckpt: Path,
    urls: list[str],
    sizes: Sizes,
    data: Any,
    frozen: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit one row's method and evaluate it; returns the report plus timing.

    ``frozen`` keeps the raw old and new embeddings of ``data`` between rows of one scenario (both models
    are frozen for lambda-orth / FCT, so every such row reads the same vectors).
    """
    from compat.compat_training import ShardBatches
    from compat.evaluation import compat_report
    from compat.methods import get_method
    from compat.models import load_checkpoint, read_sidecar

    name, settings = ROWS[label]
    method = get_method(name)
    steps = sizes.compat_steps if name in BACKBONE_METHODS else sizes.adapter_steps
    values = {
        "steps": steps,
        "version": "candidate",
        "old_space_id": str(read_sidecar(old_ckpt)["version"]),
        **settings,
    }
    config = method.make_config(values)
    old, new = load_checkpoint(old_ckpt), load_checkpoint(new_ckpt)
    batches = ShardBatches(urls, sizes.batch_size, seed=config.seed)
    t0 = time.perf_counter()
    model = method.fit(new, old, batches, config)
    fit_seconds = time.perf_counter() - t0
    independent = load_checkpoint(new_ckpt)
    report = compat_report(old, model, data, independent=independent, n_bootstrap=sizes.bootstrap, seed=0)
    result = {"label": label, "report": report, "fit_seconds": fit_seconds}
    if name == "lambda_orth":
        frozen = {} if frozen is None else frozen
        if "vectors" not in frozen:
            frozen["vectors"] = raw_vectors(old, model.new, data)
        result["paper_columns"] = lambda_orth_columns(model, frozen["vectors"], data)
    return result


def raw_vectors(old: Any, new: Any, data: Any) -> tuple[Any, ...]:
    """Raw (no adapter) embeddings of ``data``: old images, old texts, new images, new texts."""
    from compat.evaluation import flatten_captions

    captions, _ = flatten_captions(data)
    return tuple(
        encoder.encode_images(data.images) if kind == "images" else encoder.encode_texts(captions)
        for encoder in (old, new)
        for kind in ("images", "texts")
    )


def lambda_orth_columns(model: Any, vectors: tuple[Any, ...], data: Any) -> dict[str, Any]:
    """A lambda-orth / FCT row in the paper's columns (benchmarks/lambda_orth_table.py)."""
    from benchmarks.lambda_orth_table import paper_columns
    from compat.evaluation import flatten_captions

    _, counts = flatten_captions(data)
    return paper_columns(model.adapters, *vectors, counts)


def run_scenario(
    name: str, new_ckpt: Path, old_ckpt: Path, urls: list[str], sizes: Sizes, rows: list[str], data: Any
) -> list[dict[str, Any]]:
    out, frozen = [], {}
    for label in rows:
        print(f"  [{name}] {label}", flush=True)
        out.append(fit_row(label, new_ckpt, old_ckpt, urls, sizes, data, frozen))
    return out


# ----------------------------------------------------------------------------------------------- render
def _r(report: dict, direction: str, pair: str) -> str:
    row = report["retrieval"][direction][pair]
    return f"{row['R@1']:.1f} / {row['R@5']:.1f} / {row['R@10']:.1f}"


def _ecc(report: dict, direction: str) -> str:
    iv = report["margins"][direction]["R@1"]
    ok = "pass" if report["ecc"][direction]["R@1"] else "FAIL"
    sure = " (CI > 0)" if iv["ci_low"] > 0 else ""
    return f"{ok} {iv['margin']:+.1f} [{iv['ci_low']:+.1f}, {iv['ci_high']:+.1f}]{sure}"


def _retention(report: dict, direction: str) -> float:
    ind = report["independent_new_new"][direction]["R@1"]
    own = report["retrieval"][direction]["new/new"]["R@1"]
    return 100.0 * own / ind if ind > 0 else float("nan")


def render_scenario(title: str, results: list[dict[str, Any]]) -> list[str]:
    from benchmarks.lambda_orth_table import render as render_paper_columns

    first = results[0]["report"]
    ind = first["independent_new_new"]
    sizes = first["eval_sizes"]
    lines = [
        f"### {title}",
        "",
        f"Evaluation: {sizes['images']} images, {sizes['captions']} captions "
        f"({', '.join(sizes.get('domains', []))}). old/old R@1/5/10: t2i "
        f"{_r(first, 't2i', 'old/old')}, i2t {_r(first, 'i2t', 'old/old')}; independent new/new R@1: t2i "
        f"{ind['t2i']['R@1']:.1f}, i2t {ind['i2t']['R@1']:.1f}.",
        "",
        "| method | new/old t2i R@1/5/10 | new/old i2t R@1/5/10 | new/new t2i R@1/5/10 "
        "| new/new i2t R@1/5/10 | ECC t2i R@1: margin [95% CI] | ECC i2t R@1: margin [95% CI] "
        "| retention t2i / i2t | trainable params | fit (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        rep = res["report"]
        cells = [
            res["label"],
            *(_r(rep, d, pair) for pair in ("new/old", "new/new") for d in ("t2i", "i2t")),
            _ecc(rep, "t2i"),
            _ecc(rep, "i2t"),
            f"{_retention(rep, 't2i'):.0f}% / {_retention(rep, 'i2t'):.0f}%",
            f"{rep['trainable_parameters']:,}",
            f"{res['fit_seconds']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    winners = [
        res["label"]
        for res in results
        if all(res["report"]["margins"][d]["R@1"]["ci_low"] > 0 for d in ("t2i", "i2t"))
        and all(_retention(res["report"], d) >= 95 for d in ("t2i", "i2t"))
    ]
    lines += ["", *render_paper_columns(results)]
    lines += [
        "Goal (ECC at R@1 both ways with the interval above zero, and >= 95 % new/new R@1 retention): "
        + (", ".join(winners) if winners else "no method reaches it in this run")
        + ".",
        "",
    ]
    return lines


def render(
    sizes: Sizes,
    args: argparse.Namespace,
    scenarios: list[tuple[str, list]],
    seconds: float,
    base_seconds: dict[str, float],
    base_stream: Path,
) -> str:
    import torch

    from compat.data.shift import earlier_word_shares

    shares = [r["earlier_word_share"] for r in earlier_word_shares(base_stream)]
    lines = [
        "# Compatibility methods: two upgrades, side by side",
        "",
        f"Stream `{args.stream}`"
        + (f" (old_word_share {args.old_word_share:g})" if args.stream == "realistic" else "")
        + f": phase 1's train captions in phase 0's words only, measured: {100 * shares[1]:.0f} %.",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/compat.py', *sys.argv[1:]])}` "
        f"({seconds / 60:.1f} min, torch threads {torch.get_num_threads()}, CPU).",
        "",
        f"Sizes: {sizes.samples_per_phase} training pairs per phase, {sizes.eval_per_domain} eval images per "
        f"domain, batch {sizes.batch_size}; production {args.old_config} trained {sizes.old_steps} steps on "
        f"phase 0 ({base_seconds['old']:.0f} s); Mod-X + buffer candidate (alpha {CANDIDATE_ALPHA:g}, lr "
        f"{CANDIDATE_LR:g}) {sizes.candidate_steps} steps on phase 1 with {sizes.replay} of every "
        f"{sizes.batch_size} rows replayed from a buffer of {sizes.buffer_size} phase-0 pairs "
        f"({base_seconds['candidate']:.0f} s); scenario (a)'s methods train on phase 1 plus a phase-0 shard "
        f"(the buffer); "
        + (
            f"foundation {args.foundation_config} {sizes.foundation_steps} steps on phases 0+1 "
            f"({base_seconds['foundation']:.0f} s). "
            if "b" in args.scenarios
            else "no foundation model (scenario (a) only). "
        )
        + "Compatibility training: "
        f"{sizes.compat_steps} steps for methods that train a network, {sizes.adapter_steps} adapter steps "
        f"for lambda-orth / FCT (on cached features); bootstrap {sizes.bootstrap} resamples.",
        "",
        "Pairs are query model / gallery model; new/old reads the production gallery through each method's "
        "serving contract (none/BCT: as is or zero-padded; lambda-orth/FCT: forward adapter F, unless "
        'the row says "as is"; BT2: truncation). Retention = new/new R@1 relative to the independent new '
        "model. Recall in %.",
        "",
    ]
    if args.foundation_config != DEFAULT_FOUNDATION:
        lines += [
            f"Scenario (b) ran with `--foundation-config {args.foundation_config}` instead of the default "
            f"{DEFAULT_FOUNDATION} (its pretrained MiniLM text tower dominates the CPU step time).",
            "",
        ]
    for title, results in scenarios:
        lines += render_scenario(title, results)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "compatflow-bench-compat"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--old-config", default="cf-tiny")
    parser.add_argument(
        "--stream",
        choices=("realistic", "disjoint", "fashion-mnist"),
        default="realistic",
        help="realistic: phases share a core vocabulary; disjoint: no shared word (the hard stream)",
    )
    parser.add_argument("--old-word-share", type=float, default=0.6, help="realistic stream: the knob")
    parser.add_argument("--foundation-config", default=DEFAULT_FOUNDATION)
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated labels of ROWS ({', '.join(ROWS)})"
    )
    parser.add_argument("--scenarios", default="a,b", help="a (continual), b (foundation swap) or both")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: fastest on a shared machine)"
    )
    parser.add_argument(
        "--eval-per-domain",
        type=int,
        default=None,
        help="eval images per domain (default 200, quick 60): the bootstrap interval narrows with it",
    )
    parser.add_argument(
        "--candidate-steps",
        type=int,
        default=None,
        help="training steps of scenario (a)'s Mod-X + buffer candidate (default 400, quick 60)",
    )
    parser.add_argument(
        "--compat-steps",
        type=int,
        default=None,
        help="training steps of the methods that train a network (default 300, quick 30)",
    )
    args = parser.parse_args()
    if args.stream == "fashion-mnist":
        parser.error(
            "the ECC here is pairwise retrieval at R@1, which Fashion-MNIST's class-only captions make "
            "ill-posed (every image of a class shares its captions, and ties count against the query): "
            "measure that stream with benchmarks/continual.py --stream fashion-mnist (class accuracy)"
        )
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    from compat.data.loader import load_captioned_set
    from compat.models import read_sidecar

    sizes = QUICK if args.quick else FULL
    if args.eval_per_domain is not None:
        if args.eval_per_domain < 10:
            parser.error(f"--eval-per-domain must be >= 10, got {args.eval_per_domain}")
        sizes = dataclasses.replace(sizes, eval_per_domain=args.eval_per_domain)
    if args.candidate_steps is not None:
        if args.candidate_steps < 1:
            parser.error(f"--candidate-steps must be >= 1, got {args.candidate_steps}")
        sizes = dataclasses.replace(sizes, candidate_steps=args.candidate_steps)
    if args.compat_steps is not None:
        if args.compat_steps < 1:
            parser.error(f"--compat-steps must be >= 1, got {args.compat_steps}")
        sizes = dataclasses.replace(sizes, compat_steps=args.compat_steps)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    t_start = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    base = prepare(
        args.workdir,
        sizes,
        args.old_config,
        args.foundation_config,
        args.stream,
        args.old_word_share,
        foundation="b" in args.scenarios,
    )
    base_seconds = {
        k: float(read_sidecar(base[k])["extra"]["train_seconds"]) if base[k] is not None else 0.0
        for k in ("old", "candidate", "foundation")
    }
    data = load_captioned_set(base["eval"])
    scenarios = []
    if "a" in args.scenarios:
        print("scenario (a): continual", flush=True)
        scenarios.append(
            (
                f"(a) continual: {args.old_config} -> Mod-X candidate ({args.old_config})",
                run_scenario("a", base["candidate"], base["old"], base["p1_buffer"], sizes, rows, data),
            )
        )
    if "b" in args.scenarios:
        print("scenario (b): foundation swap", flush=True)
        scenarios.append(
            (
                f"(b) foundation swap: {args.old_config} -> {args.foundation_config}",
                run_scenario("b", base["foundation"], base["old"], base["p01"], sizes, rows, data),
            )
        )
    text = render(sizes, args, scenarios, time.perf_counter() - t_start, base_seconds, base["stream"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
