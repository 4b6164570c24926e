"""How far can any query encoder read the production *caption* gallery of a new domain? (image -> text ECC)

Writes benchmarks/results/i2t_ceiling.md. Reuses the models of benchmarks/compat.py (same ``--workdir``,
trained there if missing): production trained on phase 0, the Mod-X + buffer candidate of phase 1.

Per phase, on the eval split (images x 5 captions):
- caption separability in the production text space: for each caption, is its nearest other caption one of
  the same image's? (what an ideal query could exploit; chance is 4 / 999);
- within-phase image -> text R@1 of production's and the candidate's image encoders against production's
  caption embeddings of that phase;
- a fitted ceiling for phase 1 and for both phases together (the ECC's eval set): the best linear map (ridge,
  closed form) from the candidate's image features to the mean production embedding of each training image's
  captions, fitted on the same phases' *train* pairs and scored on the eval split the same way.

Run: ``.venv/bin/python benchmarks/i2t_ceiling.py [--workdir DIR] [--stream realistic]``
(``--eval-per-domain`` and ``--candidate-steps`` as benchmarks/compat.py's, to reuse its models).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sections import publish  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "i2t_ceiling.md"


def _owners(captions: list[list[str]]) -> tuple[list[str], list[int]]:
    flat = [c for cs in captions for c in cs]
    return flat, [i for i, cs in enumerate(captions) for _ in cs]


def _compat_benchmark():
    """benchmarks/compat.py as a module (its name is the library's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compat", ROOT / "benchmarks" / "compat.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _fit_readout(cand, old, train, ridge: float):
    """The ridge map (closed form) from the candidate's image features to the mean production embedding of
    each training image's captions."""
    import torch

    x = cand.encode_images(train.images, batch_size=256)
    flat, owner_list = _owners(train.captions)
    per_caption = old.encode_texts(flat, batch_size=256)
    counts = torch.bincount(torch.tensor(owner_list)).unsqueeze(1).to(per_caption.dtype)
    y = torch.zeros(len(train.captions), per_caption.shape[1], dtype=per_caption.dtype)
    y = y.index_add_(0, torch.tensor(owner_list), per_caption) / counts
    return torch.linalg.solve(x.T @ x + ridge * torch.eye(x.shape[1]), x.T @ y)


def measure(old, cand, eval_urls: list[str], train_urls: list[str] | None, ridge: float) -> dict:
    """Caption separability and image -> caption R@1 of production, the candidate and (``train_urls``) the
    fitted read-out, on the eval split of ``eval_urls`` (its captions are the gallery)."""
    import torch

    from compat.data.loader import load_captioned_set

    data = load_captioned_set(eval_urls)
    flat, owner_list = _owners(data.captions)
    owner = torch.tensor(owner_list)
    text = old.encode_texts(flat, batch_size=256)
    sim = text @ text.T
    sim.fill_diagonal_(-float("inf"))

    def r1(queries: torch.Tensor) -> float:
        top = (queries @ text.T).argmax(1)
        return 100 * (owner[top] == torch.arange(len(queries))).float().mean().item()

    row = {
        "images": len(data.images),
        "separable": 100 * (owner[sim.argmax(1)] == owner).float().mean().item(),
        "chance": 100 * 4 / (len(flat) - 1),
        "old": r1(old.encode_images(data.images, batch_size=256)),
        "candidate": r1(cand.encode_images(data.images, batch_size=256)),
        "ridge": None,
    }
    if train_urls:
        w = _fit_readout(cand, old, load_captioned_set(train_urls), ridge)
        row["ridge"] = r1(torch.nn.functional.normalize(cand.encode_images(data.images, batch_size=256) @ w))
    return row


def main() -> None:
    import dataclasses

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "compatflow-bench-compat"
    )
    parser.add_argument("--foundation-config", default="cf-small")
    parser.add_argument("--stream", choices=("disjoint", "realistic"), default="disjoint")
    parser.add_argument("--old-word-share", type=float, default=0.6, help="realistic stream: the knob")
    parser.add_argument("--eval-per-domain", type=int, default=None, help="as benchmarks/compat.py's")
    parser.add_argument("--candidate-steps", type=int, default=None, help="as benchmarks/compat.py's")
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from compat.data.synth import phase_urls
    from compat.models import load_checkpoint

    t0 = time.perf_counter()
    bench = _compat_benchmark()
    sizes = bench.FULL
    if args.eval_per_domain is not None:
        sizes = dataclasses.replace(sizes, eval_per_domain=args.eval_per_domain)
    if args.candidate_steps is not None:
        sizes = dataclasses.replace(sizes, candidate_steps=args.candidate_steps)
    base = bench.prepare(
        args.workdir,
        sizes,
        "cf-tiny",
        args.foundation_config,
        args.stream,
        args.old_word_share,
        foundation=False,
    )
    old, cand = load_checkpoint(base["old"]), load_checkpoint(base["candidate"])
    stream = base["stream"]
    evals = {p: phase_urls(stream, p, "eval") for p in (0, 1)}
    trains = {p: phase_urls(stream, p, "train") for p in (0, 1)}
    rows = [
        ("0", measure(old, cand, evals[0], None, args.ridge)),
        ("1", measure(old, cand, evals[1], trains[1], args.ridge)),
        (
            "0 + 1 (the ECC's eval set)",
            measure(old, cand, evals[0] + evals[1], trains[0] + trains[1], args.ridge),
        ),
    ]
    lines = [
        "# Image-to-text ceiling: reading production's captions of a new domain",
        "",
        f"Command: `{' '.join(['.venv/bin/python benchmarks/i2t_ceiling.py', *sys.argv[1:]])}` "
        f"({time.perf_counter() - t0:.0f} s; models of benchmarks/compat.py, stream `{args.stream}`). "
        f"Eval split: {sizes.eval_per_domain} images per phase x 5 captions; R@1 in %.",
        "",
        "| phase(s) | images | caption -> nearest caption of the same image (production text space) | chance "
        "| production image -> production captions R@1 | candidate image -> production captions R@1 "
        f"| best linear map of candidate image features (ridge {args.ridge:g}, fit on the same phases' "
        "train) R@1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        ridge = "-" if r["ridge"] is None else f"{r['ridge']:.1f}"
        lines.append(
            f"| {name} | {r['images']} | {r['separable']:.1f} | {r['chance']:.2f} | {r['old']:.1f} | "
            f"{r['candidate']:.1f} | {ridge} |"
        )
    both = rows[2][1]
    lines += [
        "",
        f"Phase 1's captions separate in production's text space for {rows[1][1]['separable']:.1f} % of "
        f"captions (phase 0: {rows[0][1]['separable']:.1f} %); the best linear read-out of the candidate's "
        f"image features finds {rows[1][1]['ridge']:.1f} % of phase 1's captions. On the ECC's eval set "
        "(both phases' captions as the gallery) production's image encoder reads them at "
        f"{both['old']:.1f} %, the candidate's at {both['candidate']:.1f} % "
        f"({both['candidate'] - both['old']:+.1f} points) and the linear read-out at {both['ridge']:.1f} % "
        f"({both['ridge'] - both['old']:+.1f}).",
        "",
    ]
    publish(args.out, lines)


if __name__ == "__main__":
    main()
