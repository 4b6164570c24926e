"""Cost of the drift comparison (components.data.drift.compute_drift): the noise-floor splits scored by
Evidently's column-drift function alone, against a full Evidently report per split (the code before), in the
same run.

Samples come from a generated two-phase stream (phase 0 against phase 1, a real domain shift) with embeddings
under a random-init cf-tiny model, as the drift step computes them. Each row is one call of compute_drift
(the report, its HTML, the noise floors) with one BLAS/OpenMP thread (the step's default), after an untimed
warm-up call of each: the code before is read from git at ``--baseline-commit`` (the last commit of
components/data/drift.py before the change) and run beside today's. Scores and noise floors are compared
too: the same data must give the same ones.

    .venv/bin/python benchmarks/drift.py [--sizes 60 250 500]

Writes benchmarks/results/drift.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.baseline import module_at  # noqa: E402
from benchmarks.sections import publish, results_head  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "drift.md"
# The last commit whose noise floors drew one Evidently report per split.
BASELINE_COMMIT = "6e3e8a85cbf7a61b68cc3d9c78539f30f1eda746"


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds and the result of ``fn(*args, **kwargs)``."""
    start, cpu = time.perf_counter(), cpu_seconds()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, cpu_seconds() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[60, 250, 500], help="samples per side")
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from threadpoolctl import threadpool_limits

    import components.data.drift as today
    from compat.data.synth import generate_stream
    from compat.models import build_model, save_checkpoint
    from compat.production import load_encoder

    work = Path(tempfile.mkdtemp(prefix="bench-drift-"))
    before = module_at(args.baseline_commit, "components/data/drift.py", work)
    largest = max(args.sizes)
    generate_stream(work / "stream", phases=2, samples_per_phase=largest, seed=3)
    bundle = load_encoder(save_checkpoint(build_model("cf-tiny", seed=0), work / "prod", version="v1").parent)
    today.check_evidently_version()
    warm = today.sample_phase(str(work / "stream/phase-00/train/*.tar"), 40, seed=0)
    for module in (before, today):  # imports and first-call costs, untimed
        module.compute_drift(warm[:20], warm[20:], bundle)  # t-SNE needs over 30 points
    rows, mismatches = [], []
    for n in args.sizes:
        reference = today.sample_phase(str(work / "stream/phase-00/train/*.tar"), n, seed=0)
        current = today.sample_phase(str(work / "stream/phase-01/train/*.tar"), n, seed=1)
        html = work / f"report-{n}.html"
        runs = [  # (label, module)
            ("before: a full Evidently report per noise-floor split", before),
            ("today: each split's column scores by Evidently's column-drift function", today),
        ]
        results = {}
        for label, module in runs:
            with threadpool_limits(limits=1):
                wall, cpu, summary = timed(module.compute_drift, reference, current, bundle, html, threads=1)
            results[label] = summary
            rows.append(f"| {n} | {label} | {wall:.1f} | {cpu:.1f} | {summary['severity']} |")
            print(rows[-1], flush=True)
        first, *others = results.values()
        for other in others:
            for name, verdict in first["verdicts"].items():
                new = other["verdicts"][name]
                floors = (verdict["noise_floor"], new["noise_floor"])
                if abs(verdict["score"] - new["score"]) > 1e-9 or floors[0] != floors[1]:
                    mismatches.append(f"{n} per side, {name}: {verdict['score']} -> {new['score']}")
    lines = [
        *results_head(
            "Drift comparison: noise-floor splits without a report, against a report per split",
            f".venv/bin/python benchmarks/drift.py --sizes {' '.join(map(str, args.sizes))}",
            ": wall figures move with the load.",
        ),
        f"Data: a generated stream, phase 0 (reference) against phase 1 (current), N samples per side; image "
        f"and text embeddings under a random-init cf-tiny. One compute_drift call per row (Evidently report, "
        f"its HTML, {today.NOISE_SPLITS} noise-floor splits); baseline: components/data/drift.py at "
        f"{args.baseline_commit[:10]}. CPU s counts this process only (no worker processes are used).",
        "",
        "| N per side | compute_drift | wall s | CPU s | severity |",
        "|---:|---|---:|---:|---|",
        *rows,
        "",
        "Scores and noise floors: "
        + ("identical in every row of a size." if not mismatches else "DIFFER: " + "; ".join(mismatches)),
        "",
        "Where the time went: each ValueDrift of a report draws its widget (a histogram figure per column), "
        "about ten times the cost of its score, and the splits dropped every figure. Today one report (the "
        "HTML on-call reads) is drawn per call; its t-SNE picture of each embedding is most of what is left.",
        "",
    ]
    publish(args.out, lines)


if __name__ == "__main__":
    main()
