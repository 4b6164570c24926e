"""Partial backfill benchmark: ordering policies, the staged engine on Milvus, throughput, query latency.

Writes benchmarks/results/backfill.md. Four parts, all measured in the same run:

A. Backfill curves (t2i R@1 vs fraction backfilled) of every ordering policy against random, on the
   known-geometry upgrade of benchmarks/synthetic_upgrade.py (trained checkpoints are not part of the
   repository, so the geometry is synthetic: clustered items whose old vectors are noisier the older they
   are). Area = E_beta[R@1] (trapezoid over 21 fractions); the fraction needed to reach new/new R@1.
B. The real engine (components.rollout) on a milvus-lite server on 127.0.0.1: one staged rollout per
   policy (stages 10/25/50/100 %, probe floors = old/old), its recorded curve against the numpy curve.
C. Throughput: the cf-tiny image encoder (random init: the cost does not depend on the weights; the
   re-embedding writes the same weights, so every probe passes) re-embeds a gallery of rendered stream
   images (JPEG decode + preprocess + forward). Backfill items/s against the bare gallery encoder on the
   same batches (the physical limit) and against the raw forward on preprocessed tensors.
D. Query latency p50/p99 under a bounded concurrent load (2 client processes, fixed rate each) on
   loopback, idle against during the backfill of C; failed queries.
E. Queries through the search service (``compatflow serve``) at a fixed open-loop rate during complete
   rollouts (staged with and without the SLO throttle, blue-green) and their rollbacks, on a milvus-lite
   server and on Milvus standalone (:mod:`benchmarks.service_load`; ``--service-only`` runs it alone).
   Milvus standalone needs a loopback-only network namespace: as root the benchmark enters one itself.

Run: ``.venv/bin/python benchmarks/backfill.py [--quick]`` (about 3-5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import backfill_curves as bc  # noqa: E402
from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE  # noqa: E402
from benchmarks.synthetic_upgrade import synthetic_upgrade  # noqa: E402

SLO_FACTOR = 1.5
RESULTS = ROOT / "benchmarks" / "results" / "backfill.md"
os.environ.setdefault("COMPATFLOW_TRUSTED_MODULES", SYNTH_MODULE)  # its encoders are named in serving records
log = logging.getLogger("benchmarks.backfill")


# ------------------------------------------------------------------------------------------------ helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MilvusServer:
    """``milvus-lite server`` bound to 127.0.0.1 on a free port, for the benchmark's lifetime."""

    def __init__(self, data_dir: Path) -> None:
        exe = Path(sys.executable).with_name("milvus-lite")
        self.port = _free_port()
        self.log = open(data_dir / "server.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(exe),
                "server",
                "--data-dir",
                str(data_dir / "data"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"milvus-lite server did not start; see {data_dir / 'server.log'}"
                    ) from None
                time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far (Linux /proc)."""
        from benchmarks.service_load import cpu_seconds

        return cpu_seconds(self.proc.pid)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------------------- part A
def part_a(n_items: int, n_queries: int) -> dict[str, Any]:
    u = synthetic_upgrade(n_items=n_items, n_queries=n_queries, seed=0)
    m_old = bc.t2i_recall_metric(u.old_queries, u.positives, ks=(1,))
    m_new = bc.t2i_recall_metric(u.new_queries, u.positives, ks=(1,))
    ref = {
        "old/old": m_old(u.old_gallery)["R@1"],
        "new/old": m_new(u.old_gallery)["R@1"],
        "new/new": m_new(u.new_gallery)["R@1"],
    }
    fractions = bc.DEFAULT_CURVE_FRACTIONS
    orders = {
        p: bc.compute_order(p, n_items, seed=0, embedded_at=u.embedded_at, vectors=u.old_gallery)
        for p in bc.ORDERS
    }
    orders["lambda_orth (class labels)"] = bc.order_lambda_orth(u.old_gallery, u.labels)
    curves, out = {}, {}
    for name, order in orders.items():
        t0 = time.perf_counter()
        values = [p["R@1"] for p in bc.backfill_curve(m_new, u.old_gallery, u.new_gallery, order, fractions)]
        curves[name] = values
        out[name] = {
            "area": bc.curve_area(fractions, values),
            "reach": bc.fraction_to_reach(fractions, values, ref["new/new"]),
            "reach_1pt": bc.fraction_to_reach(fractions, values, ref["new/new"] - 1.0),
            "seconds": time.perf_counter() - t0,
        }
    return {
        "ref": ref,
        "fractions": fractions,
        "curves": curves,
        "summary": out,
        "n_items": n_items,
        "n_queries": n_queries,
        "upgrade": u,
    }


# ---------------------------------------------------------------------------------------------- part B
def part_b(uri: str, work: Path, n_items: int, n_queries: int) -> dict[str, Any]:
    from benchmarks.synthetic_upgrade import synthetic_encoders
    from components import rollout as ro
    from components.adapters.index import GalleryIndex
    from components.deployment import RolloutSection

    opts = {"n_items": str(n_items), "n_queries": str(n_queries), "seed": "1"}
    u = synthetic_upgrade(n_items=n_items, n_queries=n_queries, seed=1)
    probe = ro.ProbeSet(u.query_texts, [[u.item_ids[p[0]]] for p in u.positives])
    m_new = bc.t2i_recall_metric(u.new_queries, u.positives, ks=(1,))
    results = {}
    for policy in bc.ORDERS:
        paths = ro.RolloutPaths.for_workspace(work / policy)
        with GalleryIndex(uri, alias=f"bench_{policy}") as index:
            u.index_old_gallery(index, paths, opts, space="syn")
            config = ro.RolloutConfig.from_section(
                RolloutSection(),
                new_version="v2",
                order=policy,
                batch_size=256,
                query_model={
                    "factory": f"{SYNTH_MODULE}:synthetic_query_encoder",
                    "options": opts,
                    "side": "new",
                },
            )
            t0 = time.perf_counter()
            state = ro.run_rollout(
                index, paths, config, synthetic_encoders({"options": opts}), probe
            ).document()
            seconds = time.perf_counter() - t0
            by_version = index.count_by_version()
            # the stage that wrote each item (backfill_stage: 1 + its stage): the order the engine ran
            written = [
                (r["backfill_stage"], r["item_id"])
                for page in index.iter_rows(("backfill_stage",), batch_size=4096)
                for r in page
            ]
        engine = [p["t2i_R@1"] for p in state["curve"]]
        position = {item: j for j, item in enumerate(u.item_ids)}
        order = np.array([position[i] for _, i in sorted(written)])
        stages = np.bincount([stage - 1 for stage, _ in written])
        fr = [0.0, *(np.cumsum(stages[1:]) / len(written)).tolist()]  # each stage's exact share
        numpy_curve = [p["R@1"] for p in bc.backfill_curve(m_new, u.old_gallery, u.new_gallery, order, fr)]
        results[policy] = {
            "status": state["status"],
            "fractions": fr,
            "engine": engine,
            "numpy": numpy_curve,
            "baseline": state["baseline"]["R@1"],
            "seconds": seconds,
            "by_version": by_version,
            "area_engine": bc.curve_area(fr, engine) if fr[0] == 0 and fr[-1] == 1 else None,
            "area_numpy": bc.curve_area(fr, numpy_curve) if fr[0] == 0 and fr[-1] == 1 else None,
        }
    return results


# --------------------------------------------------------------------------------------------- parts C/D
def _query_worker(uri: str, alias: str, queries: np.ndarray, qps: float, stop: Any, out: Any) -> None:
    from components.adapters.index import GalleryIndex

    lat, failed, i = [], 0, 0
    with GalleryIndex(uri, alias) as index:
        index.search(queries[:1], k=10)  # connect and load before measuring
        next_t = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                hits = index.search(queries[i % len(queries)][None], k=10)
                if not hits or not hits[0]:
                    failed += 1
            except Exception:  # noqa: BLE001 - a failed query is what is being counted
                failed += 1
            lat.append(time.perf_counter() - t0)
            i += 1
            next_t += 1.0 / qps
            time.sleep(max(0.0, next_t - time.perf_counter()))
    out.put({"latencies": lat, "failed": failed})


class QueryLoad:
    """``workers`` client processes, each sending one k=10 search every 1/qps s (bounded, open loop)."""

    def __init__(
        self, uri: str, alias: str, queries: np.ndarray, workers: int = 2, qps: float = 20.0
    ) -> None:
        ctx = mp.get_context("spawn")
        self.stop, self.out = ctx.Event(), ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_query_worker, args=(uri, alias, queries[w::workers], qps, self.stop, self.out)
            )
            for w in range(workers)
        ]

    def __enter__(self) -> QueryLoad:
        for p in self.procs:
            p.start()
        time.sleep(4.0)  # workers import, connect and warm up before the measured window
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        results = [self.out.get(timeout=60) for _ in self.procs]
        for p in self.procs:
            p.join(timeout=30)
        lat = np.array([x for r in results for x in r["latencies"]]) * 1000.0
        self.result = {
            "queries": int(lat.size),
            "failed": int(sum(r["failed"] for r in results)),
            "p50": float(np.percentile(lat, 50)) if lat.size else None,
            "p99": float(np.percentile(lat, 99)) if lat.size else None,
            "max": float(lat.max()) if lat.size else None,
        }


def _gallery_images(n: int) -> tuple[list[bytes], str]:
    """JPEG bytes of ``n`` gallery items rendered by the data stream generator."""
    try:
        from compat.data.synth import make_sample

        blobs = [make_sample(0, 0, "gallery", i, 64)[1]["jpg"] for i in range(n)]
        source = "stream renderer (compat.data.synth.make_sample), 64x64 JPEG"
    except Exception as err:  # noqa: BLE001 - the renderer is optional for a throughput figure
        from PIL import Image

        rng = np.random.default_rng(0)
        blobs = []
        for _ in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
            blobs.append(buf.getvalue())
        source = f"random 64x64 JPEG (stream renderer unavailable: {err})"
    return blobs, source


def _set_affinity(pid: int, cores: set[int]) -> None:
    """Pin every thread of process ``pid`` (threads started later inherit it) to ``cores``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cores)


