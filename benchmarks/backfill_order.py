"""k-means for the backfill order at gallery scale: compat.backfill.kmeans (MiniBatchKMeans) against the dense
Lloyd's k-means it replaced (kept below as the baseline), both in this run.

An unlabelled gallery's lambda-orth and uncertainty orders cluster the old vectors into
k = round(sqrt(N / 2)) clusters. The dense version held an N x k float64 distance matrix (and its
temporaries) per iteration; MiniBatchKMeans holds batch_size x k. Data: N points around k random centres in
64-d (centre coordinates and noise both N(0, 1): centres ~11 apart, points ~8 from theirs). Each fit runs in
a fresh process (spawn): peak RSS growth is ru_maxrss after the fit less ru_maxrss before it, data already in
memory. Quality: inertia per point, the adjusted Rand index against the generating clusters, and the overlap
of the first 10 % of the lambda-orth order (the items a partial backfill re-embeds first) with the order the
generating clusters give.

    .venv/bin/python benchmarks/backfill_order.py [--sizes 20000 200000]

Writes benchmarks/results/backfill_order.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sections import publish, results_head  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "backfill_order.md"
DIM = 64
METHODS = (
    ("dense", "before: dense Lloyd's (BLAS threads: library default)"),
    ("minibatch", "MiniBatchKMeans, 1 thread (the default)"),
    ("minibatch-threads", "MiniBatchKMeans, library-default threads"),
)


def dense_lloyd(x: np.ndarray, k: int, seed: int = 0, iters: int = 100, tol: float = 1e-7) -> np.ndarray:
    """The k-means compat.backfill used before (Lloyd's, k-means++ seeding, one init, N x k distances)."""
    n = x.shape[0]
    rng = np.random.default_rng(seed)
    centres = np.empty((k, x.shape[1]))
    centres[0] = x[rng.integers(n)]
    d2 = ((x - centres[0]) ** 2).sum(1)
    for j in range(1, k):
        total = d2.sum()
        idx = int(rng.choice(n, p=d2 / total)) if total > 0 else int(rng.integers(n))
        centres[j] = x[idx]
        d2 = np.minimum(d2, ((x - centres[j]) ** 2).sum(1))
    x_sq = (x**2).sum(1, keepdims=True)
    labels = np.zeros(n, dtype=np.int64)
    for _ in range(iters):
        dist = x_sq - 2.0 * x @ centres.T + (centres**2).sum(1)
        labels = dist.argmin(1)
        new = np.zeros_like(centres)
        np.add.at(new, labels, x)
        counts = np.bincount(labels, minlength=k)
        for j in np.flatnonzero(counts == 0):
            far = int(dist[np.arange(n), labels].argmax())
            new[j], counts[j], labels[far] = x[far], 1, j
        new /= counts[:, None]
        shift = float(((new - centres) ** 2).sum())
        centres = new
        if shift <= tol:
            break
    return labels


def gallery(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n points around k = default_n_clusters(n) random centres in DIM-d, and their generating cluster."""
    from compat.backfill import default_n_clusters

    rng = np.random.default_rng(seed)
    k = default_n_clusters(n)
    centres = rng.normal(size=(k, DIM))
    truth = rng.integers(k, size=n)
    return centres[truth] + rng.normal(size=(n, DIM)), truth


def run_one(args: tuple[str, int]) -> dict[str, object]:
    """One fit in this (fresh) process: seconds, peak RSS growth, labels."""
    from compat import backfill as bf

    method, n = args
    x, _ = gallery(n)
    k = bf.default_n_clusters(n)
    if method != "dense":
        from sklearn.cluster import MiniBatchKMeans  # noqa: F401  (imported before the RSS mark)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if method == "dense":
        labels = dense_lloyd(x, k)
    else:
        labels = bf.kmeans(x, k, seed=0, threads=1 if method == "minibatch" else None)[1]
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"seconds": seconds, "rss_mib": grown / 1024, "labels": labels}


def quality(n: int, labels: np.ndarray) -> tuple[float, float, float]:
    """Inertia per point, ARI and top-10 % lambda-orth overlap against the generating clusters."""
    from sklearn.metrics import adjusted_rand_score

    from compat import backfill as bf

    x, truth = gallery(n)
    d = bf.class_mean_distances(x, labels)
    inertia = float((d**2).mean())
    top = max(1, n // 10)
    ours = set(np.argsort(-d, kind="stable")[:top].tolist())
    theirs = set(np.argsort(-bf.class_mean_distances(x, truth), kind="stable")[:top].tolist())
    return inertia, float(adjusted_rand_score(truth, labels)), len(ours & theirs) / top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 200000])
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    from compat.backfill import KMEANS_BATCH_SIZE, KMEANS_N_INIT, default_n_clusters

    ctx = mp.get_context("spawn")
    rows = []
    for n in args.sizes:
        results = {}
        for method, _ in METHODS:
            with ctx.Pool(1) as pool:  # a fresh process per fit: its own peak RSS
                results[method] = pool.apply(run_one, ((method, n),))
            print(f"N={n} {method}: {results[method]['seconds']:.1f} s", flush=True)
        for method, label in METHODS:
            r = results[method]
            inertia, ari, overlap = quality(n, r["labels"])
            rows.append(
                f"| {n:,} | {default_n_clusters(n)} | {label} | {r['seconds']:.2f} | "
                f"{results['dense']['seconds'] / r['seconds']:.1f}x | {r['rss_mib']:,.0f} | {inertia:.2f} | "
                f"{ari:.3f} | {overlap:.3f} |"
            )
    lines = [
        *results_head(
            "k-means for the backfill order: MiniBatchKMeans against dense Lloyd's",
            f".venv/bin/python benchmarks/backfill_order.py --sizes {' '.join(map(str, args.sizes))}",
            ".",
        ),
        f"Data: N points around k = round(sqrt(N/2)) random centres, {DIM}-d, centre coordinates and noise "
        "N(0, 1). "
        f"MiniBatchKMeans: n_init={KMEANS_N_INIT}, batch_size={KMEANS_BATCH_SIZE}, seed 0; dense: one "
        "k-means++ init, up to 100 Lloyd iterations. Each fit in a fresh process; peak RSS growth = "
        "ru_maxrss after the fit less before it (data already loaded). Inertia = mean squared distance to "
        "the cluster mean (lower is better); ARI against the generating clusters (1 = recovered); top-10 % "
        "overlap = share of the lambda-orth order's first 10 % that the order from the generating clusters "
        "also puts there (1 = the same items re-embedded first).",
        "",
        "| N | k | k-means | wall s | speed-up | peak RSS growth MiB | inertia/point | ARI "
        "| top-10 % overlap |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    publish(args.out, lines)


if __name__ == "__main__":
    main()
