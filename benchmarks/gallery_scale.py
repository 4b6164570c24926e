"""How a rollout's cost grows with the gallery: 10k to 1M items, Milvus standalone and milvus-lite, K workers.

For each backend and size a gallery of N synthetic vectors is indexed (version v1) with the real index
adapter; then, for each worker count K, a staged rollout (fractions 0.1 / 0.25 / 0.5 / 1.0, the configured
order) re-embeds it with a cheap stand-in encoder and is rolled back, through the real engine. The stand-in
derives each vector from a hash of the item id (old and new models are two close linear maps of its bits, so
the new queries read the old gallery) and sleeps ``--encode-us`` per item, standing in for a GPU's time.

Each rollout, rollback and ``status`` runs in a process of its own, so its peak RSS (VmHWM) is its own; the
workers' peaks come from the stage records, the Milvus server's from /proc. Plan and stage seconds come
from the rollout state; disk is what the rollout's work folder holds (its centres, the workers' cursors).
After the completed rollout is rolled back, a second rollout is SIGKILLed in its second backfill stage and
rolled back too. Milvus CPU per row is the server's CPU time over the rollout and its rollback, per item.
With ``--lineage`` the workspace has a Feast repo, the rollout's writers record each item's lineage, and
``compatflow lineage --check`` (over K processes) runs after the rollout: ``lineage_seconds``, and whether
it agrees.
Growth exponents are least-squares slopes of log(cost) over log(size).

    .venv/bin/python benchmarks/gallery_scale.py --sizes 10000,40000 --workers 1 --json /tmp/scale.json

``--backends standalone,lite`` (milvus-lite: K = 1 only, one process opens its directory); Milvus
standalone needs root (a private loopback-only network namespace, :mod:`components.adapters.milvus_server`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compat.proc import cpu_seconds, peak_rss_mib, reset_peak

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODULE = "benchmarks.gallery_scale"  # listed in $COMPATFLOW_TRUSTED_MODULES for the workers' recipe
FRACTIONS = (0.1, 0.25, 0.5, 1.0)
RESULTS = ROOT / "benchmarks" / "results" / "gallery_scale.md"


# ------------------------------------------------------------------------------------ stand-in encoder
def _maps(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(64, dim)).astype(np.float32)
    return old, old + 0.3 * rng.normal(size=(64, dim)).astype(np.float32)


def stand_in_vectors(ids: Sequence[str], model: str, dim: int = 64, seed: int = 0) -> np.ndarray:
    """Unit vectors of ``ids`` under the ``old`` or ``new`` stand-in model: a linear map of the 64 bits of a
    hash of the id (vectorised; no state)."""
    from components.rollout.keys import order_keys

    keys = order_keys([f"{seed}:{i}" for i in ids]).astype(np.uint64)
    bits = (keys[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)  # 63 bits and a constant one
    signs = bits.astype(np.float32) * 2 - 1
    v = signs @ _maps(dim, seed)[0 if model == "old" else 1]
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def stand_in_encoders(config: Mapping[str, Any]) -> Any:
    """Rollout encoders of the stand-in models (options ``dim``, ``seed``, ``encode_us`` per item)."""
    from components.rollout.types import RolloutEncoders

    opts = dict(config.get("options") or {})
    dim, seed, pause = (
        int(opts.get("dim", 64)),
        int(opts.get("seed", 0)),
        float(opts.get("encode_us", 0)) / 1e6,
    )

    def gallery(refs: Sequence[Any]) -> np.ndarray:
        if pause:
            time.sleep(pause * len(refs))
        return stand_in_vectors([r.item_id for r in refs], "new", dim, seed)

    return RolloutEncoders(
        old_query=lambda texts: stand_in_vectors(texts, "old", dim, seed),
        new_query=lambda texts: stand_in_vectors(texts, "new", dim, seed),
        new_gallery=gallery,
    )


# ---------------------------------------------------------------------------------------- measuring
def _disk_mib(path: Path) -> float:
    return (
        round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1)
        if path.exists()
        else 0.0
    )


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One measured operation in this process: ``rollout``, ``rollback``, ``status`` or ``lineage``."""
    from components import rollout as ro
    from components.adapters.index import GalleryIndex, gallery_status
    from components.deployment import RolloutSection

    paths = ro.RolloutPaths.for_workspace(args.workspace)
    t0 = time.perf_counter()
    if args.child == "status":
        doc = gallery_status(args.uri, args.alias)
        return {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(), **doc}
    if args.child == "lineage":  # `compatflow lineage --check`: the gallery against Feast, over K processes
        from components.adapters.lineage import check_from_index

        doc = check_from_index(args.workspace / "feast", args.uri, args.alias, workers=args.k)
        return {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(), **doc}
    with GalleryIndex(args.uri, args.alias) as index:
        if args.child == "rollback":
            state = ro.rollback(paths, index).document()
        else:
            options = {"dim": str(args.dim), "encode_us": str(args.encode_us)}
            encoders = stand_in_encoders({"options": options})
            encoders.recipe = {"factory": f"{MODULE}:stand_in_encoders", "args": {"options": options}}
            config = ro.RolloutConfig.from_section(
                RolloutSection(),
                new_version=args.version,
                query_model={"factory": "", "options": options, "side": "new"},
                order=args.order,
                fractions=FRACTIONS,
                batch_size=args.batch_size,
                workers=args.k,
            )
            state = ro.run_rollout(
                index, paths, config, encoders, ro.ProbeSet.from_file(paths.probe)
            ).document()
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time(),
        "peak_rss_mib": peak_rss_mib(),
        "status": state["status"],
        "plan_seconds": state.get("plan_seconds"),
        "stages": [
            {
                "stage": s["stage"],
                "items": s["target_position"],
                "seconds": s.get("seconds"),
                "items_per_s": s.get("items_per_s"),
                "workers_peak_rss_mib": max(
                    (w.get("peak_rss_mib") or 0 for w in s.get("workers", [])), default=None
                ),
                "workers_cpu_seconds": sum(w.get("cpu_seconds") or 0 for w in s.get("workers", [])),
            }
            for s in state["stages"]
        ],
        "versions": state["gallery"].get("versions_after"),
        "rollback_pace": (state.get("rollback") or {}).get("pace"),
    }