@contextlib.contextmanager
def index_on_its_own_core(server: MilvusServer) -> Iterator[bool]:
    """The production topology on one machine: the Milvus server on one core, the rollout process (its
    encoder with one torch thread) on the others; yields False (and pins nothing) on a 1-core machine."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield False
        return
    threads = torch.get_num_threads()
    _set_affinity(server.proc.pid, {cores[-1]})
    _set_affinity(os.getpid(), set(cores[:-1]))
    torch.set_num_threads(len(cores) - 1)
    try:
        yield True
    finally:
        torch.set_num_threads(threads)
        _set_affinity(os.getpid(), set(cores))
        _set_affinity(server.proc.pid, set(cores))


def part_cd(server: MilvusServer, work: Path, n_items: int, batch: int, idle_s: float) -> dict[str, Any]:
    import torch
    from PIL import Image

    from compat.models import build_model
    from components import rollout as ro
    from components.adapters.index import GalleryIndex
    from components.deployment import RolloutSection

    uri = server.uri
    bundle = build_model("cf-tiny", seed=0)
    blobs, source = _gallery_images(n_items)
    ids = [f"img-{i:06d}" for i in range(n_items)]
    blob_of = dict(zip(ids, blobs, strict=True))

    def encode_blobs(chunk: list[bytes]) -> np.ndarray:
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in chunk]
        return bundle.encode_images(images, batch_size=len(images)).numpy()

    def gallery_encoder(refs):
        return encode_blobs([blob_of[r.item_id] for r in refs])

    def encode_all() -> np.ndarray:
        return np.concatenate([encode_blobs(blobs[s : s + batch]) for s in range(0, n_items, batch)])

    def bare_encoder(in_worker: bool = True) -> tuple[np.ndarray, float]:
        """The same batches with no index work; by default on a worker thread, as the engine encodes
        (torch CPU throughput differs between the main thread and a worker thread on this machine)."""
        t0, c0 = time.perf_counter(), time.process_time()
        if in_worker:
            with ThreadPoolExecutor(max_workers=1) as pool:
                out = pool.submit(encode_all).result()
        else:
            out = encode_all()
        bare_cpu[in_worker] = time.process_time() - c0
        return out, n_items / (time.perf_counter() - t0)

    bare_cpu: dict[bool, float] = {}

    encode_blobs(blobs[:batch])  # warm-up
    vectors, _ = bare_encoder()
    main_thread = bare_encoder(in_worker=False)[1]
    tensors = torch.stack(
        [bundle.preprocess_eval(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs[:batch]]
    )
    with torch.no_grad():
        bundle.model.encode_image(tensors)
        reps = max(1, n_items // batch)
        t0 = time.perf_counter()
        for _ in range(reps):
            bundle.model.encode_image(tensors)
        raw = reps * batch / (time.perf_counter() - t0)

    rng = np.random.default_rng(0)
    probe_idx = rng.choice(n_items, size=min(200, n_items), replace=False)
    same_image: dict[bytes, list[str]] = {}
    for item, blob in blob_of.items():  # identical renders are equally relevant
        same_image.setdefault(blob, []).append(item)
    probe = ro.ProbeSet([ids[i] for i in probe_idx], [same_image[blobs[i]] for i in probe_idx])
    lookup = dict(zip(ids, vectors, strict=True))

    def probe_queries(texts):  # image-to-image probe: the item's own embedding (identical weights)
        return np.stack([lookup[t] for t in texts])

    encoders = ro.RolloutEncoders(
        old_query=probe_queries, new_query=probe_queries, new_gallery=gallery_encoder
    )
    queries = vectors[rng.choice(n_items, size=512, replace=False)]

    def one_rollout(
        alias: str, load_s: float | None, slo: float | None = None, fractions: tuple[float, ...] | None = None
    ) -> dict[str, Any]:
        """Index the old vectors under ``alias``, then roll out (SLO throttle ``slo``, backfill stages
        ``fractions``); with ``load_s``, under the query load."""
        paths = ro.RolloutPaths.for_workspace(work / alias)
        with GalleryIndex(uri, alias=alias) as index:
            ro.index_gallery(
                index,
                paths,
                ids,
                vectors,
                version="v1",
                space="cf-tiny",
                query_model={"version": "v1", "factory": "components.serving.record:model_query_encoder"},
            )
        idle = during = None
        if load_s is not None:
            with QueryLoad(uri, alias, queries) as load:
                time.sleep(load_s)
            idle = load.result
        config = ro.RolloutConfig.from_section(
            RolloutSection(),
            new_version="v2",
            order="random",
            batch_size=batch,
            slo_p99_factor=slo,
            **({"fractions": fractions} if fractions else {}),
        )
        with GalleryIndex(uri, alias=alias) as index:
            with contextlib.ExitStack() as stack:
                load = stack.enter_context(QueryLoad(uri, alias, queries)) if load_s is not None else None
                t0, c0, s0 = time.perf_counter(), time.process_time(), server.cpu_seconds()
                state = ro.run_rollout(index, paths, config, encoders, probe).document()
                wall = time.perf_counter() - t0
                client_cpu, server_cpu = time.process_time() - c0, server.cpu_seconds() - s0
            during = load.result if load is not None else None
            by_version, count = index.count_by_version(), index.count()
        stages = [s for s in state["stages"] if s["kind"] == "backfill"]
        bounds = [0] + [s["target_position"] for s in stages]
        writing = sum(
            (hi - lo) / s["items_per_s"]
            for lo, hi, s in zip(bounds[:-1], bounds[1:], stages, strict=True)
            if hi > lo
        )
        return {
            "status": state["status"],
            "items_per_s": n_items / writing,
            "staged_items_per_s": n_items / sum(s["seconds"] for s in stages),
            "probe_s": sum(s["seconds"] for s in stages) - writing,
            "wall": wall,
            "client_cpu": client_cpu,
            "server_cpu": server_cpu,
            "count": count,
            "by_version": by_version,
            "idle": idle,
            "during": during,
            "pace": state.get("pace") or {},
        }

    def measured(
        alias: str,
        load_s: float | None = None,
        bare_first: bool = True,
        slo: float | None = None,
        fractions: tuple[float, ...] | None = None,
    ) -> dict[str, Any]:
        """One rollout and the bare encoder back to back (the machine's load drifts)."""
        bare = bare_encoder()[1] if bare_first else None
        run = one_rollout(alias, load_s, slo, fractions)
        bare = bare if bare is not None else bare_encoder()[1]
        return {
            **run,
            "bare": bare,
            "bare_cpu": bare_cpu[True],
            "ratio": run["items_per_s"] / bare,
            "staged_ratio": run["staged_items_per_s"] / bare,
        }

    rounds = [measured(f"tput_{r}") for r in range(3)]
    with index_on_its_own_core(server) as ok:
        pinned = [measured(f"tput_pinned_{r}") for r in range(2 if ok else 0)]
        # one backfill stage: no stage ends before the last, so no batch is encoded ahead of its stage
        single = [measured(f"tput_single_{r}", fractions=(1.0,)) for r in range(2 if ok else 0)]
    loaded = measured("tput_load", idle_s, bare_first=False)
    throttled = measured("tput_load_slo", idle_s, bare_first=False, slo=SLO_FACTOR)
    return {
        "throttled": throttled,
        "raw": raw,
        "main_thread": main_thread,
        "rounds": rounds,
        "pinned": pinned,
        "single": single,
        "loaded": loaded,
        "n_items": n_items,
        "batch": batch,
        "source": source,
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------- report
def render(a: dict[str, Any], b: dict[str, Any], cd: dict[str, Any], seconds: float, command: str) -> str:
    lines = [
        "# Partial backfill: orderings, staged engine, throughput, query latency",
        "",
        f"Command: `{command}` (total {seconds:.0f} s, 2-core CPU machine shared with other work; "
        "all figures measured in this run).",
        "",
    ]
    ref, summ = a["ref"], a["summary"]
    base = summ["random"]["area"]
    lines += [
        "## A. Backfill curves per ordering (synthetic known-geometry upgrade)",
        "",
        f"{a['n_items']} gallery items, {a['n_queries']} text queries, 20 clusters, 32-d; old vectors are "
        "noisier for older items (by construction), new vectors uniformly better. Metric t2i R@1 (%). "
        "Area = E_beta[R@1] over beta ~ U[0,1] (trapezoid, 21 fractions).",
        "",
        f"Reference: old/old {ref['old/old']:.2f}, new/old (beta=0) {ref['new/old']:.2f}, "
        f"new/new (beta=1) {ref['new/new']:.2f}.",
        "",
        "| ordering | area E_beta[R@1] | vs random | fraction to reach new/new R@1 | within 1 pt "
        "| R@1 @10% | @25% | @50% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fr = list(a["fractions"])
    for name, s in summ.items():
        c = a["curves"][name]
        lines.append(
            f"| {name} | {s['area']:.2f} | {s['area'] - base:+.2f} | {_fmt(s['reach'])} | "
            f"{_fmt(s['reach_1pt'])} | "
            f"{np.interp(0.1, fr, c):.2f} | {np.interp(0.25, fr, c):.2f} | {np.interp(0.5, fr, c):.2f} |"
        )
    lines += [
        "",
        "Curve points (t2i R@1 %):",
        "",
        "| fraction | " + " | ".join(summ) + " |",
        "|---" * (len(summ) + 1) + "|",
    ]
    for j, f in enumerate(fr):
        if j % 2 == 0:
            lines.append(f"| {f:.2f} | " + " | ".join(f"{a['curves'][n][j]:.2f}" for n in summ) + " |")
    lines += [
        "",
        "## B. Staged engine on Milvus (milvus-lite server, 127.0.0.1)",
        "",
        "One rollout per policy: stage 0 query switch, stages 10/25/50/100 %, probe floors = old/old "
        "R@1/5/10, HNSW (COSINE). Engine curve = probe R@1 recorded in the rollout state after each stage; "
        "numpy = exact recall on the same mixed gallery.",
        "",
        "| policy | state | old/old | engine R@1 at 0/10/25/50/100 % | numpy R@1 same points | area engine | "
        "area numpy | wall s | final versions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, r in b.items():
        lines.append(
            f"| {policy} | {r['status']} | {r['baseline']:.2f} | "
            f"{' / '.join(f'{x:.1f}' for x in r['engine'])} | {' / '.join(f'{x:.1f}' for x in r['numpy'])} | "
            f"{_fmt(r['area_engine'])} | {_fmt(r['area_numpy'])} | {r['seconds']:.1f} | {r['by_version']} |"
        )
    rounds, loaded = cd["rounds"], cd["loaded"]
    median_ratio = float(np.median([r["ratio"] for r in rounds]))
    lines += [
        "",
        "## C. Backfill throughput vs the bare encoder (cf-tiny image encoder)",
        "",
        f"{cd['n_items']} gallery items ({cd['source']}), batch {cd['batch']}, torch threads "
        f"{cd['threads']}. Bare encoder = the same gallery-encoder callable (JPEG decode + preprocess + "
        "forward) on the same batches with no index work, on a worker thread as the engine encodes, "
        "measured right before each backfill (the shared machine's load drifts). Two backfill figures: "
        "**writing** = items / time inside the backfill stages' writes (restore capture, encode, upsert, "
        "state write per batch, flushes; the stage probes excluded), and **staged** = items / the stages' "
        "whole time, their four probes (200 queries each) included. Each writer encodes the next "
        "batch of its slices on a worker thread while it writes one (components.rollout.workers), so "
        "encoding overlaps the writes but never a stage's probe. For reference: the same bare encoder "
        f"on the main thread {cd['main_thread']:.0f} items/s; raw forward on preprocessed tensors (main "
        f"thread) {cd['raw']:.0f} items/s.",
        "",
        "| round | bare encoder items/s | backfill items/s: writing / staged | backfill / bare: writing / "
        "staged | probes s | rollout wall s | CPU s: bare encoder / rollout client / Milvus server "
        "| final gallery |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pinned, single = cd["pinned"], cd["single"]
    names = [f"{i + 1}" for i in range(len(rounds))]
    names += [f"index on its own core {i + 1}" for i in range(len(pinned))]
    names += [f"index on its own core, one backfill stage {i + 1}" for i in range(len(single))]
    names += ["under the query load of D", f"under the query load of D, SLO throttle {SLO_FACTOR}x"]
    for name, r in zip(names, [*rounds, *pinned, *single, loaded, cd["throttled"]], strict=True):
        lines.append(
            f"| {name} | {r['bare']:.0f} | {r['items_per_s']:.0f} / {r['staged_items_per_s']:.0f} | "
            f"{r['ratio']:.0%} / {r['staged_ratio']:.0%} | {r['probe_s']:.1f} | {r['wall']:.1f} | "
            f"{r['bare_cpu']:.2f} / {r['client_cpu']:.2f} / {r['server_cpu']:.2f} | "
            f"{r['count']} items, {r['by_version']}, {r['status']} |"
        )
    cpu_ratio = float(np.median([r["bare_cpu"] / r["client_cpu"] for r in rounds]))
    lines += [
        "",
        "Median backfill / bare encoder over the unloaded rounds (wall clock): writing "
        f"**{median_ratio:.0%}**, staged **{float(np.median([r['staged_ratio'] for r in rounds])):.0%}** "
        "(target >= 80%). CPU view: "
        "the rollout process (encoding, restore capture, upserts, state writes, plan and probes) costs "
        f"{1 / cpu_ratio:.2f}x the bare encoder's CPU; here the milvus-lite server shares the same 2 cores "
        "(its CPU is in the table).",
        "",
    ]
    if pinned:
        lines += [
            "Index on its own core (the production topology, where Milvus runs on its own nodes): the "
            "milvus-lite server pinned to one core, the rollout process and its encoder (one torch thread) "
            "to the other, the bare encoder measured under the same pinning: median backfill / bare "
            f"writing **{float(np.median([r['ratio'] for r in pinned])):.0%}**, staged "
            f"**{float(np.median([r['staged_ratio'] for r in pinned])):.0%}**. With one backfill stage (no "
            "stage ends before the last, so no batch is encoded ahead of its stage and the writing figure "
            "holds all the encoding): writing "
            f"**{float(np.median([r['ratio'] for r in single])):.0%}**.",
            "",
        ]
    idle, during = loaded["idle"], loaded["during"]
    lines += [
        "## D. Query latency under a bounded concurrent load (loopback)",
        "",
        "2 client processes x 20 queries/s each (k=10, one query per call, open loop), searching the "
        "serving alias of the gallery of C.",
        "",
        "| window | queries | p50 ms | p99 ms | max ms | failed |",
        "|---|---|---|---|---|---|",
        f"| idle (no backfill) | {idle['queries']} | {_fmt(idle['p50'])} | {_fmt(idle['p99'])} | "
        f"{_fmt(idle['max'])} | {idle['failed']} |",
        f"| during the backfill | {during['queries']} | {_fmt(during['p50'])} | {_fmt(during['p99'])} | "
        f"{_fmt(during['max'])} | {during['failed']} |",
    ]
    t = cd["throttled"]
    lines += [
        f"| idle, before the throttled backfill | {t['idle']['queries']} | {_fmt(t['idle']['p50'])} | "
        f"{_fmt(t['idle']['p99'])} | {_fmt(t['idle']['max'])} | {t['idle']['failed']} |",
        f"| during the backfill with the SLO throttle {SLO_FACTOR}x | {t['during']['queries']} | "
        f"{_fmt(t['during']['p50'])} | {_fmt(t['during']['p99'])} | {_fmt(t['during']['max'])} | "
        f"{t['during']['failed']} |",
        "",
        f"Throttled: backfill at {t['ratio']:.0%} of the bare encoder, query p99 "
        f"{t['during']['p99'] / t['idle']['p99']:.1f}x idle (goal: <= {SLO_FACTOR}x at >= 50 %); the pace "
        f"timed its own searches (idle p99 {_fmt(t['pace'].get('idle_p99_ms'))} ms, last "
        f"{_fmt(t['pace'].get('last_p99_ms'))} ms), slowed down {t['pace'].get('slowdowns', 0)} times and "
        f"slept {t['pace'].get('slept_s', 0.0):.1f} s. Unthrottled: {loaded['ratio']:.0%}, p99 "
        f"{during['p99'] / idle['p99']:.1f}x idle. What writes cost queries at each rate: "
        "`write_latency.md`.",
        "",
    ]
    return "\n".join(lines) + "\n"


def _service_part(command: str, n_items: int = 6000) -> str:
    """Part E (:mod:`benchmarks.service_load`) on a milvus-lite server and on Milvus standalone, one after
    the other in the same run; its Markdown section."""
    from benchmarks import service_load
    from components.adapters import milvus_server

    results: dict[str, dict[str, Any]] = {}
    sections = []
    for backend in ("milvus-lite server", "Milvus standalone"):
        print(f"part E on {backend}: queries through the search service during rollouts", flush=True)
        work = Path(tempfile.mkdtemp(prefix="bench-service-milvus-"))
        if backend == "milvus-lite server":
            server: Any = MilvusServer(work)
            uri, pid = server.uri, server.proc.pid
        elif milvus_server.loopback_only():
            server = milvus_server.start(work / "standalone", graceful_stop_s=5)
            uri, pid = server.uri, server.process.pid
        else:
            sections.append(f"### E on {backend}\n\nNot run: {NOT_ISOLATED}\n")
            continue
        try:
            results[backend] = service_load.run(uri, _free_port(), n_items=n_items, server_pid=pid)
            sections.append(service_load.section(results[backend], command, backend))
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)
    return "\n".join(
        [
            service_load.HEADING,
            "",
            "The same operations and client on each backend, one after the other in one run (the index "
            "server unpinned, sharing the 2 cores with the service, the client and the rollout). "
            "'share of the unthrottled rollout' compares the paced rollout with the unpaced one on the same "
            "backend (the synthetic encoders cost next to nothing: the unpaced rollout is the index's "
            "limit).",
            "",
            service_load.comparison(results),
            *sections,
        ]
    )


def _service_only(out: Path, quick: bool) -> None:
    """Run part E alone and put its section in place of the one in ``out`` (appended when absent)."""
    from benchmarks.service_load import HEADING

    command = ".venv/bin/python benchmarks/backfill.py --service-only" + (" --quick" if quick else "")
    text = _service_part(command, 1500 if quick else 6000)
    old = out.read_text() if out.is_file() else ""
    kept = old.split(HEADING)[0].rstrip("\n")
    out.write_text((kept + "\n\n" if kept else "") + text)
    print(text)


NOT_ISOLATED = (
    "Milvus standalone listens on every interface and runs only in a loopback-only network namespace; "
    "run the benchmark as root (it makes one) or inside `unshare --net`."
)


def _private_network() -> None:
    """Run this benchmark in a loopback-only network namespace (root), where Milvus standalone may start."""
    from components.adapters import milvus_server

    if milvus_server.loopback_only() or os.geteuid() != 0:
        return
    try:
        milvus_server.enter_private_network()
    except milvus_server.MilvusServerError as err:
        log.warning("part E on Milvus standalone will be skipped: %s", err)


def main() -> None:
    _private_network()  # first, before any thread starts: a network namespace belongs to a thread
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run, about a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--service-only", action="store_true", help="run part E only and replace its section in --out"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.service_only:
        _service_only(args.out, args.quick)
        return
    sizes = (2000, 400, 1200, 300, 512, 3.0) if args.quick else (10000, 1000, 4000, 400, 12288, 8.0)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-backfill-"))
    server = MilvusServer(work)
    try:
        print("part A: curves", flush=True)
        a = part_a(sizes[0], sizes[1])
        print("part B: engine on Milvus", flush=True)
        b = part_b(server.uri, work / "b", sizes[2], sizes[3])
        print("parts C/D: throughput and latency", flush=True)
        cd = part_cd(server, work / "cd", sizes[4], 256, sizes[5])
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    command = ".venv/bin/python benchmarks/backfill.py" + (" --quick" if args.quick else "")
    text = render(a, b, cd, time.perf_counter() - t_start, command)
    text = text.rstrip("\n") + "\n\n" + _service_part(command, 1500 if args.quick else 6000)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
