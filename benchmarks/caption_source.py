"""Where a search hit's caption and lineage come from: the gallery shard its row names against Feast's online
store, per request of k hits, side by side in one run.

A gallery of ``--items`` captioned 64 px PNGs in shards of 1,000 (as ``data import`` writes them) and their
lineage written to a local Feast repo the way indexing writes it (``LineageStore.write_items``: sqlite
online store). Each request asks for ``--k`` random items:

- shard, warm: :class:`components.serving.captions.ShardCaptions` as the service keeps it (one long-lived
  cache of 64 shards; the gallery's shards all read once before timing);
- shard, cold: a fresh cache per request (every shard a request touches read from disk: the first requests
  after a start, or a gallery larger than the cache);
- shard, cold, Feast answering the misses: what ``compatflow serve`` does with a lineage repo (a fresh
  cache per request; the misses answered by one online read while their shards load in the background,
  waited for between requests, not in them);
- Feast online: ``LineageStore.get_items`` (``get_online_features`` for the k ids: caption, image URI, model
  version, space, embedded time, phase, domain).

The table goes into ``benchmarks/results/lineage.md``.

    .venv/bin/python benchmarks/caption_source.py [--items 20000] [--k 10] [--requests 200]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "lineage.md"
PER_SHARD = 1000


def make_gallery(root: Path, n: int) -> list[str]:
    """``n`` items in shards under ``root``; returns each item's ``source_uri`` (``<shard>#<key>``)."""
    from PIL import Image

    from compat.data.shards import write_shard

    rng = random.Random(0)
    uris = []
    for start in range(0, n, PER_SHARD):
        shard = root / f"gallery-{start // PER_SHARD:05d}.tar"
        samples = []
        for i in range(start, min(n, start + PER_SHARD)):
            picture = io.BytesIO()
            colour = tuple(rng.randrange(256) for _ in range(3))
            Image.new("RGB", (64, 64), colour).save(picture, "PNG")
            key = f"item{i:07d}"
            caption = f"a photo of item {i} in colour {colour}"
            samples.append((key, {"png": picture.getvalue(), "txt": caption.encode()}))
            uris.append(f"{shard}#{key}")
        write_shard(shard, samples)
    return uris


def write_lineage(repo: Path, uris: list[str]) -> object:
    from components.adapters.lineage import LineageStore

    store = LineageStore(repo)
    store.apply()
    rows = [
        {
            "item_id": uri.rpartition("#")[2],
            "caption": f"caption {i}",
            "image_uri": uri,
            "model_version": "1",
            "space_id": "space-1",
            "phase": 0,
            "domain": "bench",
        }
        for i, uri in enumerate(uris)
    ]
    store.write_items(rows)
    return store


def timed(
    requests: list[list[str]], answer: Callable[[list[str]], object], before: Callable[[], object] = list
) -> list[float]:
    """Milliseconds per request (``before`` runs ahead of each, untimed)."""
    out = []
    for request in requests:
        before()
        t0 = time.perf_counter()
        answer(request)
        out.append(1000 * (time.perf_counter() - t0))
    return out


def main() -> None:
    from components.serving.captions import ShardCaptions, lineage_captions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="caption-source-") as tmp:
        uris = make_gallery(Path(tmp), args.items)
        store = write_lineage(Path(tmp) / "feast", uris)
        requests = [rng.sample(uris, args.k) for _ in range(args.requests)]
        ids = [[u.rpartition("#")[2] for u in r] for r in requests]
        warm = ShardCaptions()
        warm.lookup(sorted({u.rpartition("#")[0] + "#" for u in uris}))  # every shard read once
        store.get_items(ids[0])  # Feast's first call opens its registry and online store
        fallback = lineage_captions(str(Path(tmp) / "feast"))
        fallback(ids[0])
        served = [ShardCaptions(fallback=fallback)]

        def fresh_cache() -> None:  # the previous request's background reads end first, untimed
            served.pop().wait_for_loads()
            served.append(ShardCaptions(fallback=fallback))

        rows = {
            "shard, warm (the service's cache)": timed(requests, warm.lookup),
            "shard, cold (fresh cache per request)": timed(requests, lambda r: ShardCaptions().lookup(r)),
            "shard, cold, Feast answering the misses (the service)": timed(
                requests, lambda r: served[-1].lookup(r), fresh_cache
            ),
            "Feast online (get_online_features)": timed(ids, store.get_items),
        }
        assert [c for c in warm.lookup(requests[0])] == [c for c in ShardCaptions().lookup(requests[0])]
    write(args, rows)


def write(args: argparse.Namespace, rows: dict[str, list[float]]) -> None:
    load = os.getloadavg()
    warm_p50 = statistics.median(rows["shard, warm (the service's cache)"])
    lines = [
        "# Caption and lineage reads per search request",
        "",
        f"Command: `.venv/bin/python benchmarks/caption_source.py --items {args.items} --k {args.k} "
        f"--requests {args.requests}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load "
        f"average {load[0]:.1f} / {load[1]:.1f} at the end.  ",
        f"Data: {args.items:,} gallery items (64 px PNG + caption) in shards of {PER_SHARD:,}, their lineage "
        f"in a local Feast repo (sqlite online store); {args.requests} requests of {args.k} random items "
        "each, one process, one request at a time.",
        "",
        "| source | p50 ms | p99 ms | mean ms | x shard warm (p50) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ms in rows.items():
        ordered = sorted(ms)
        p50, p99 = statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        lines.append(
            f"| {name} | {p50:.2f} | {p99:.2f} | {statistics.fmean(ordered):.2f} | {p50 / warm_p50:,.0f}x |"
        )
    lines += [
        "",
        "Searches read captions from the shards (the warm cache is what `compatflow serve` keeps); a hit "
        "whose shard is not cached yet (after a start, or a gallery of more shards than the cache) is "
        "answered from Feast's online store while the shard loads in the background. Feast is also read "
        "where lineage is the question (`compatflow lineage`, `--check`).",
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
