"""How far can any query encoder read the production *caption* gallery of a new domain? (image -> text ECC)

Writes benchmarks/results/i2t_ceiling.md. Reuses the models of benchmarks/compat.py (same ``--workdir``,
trained there if missing): production trained on phase 0, the Mod-X + buffer candidate of phase 1.

Per phase, on the eval split (200 images x 5 captions):
- caption separability in the production text space: for each caption, is its nearest other caption one of
  the same image's? (what an ideal query could exploit; chance is 4 / 999);
- within-phase image -> text R@1 of production's and the candidate's image encoders against production's
  caption embeddings of that phase;
- a fitted ceiling for phase 1: the best linear map (ridge, closed form) from the candidate's image features
  to the mean production embedding of each training image's captions, fitted on phase-1 *train* pairs and
  scored on the eval split the same way.

Run: ``.venv/bin/python benchmarks/i2t_ceiling.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "compatflow-bench-compat"
    )
    parser.add_argument("--foundation-config", default="cf-small")
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from compat.data.loader import load_captioned_set
    from compat.data.synth import phase_urls
    from compat.models import load_checkpoint

    t0 = time.perf_counter()
    bench = _compat_benchmark()
    base = bench.prepare(args.workdir, bench.FULL, "cf-tiny", args.foundation_config)
    old, cand = load_checkpoint(base["old"]), load_checkpoint(base["candidate"])
    stream = args.workdir / f"stream-{bench.FULL.samples_per_phase}-{bench.FULL.eval_per_domain}"
    rows = []
    for phase in (0, 1):
        data = load_captioned_set(phase_urls(stream, phase, "eval"))
        flat, owner_list = _owners(data.captions)
        owner = torch.tensor(owner_list)
        text = old.encode_texts(flat, batch_size=256)
        sim = text @ text.T
        sim.fill_diagonal_(-float("inf"))
        separable = 100 * (owner[sim.argmax(1)] == owner).float().mean().item()
        chance = 100 * 4 / (len(flat) - 1)

        def r1(queries: torch.Tensor, text: torch.Tensor = text, owner: torch.Tensor = owner) -> float:
            top = (queries @ text.T).argmax(1)
            return 100 * (owner[top] == torch.arange(len(queries))).float().mean().item()

        row = {
            "phase": phase,
            "separable": separable,
            "chance": chance,
            "old": r1(old.encode_images(data.images, batch_size=256)),
            "candidate": r1(cand.encode_images(data.images, batch_size=256)),
            "ridge": None,
        }
        if phase == 1:
            train = load_captioned_set(phase_urls(stream, phase, "train"))
            x = cand.encode_images(train.images, batch_size=256)
            flat, owner_list = _owners(train.captions)
            per_caption = old.encode_texts(flat, batch_size=256)
            counts = torch.bincount(torch.tensor(owner_list)).unsqueeze(1).to(per_caption.dtype)
            y = torch.zeros(len(train.captions), per_caption.shape[1], dtype=per_caption.dtype)
            y = y.index_add_(0, torch.tensor(owner_list), per_caption) / counts
            w = torch.linalg.solve(x.T @ x + args.ridge * torch.eye(x.shape[1]), x.T @ y)
            queries = torch.nn.functional.normalize(
                cand.encode_images(data.images, batch_size=256) @ w, dim=-1
            )
            row["ridge"] = r1(queries)
        rows.append(row)
    lines = [
        "# Image-to-text ceiling: reading production's captions of a new domain",
        "",
        f"Command: `{' '.join(['.venv/bin/python benchmarks/i2t_ceiling.py', *sys.argv[1:]])}` "
        f"({time.perf_counter() - t0:.0f} s; models of "
        f"benchmarks/compat.py). Eval split per phase: {len(data.images)} images x 5 captions; R@1 in %.",
        "",
        "| phase | caption -> nearest caption of the same image (production text space) | chance "
        "| production image -> production captions R@1 | candidate image -> production captions R@1 "
        f"| best linear map of candidate image features (ridge {args.ridge:g}, fit on phase-1 train) R@1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ridge = "-" if r["ridge"] is None else f"{r['ridge']:.1f}"
        lines.append(
            f"| {r['phase']} | {r['separable']:.1f} | {r['chance']:.1f} | {r['old']:.1f} | "
            f"{r['candidate']:.1f} | {ridge} |"
        )
    lines += [
        "",
        f"Phase 1's words never reached production's text tower: its captions separate in that space "
        f"for {rows[1]['separable']:.1f} % of captions (phase 0: {rows[0]['separable']:.1f} %), and the "
        f"best linear read-out of the candidate's image features finds {rows[1]['ridge']:.1f} % of them. "
        "The image -> text margin of an upgrade can then only come from phase-0 images, where the new "
        "image encoder has to read production's captions better than production's own image encoder "
        f"({rows[0]['old']:.1f} %).",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