def _child_command(args: argparse.Namespace, what: str) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        what,
        "--uri",
        args.uri,
        "--alias",
        args.alias,
        "--workspace",
        str(args.workspace),
        "--dim",
        str(args.dim),
        "--encode-us",
        str(args.encode_us),
        "--order",
        args.order,
        "--batch-size",
        str(args.batch_size),
    ]


def _run_child(args: argparse.Namespace, what: str, **extra: Any) -> dict[str, Any]:
    cmd = [
        *_child_command(args, what),
        *[str(x) for kv in extra.items() for x in (f"--{kv[0].replace('_', '-')}", kv[1])],
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    doc["wall_seconds"] = time.perf_counter() - t0
    return doc


# ------------------------------------------------------------------------------------------ gallery
def build_gallery(uri: str, alias: str, workspace: Path, size: int, dim: int, chunk: int = 20_000) -> float:
    """Index ``size`` stand-in v1 vectors behind ``alias`` with a serving record and a 200-query probe set;
    returns the seconds it took."""
    from components.adapters.index import GalleryIndex, make_rows
    from components.rollout.types import RolloutPaths
    from components.serving.record import write_serving

    paths = RolloutPaths.for_workspace(workspace)
    t0 = time.perf_counter()
    with GalleryIndex(uri, alias) as index:
        collection = index.create_collection("scale", dim)
        for start in range(0, size, chunk):
            ids = [f"item-{i:010d}" for i in range(start, min(size, start + chunk))]
            rows = make_rows(ids, stand_in_vectors(ids, "old", dim), "v1", "scale", dim=dim)
            for s in range(0, len(rows), 5000):  # a fresh collection: plain inserts (an upsert deletes first)
                index.client.insert(collection, rows[s : s + 5000])
        index.client.flush(collection)
        index.wait_indexed(collection, timeout_s=4 * 3600)  # served whole: HNSW over every row first
        index.switch_alias(collection)
        write_serving(
            paths.serving,
            uri=uri,
            alias=alias,
            collection=collection,
            space="scale",
            dim=dim,
            query_model={"version": "v1", "factory": "", "options": {}},
        )
    probe = [f"item-{i:010d}" for i in np.linspace(0, size - 1, 200).astype(int)]
    paths.probe.parent.mkdir(parents=True, exist_ok=True)
    paths.probe.write_text(json.dumps({"texts": probe, "positives": [[p] for p in probe]}))
    return time.perf_counter() - t0


def settle(pid: int, window_s: float = 5.0, limit_s: float = 3600.0) -> float:
    """Wait until the server is idle (under 0.15 cores over two windows of ``window_s``: its index builds and
    compactions done); returns that idle rate in cores, to subtract from a measured window."""
    deadline, rates = time.monotonic() + limit_s, [math.inf]
    while time.monotonic() < deadline:
        c0 = cpu_seconds(pid)
        time.sleep(window_s)
        rates.append((cpu_seconds(pid) - c0) / window_s)
        if max(rates[-2:]) <= 0.15:
            return min(rates[-2:])
    raise RuntimeError(f"Milvus (pid {pid}) still busy after {limit_s:.0f} s: {rates[-1]:.2f} cores")


def measure_size(
    args: argparse.Namespace, backend: str, size: int, server_pid: int | None
) -> list[dict[str, Any]]:
    """Build a gallery of ``size``, then a rollout and its rollback for each worker count; one record each."""
    records = []
    args.alias = f"scale{size}"
    args.workspace = Path(args.tmp) / f"{backend}-{size}"
    if args.workspace.exists():
        shutil.rmtree(args.workspace)
    if backend == "lite":
        args.uri = str(args.workspace / "milvus" / "gallery.db")
    build_s = build_gallery(args.uri, args.alias, args.workspace, size, args.dim)
    if args.lineage:  # the rollout's writers record their items in the workspace's Feast repo
        from components.adapters.lineage import LineageStore

        LineageStore(args.workspace / "feast").apply()
    status = _run_child(args, "status")
    for k in args.workers_list:
        if backend == "lite" and k > 1:
            continue
        server_cpu = None
        if server_pid:  # the gallery's own index builds and compactions are the build's, not the rollout's
            idle_rate = settle(server_pid)
            reset_peak(server_pid)
            server_cpu0, t0 = cpu_seconds(server_pid), time.monotonic()
        rollout = _run_child(args, "rollout", version=f"v2k{k}", k=k)
        if server_pid:  # ... while the new collection's compactions are the rollout's
            settle(server_pid)
            server_cpu = cpu_seconds(server_pid) - server_cpu0 - idle_rate * (time.monotonic() - t0)
        rollout_dir = args.workspace / "rollout"
        disk = _disk_mib(rollout_dir)
        check = _run_child(args, "lineage", k=k) if args.lineage else {}
        rollback = _run_child(args, "rollback")
        after = _run_child(args, "status")
        server_peak = peak_rss_mib(server_pid) if server_pid else None
        unfinished = _killed_rollout(args, version=f"v3k{k}", k=k)
        rollback_unfinished = _run_child(args, "rollback")
        records.append(
            {
                "backend": backend,
                "size": size,
                "workers": k,
                "build_seconds": round(build_s, 1),
                "status_seconds": round(status["seconds"], 2),
                "plan_seconds": rollout["plan_seconds"],
                "rollout_seconds": round(rollout["seconds"], 1),
                "items_per_s": round(size / rollout["seconds"], 1),
                "stage_seconds": [s["seconds"] for s in rollout["stages"] if s["stage"] > 0],
                "peak_rss_mb": rollout["peak_rss_mib"],
                "rollout_cpu_seconds": round(rollout.get("cpu_seconds") or 0, 1),
                "workers_cpu_seconds": round(
                    sum(s.get("workers_cpu_seconds") or 0 for s in rollout["stages"]), 1
                )
                or None,  # K = 1: no worker process
                "server_cpu_seconds": round(server_cpu, 1) if server_cpu is not None else None,
                "milvus_idle_cores": round(idle_rate, 3) if server_pid else None,
                "milvus_cpu_ms_per_row": round(1000 * server_cpu / size, 3)
                if server_cpu is not None
                else None,
                "workers_peak_rss_mb": max(
                    (s["workers_peak_rss_mib"] or 0 for s in rollout["stages"]), default=0
                )
                or None,
                "lineage": bool(args.lineage),
                "lineage_seconds": round(check["seconds"], 2) if check else None,
                "lineage_agree": check.get("agree"),
                "rollback_seconds": round(rollback["seconds"], 2),
                "killed_at_stage": unfinished,
                "rollback_unfinished_seconds": round(rollback_unfinished["seconds"], 2),
                "rollback_peak_rss_mb": rollback["peak_rss_mib"],
                "status_peak_rss_mb": status["peak_rss_mib"],
                "server_peak_rss_mb": server_peak,
                "rollout_disk_mb": disk,
                "versions_after_rollout": rollout["versions"],
                "count_after_rollback": after["count"],
                "versions_after_rollback": after["by_version"],
                "versions_after_unfinished_rollback": _run_child(args, "status")["by_version"],
            }
        )
        print(json.dumps(records[-1]), flush=True)
        for work in rollout_dir.iterdir():  # this rollout's files (the probe set stays)
            if work.is_dir():
                shutil.rmtree(work)
    return records


def _killed_rollout(args: argparse.Namespace, version: str, k: int) -> int:
    """A rollout of ``version`` SIGKILLed once its first backfill stage has written; returns that stage."""

    state = args.workspace / "rollout_state.json"
    cmd = [*_child_command(args, "rollout"), "--version", version, "--k", str(k)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            doc = json.loads(state.read_text()) if state.is_file() else {}
            if doc.get("new_version") == version and doc.get("stage", 0) >= 2:
                return int(doc["stage"])
            time.sleep(0.05)
        doc = json.loads(state.read_text()) if state.is_file() else {}
        raise RuntimeError(
            f"the rollout of {version} ended ({proc.returncode}, {doc.get('status')}: "
            f"{doc.get('halt_reason')}) before it could be killed"
        )
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def milvus_standalone(data_dir: Path) -> Iterator[Any]:
    """A Milvus standalone server on loopback (a private network namespace where the machine has other
    interfaces), its binaries cached under ``~/.cache/compatflow``; stopped on exit."""
    from components.adapters import milvus_server

    if not milvus_server.loopback_only():
        milvus_server.enter_private_network()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    bins = cache / "compatflow" / f"milvus-{milvus_server.server_version()}"
    with milvus_server.start(data_dir, bin_dir=bins, graceful_stop_s=3) as server:
        yield server


def exponent(sizes: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of log(value) over log(size) (None with fewer than two positive points)."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, values, strict=True) if s > 0 and v and v > 0]
    if len(pts) < 2:
        return None
    x, y = np.asarray(pts).T
    return float(np.polyfit(x, y, 1)[0])


def table(records: Sequence[Mapping[str, Any]]) -> str:
    cols = [
        ("backend", "backend"),
        ("size", "items"),
        ("workers", "K"),
        ("lineage", "lineage"),
        ("build_seconds", "index build s"),
        ("status_seconds", "status s"),
        ("plan_seconds", "plan s"),
        ("stage_seconds", "stage s (10/25/50/100 %)"),
        ("rollout_seconds", "rollout s"),
        ("items_per_s", "items/s"),
        ("rollout_cpu_seconds", "rollout CPU s"),
        ("workers_cpu_seconds", "workers CPU s"),
        ("server_cpu_seconds", "Milvus CPU s"),
        ("milvus_cpu_ms_per_row", "Milvus CPU ms/row"),
        ("peak_rss_mb", "rollout peak MB"),
        ("workers_peak_rss_mb", "worker peak MB"),
        ("lineage_seconds", "lineage --check s"),
        ("lineage_agree", "lineage agrees"),
        ("rollback_seconds", "rollback s (completed)"),
        ("rollback_unfinished_seconds", "rollback s (killed mid-stage)"),
        ("rollback_peak_rss_mb", "rollback peak MB"),
        ("server_peak_rss_mb", "Milvus peak MB"),
        ("rollout_disk_mb", "rollout files MB"),
    ]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append(
                "/".join(f"{x:.1f}" for x in v)
                if isinstance(v, list)
                else ("yes" if v else "no")
                if isinstance(v, bool)
                else ("" if v is None else f"{v:,}" if isinstance(v, int) else str(v))
            )
        lines.append("| " + " | ".join(cells) + " |")
    growth = [
        "",
        "| backend | K | sizes | rollout s exponent | plan s exponent | rollback s exponent "
        "| rollout peak RSS exponent |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in sorted({r["backend"] for r in records}):
        for k in sorted({r["workers"] for r in records}):
            rs = [r for r in records if r["backend"] == backend and r["workers"] == k]
            if len(rs) < 2:
                continue
            sizes = [r["size"] for r in rs]
            ex = [
                exponent(sizes, [r[c] for r in rs])
                for c in ("rollout_seconds", "plan_seconds", "rollback_seconds", "peak_rss_mb")
            ]
            growth.append(
                f"| {backend} | {k} | {', '.join(f'{s:,}' for s in sizes)} | "
                + " | ".join("" if e is None else f"{e:.2f}" for e in ex)
                + " |"
            )
    return "\n".join(lines + growth) + "\n"


def report(records: Sequence[Mapping[str, Any]], text: str, args: argparse.Namespace) -> int:
    """Write the records to ``args.json`` and the table to ``args.table`` where given; print the table."""
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    if args.table:
        args.table.write_text(text)
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--workers", default="1,2", help="worker counts, e.g. 1,2")
    parser.add_argument("--backends", default="standalone", help="standalone and/or lite")
    parser.add_argument("--order", default="random")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--encode-us", type=float, default=100.0, help="stand-in encoder time per item")
    parser.add_argument(
        "--lineage", action="store_true", help="the rollout records lineage in Feast as it writes"
    )
    parser.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    # one measured operation, in a process of its own
    parser.add_argument(
        "--child", choices=["rollout", "rollback", "status", "lineage"], help=argparse.SUPPRESS
    )
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--alias", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--version", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    trusted = os.environ.get("COMPATFLOW_TRUSTED_MODULES", "")
    os.environ["COMPATFLOW_TRUSTED_MODULES"] = ",".join(filter(None, [trusted, MODULE]))
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    if args.child:
        print(json.dumps(_child(args), default=str))
        return 0
    args.workers_list = [int(k) for k in args.workers.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compatflow-scale-") as tmp:
        args.tmp = tmp
        if "lite" in backends:
            for size in sizes:
                records += measure_size(args, "lite", size, None)
        if "standalone" in backends:
            with milvus_standalone(Path(tmp) / "milvus") as server:
                args.uri = server.uri
                for size in sizes:
                    records += measure_size(args, "standalone", size, server.process.pid)
    return report(records, table(records), args)


if __name__ == "__main__":
    sys.exit(main())
