"""Part E of the backfill benchmark: queries through the search service during complete rollouts.

``compatflow serve`` runs as its own process on 127.0.0.1, over a Milvus server on loopback (a
``milvus-lite server`` or Milvus standalone, one run each: :func:`run` takes the URI); a client process
sends ``POST /search`` (one text, k=10) at a fixed open-loop rate: request i is due at
t0 + i/rate whatever happened to the earlier ones, and its latency is counted from when it was due (a slow
answer delays no later request's clock, so queueing shows up in the figures). Meanwhile this process runs,
on the known-geometry upgrade (:mod:`benchmarks.synthetic_upgrade`), ``SETTLE_S`` apart: a staged rollout
(stage 0 query switch, backfill 10/25/50/100 %) without the SLO throttle, its rollback, the same rollout
with the throttle (``slo_p99_factor`` 1.5, paced on the service's own latency histogram), its rollback, a
blue-green rollout (a new space) and its rollback. Each answer is
attributed to the operation running when it was due; failed = any non-200 answer or transport error.

Run alone: ``.venv/bin/python benchmarks/backfill.py --service-only`` (replaces section E of the results).
"""

from __future__ import annotations

import http.client
import io
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## E. Queries through the search service during rollouts"
JSON_HEADERS = {"Content-Type": "application/json"}
SETTLE_S = 5.0
STALE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


def _write_captions(path: Path, item_ids: list[str]) -> str:
    """A gallery shard of captions (``<key>.txt``) for the service to show with each hit."""
    with tarfile.open(path, "w") as tar:
        for item_id in item_ids:
            blob = f"a synthetic item, {item_id}".encode()
            info = tarfile.TarInfo(f"{item_id}.txt")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return str(path)


def _client(port: int, texts: list[str], rate: float, stop: Any, out: Any) -> None:
    """Open-loop client: request i is due at t0 + i/rate; a pool of connections sends it when due."""
    local = threading.local()
    records: list[tuple[float, float, bool, str]] = []  # due (wall), latency from due (s), ok, version
    log_stale: list[str] = []  # requests sent again after a closed idle connection
    lock = threading.Lock()

    def send(conn: http.client.HTTPConnection, text: str) -> tuple[bool, str]:
        conn.request("POST", "/search", body=json.dumps({"queries": [text], "k": 10}), headers=JSON_HEADERS)
        response = conn.getresponse()
        body = response.read()
        ok = response.status == 200
        return ok, json.loads(body).get("model_version", "") if ok else str(response.status)

    def fire(i: int, due_wall: float, due_mono: float) -> None:
        conn = getattr(local, "conn", None)
        reused = conn is not None
        if conn is None:
            conn = local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            try:
                ok, version = send(conn, texts[i % len(texts)])
            except STALE as exc:
                if not reused:
                    raise
                # the server closed this idle keep-alive connection (uvicorn: after 5 s) before reading
                # the request: as HTTP clients do, send it again once on a new connection
                log_stale.append(type(exc).__name__)
                conn.close()
                conn = local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                ok, version = send(conn, texts[i % len(texts)])
        except Exception as exc:  # noqa: BLE001 - a failed query is what is being counted
            ok, version = False, type(exc).__name__
            conn.close()
            local.conn = None
        with lock:
            records.append((due_wall, time.monotonic() - due_mono, ok, version))

    with ThreadPoolExecutor(max_workers=16) as pool:
        t0_mono, t0_wall, i = time.monotonic() + 0.2, time.time() + 0.2, 0
        while not stop.is_set():
            due = t0_mono + i / rate
            time.sleep(max(0.0, due - time.monotonic()))
            pool.submit(fire, i, t0_wall + i / rate, due)
            i += 1
    out.put((records, len(log_stale)))


class Service:
    """``compatflow serve`` for a workspace on a free loopback port."""

    def __init__(self, ws: Path, uri: str, port: int, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "pipelines.cli", "serve", "--workspace", str(ws), "--port", str(port)]
        argv += ["--uri", uri, "--log-level", "warning"]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = port
        deadline = time.monotonic() + 90
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"compatflow serve did not become ready; see {log}")
            time.sleep(0.3)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self.log.close()
        return code


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    uri: str,
    port: int,
    n_items: int = 6000,
    n_queries: int = 600,
    rate: float = 40.0,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Part E on the Milvus server at ``uri`` (process ``server_pid``, for its CPU time); returns
    per-operation query figures, rollout facts and the CPU seconds of server, service and rollout."""
    from benchmarks.synthetic_upgrade import QUERY_FACTORY, synthetic_encoders, synthetic_upgrade
    from components import rollout as ro
    from components.adapters.index import GalleryIndex
    from components.deployment import RolloutSection

    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    opts = {"n_items": str(n_items), "n_queries": str(n_queries), "seed": "2"}
    u = synthetic_upgrade(n_items=n_items, n_queries=n_queries, seed=2)
    probe = ro.ProbeSet(u.query_texts, [[u.item_ids[p[0]]] for p in u.positives])
    ws = work / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    shard = _write_captions(work / "gallery-000000.tar", u.item_ids)
    index = GalleryIndex(uri, alias="bench_service")
    u.index_old_gallery(index, paths, opts, space="syn", source_uris=[f"{shard}#{i}" for i in u.item_ids])
    service = Service(ws, uri, port, work / "serve.log")
    warm = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for text in u.query_texts[:5]:  # the query model, the collection and the captions' shard, loaded once
        warm.request("POST", "/search", json.dumps({"queries": [text], "k": 10}), JSON_HEADERS)
        warm.getresponse().read()
    warm.close()
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    client = ctx.Process(target=_client, args=(port, u.query_texts, rate, stop, out))
    client.start()
    time.sleep(3.0)  # the client imports and connects
    phases: list[tuple[str, float, float, dict[str, Any]]] = []

    def cpu() -> dict[str, float]:
        return {
            "server": cpu_seconds(server_pid) if server_pid else float("nan"),
            "service": cpu_seconds(service.proc.pid),
            "rollout": time.process_time(),  # this process: the rollout engine and its encoders
        }

    def phase(name: str, action: Any) -> None:
        t0, c0 = time.time(), cpu()
        facts = action() or {}
        t1, c1 = time.time(), cpu()
        facts["cpu"] = {k: c1[k] - c0[k] for k in c0}
        phases.append((name, t0, t1, facts))
        time.sleep(SETTLE_S)  # Milvus builds the index of what was written: the next operation starts idle

    def rollout(version: str, options: dict[str, str], **kw: Any) -> dict[str, Any]:
        config = ro.RolloutConfig.from_section(
            RolloutSection(),
            new_version=version,
            order="random",
            batch_size=256,
            query_model={"factory": QUERY_FACTORY, "options": options, "side": "new"},
            **kw,
        )
        marks: list[tuple[str, float]] = []  # (stage label, wall time it began), from the state file
        done = threading.Event()

        def watch() -> None:
            last = None
            while not done.wait(0.01):
                try:
                    doc = json.loads(paths.state.read_text())
                except (OSError, ValueError):
                    continue
                if doc.get("new_version") != version or doc.get("status") != "running":
                    continue
                label = f"stage {doc['stage']}" if doc["mode"] != "blue_green" else "fill"
                if label != last:
                    marks.append((label, time.time()))
                    last = label

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        try:
            state = ro.run_rollout(
                index, paths, config, synthetic_encoders({"options": options}), probe
            ).document()
        finally:
            done.set()
            watcher.join()
        seconds = time.perf_counter() - t0
        ends = [t for _, t in marks[1:]] + [time.time()]
        return {
            "status": state["status"],
            "mode": state["mode"],
            "seconds": seconds,
            "items_per_s": n_items / seconds,
            "pace": state.get("pace"),
            "stages": [(label, t, end) for (label, t), end in zip(marks, ends, strict=True)],
        }

    def rolled_back() -> dict[str, Any]:
        t0 = time.perf_counter()
        state = ro.rollback(paths, index).document()
        return {
            "status": state["status"],
            "rollback_s": time.perf_counter() - t0,
            "pace": state["rollback"].get("pace"),
        }

    try:
        phase("idle", lambda: time.sleep(10.0))
        phase("staged rollout, no throttle", lambda: rollout("v2", opts))
        phase("rollback (rows restored)", lambda: rolled_back())
        phase("staged rollout, SLO throttle 1.5x", lambda: rollout("v3", opts, slo_p99_factor=1.5))
        phase("rollback of the throttled one", lambda: rolled_back())
        phase("blue-green rollout (new space)", lambda: rollout("v4", {**opts, "new_dim": "48"}))
        phase("rollback (alias back)", lambda: rolled_back())
        phase("idle after", lambda: time.sleep(5.0))
    finally:
        stop.set()
        records, resent = out.get(timeout=120)
        client.join(timeout=30)
        exit_code = service.stop()
        index.close()
        shutil.rmtree(work, ignore_errors=True)

    def figures(name: str, t0: float, t1: float) -> dict[str, Any]:
        mine = [r for r in records if t0 <= r[0] < t1]
        lat = np.array([r[1] for r in mine if r[2]]) * 1000.0
        versions: dict[str, int] = {}
        for r in mine:
            versions[r[3]] = versions.get(r[3], 0) + 1
        return {
            "phase": name,
            "seconds": t1 - t0,
            "queries": len(mine),
            "failed": sum(not r[2] for r in mine),
            "p50": float(np.percentile(lat, 50)) if lat.size else None,
            "p99": float(np.percentile(lat, 99)) if lat.size else None,
            "max": float(lat.max()) if lat.size else None,
            "versions": versions,
        }

    rows = []
    for name, t0, t1, facts in phases:
        rows.append({**figures(name, t0, t1), **{k: v for k, v in facts.items() if k != "stages"}})
        rows += [figures(f"... {label}", a, b) for label, a, b in facts.get("stages", ())]
    errors: dict[str, int] = {}
    for r in records:
        if not r[2]:
            errors[r[3]] = errors.get(r[3], 0) + 1
    return {
        "rows": rows,
        "errors": errors,
        "load": (load_before, os.getloadavg()[0]),
        "rate": rate,
        "n_items": n_items,
        "total": len(records),
        "failed": sum(not r[2] for r in records),
        "resent": resent,
        "exit_code": exit_code,
        "uri": uri,
    }


def section(e: dict[str, Any], command: str, backend: str = "milvus-lite server") -> str:
    """The Markdown subsection of part E on one backend."""

    def f(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    idle = next((r for r in e["rows"] if r["phase"] == "idle"), None)
    top = [r for r in e["rows"] if not r["phase"].startswith("...")]
    lines = [
        f"### E on {backend}",
        "",
        f"`compatflow serve` (uvicorn, 127.0.0.1) over {backend} on loopback, gallery of "
        f"{e['n_items']} items (synthetic upgrade, captions from a gallery shard); one client process sends "
        f"`POST /search` (1 text, k=10) at a fixed open-loop rate of {e['rate']:.0f}/s, latency counted from "
        "when each request was due. Operations run one after another in the benchmark process; the '...' "
        "rows split a rollout by the stage its state file showed (stage 0: the probe and the query switch; "
        "stages 1-4: backfill to 10/25/50/100 % with each stage's probe). "
        f"Command: `{command}`.",
        "",
        "| operation | s | queries | failed | p50 ms | p99 ms | max ms | p99/idle | answered by "
        "| CPU s: index server / service / rollout | rollout |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in e["rows"]:
        ratio = r["p99"] / idle["p99"] if idle and idle["p99"] and r["p99"] else None
        by = ", ".join(f"{v}: {n}" for v, n in sorted(r["versions"].items()))
        facts = ""
        if "items_per_s" in r:
            facts = f"{r['status']}, {r['mode']}, {r['items_per_s']:.0f} items/s (whole rollout)"
        elif "state" in r:
            facts = r["status"]
        pace = r.get("pace") or {}
        if pace.get("p99_factor"):
            facts += (
                f"; paced on {pace['latency_from']}: idle p99 {f(pace['idle_p99_ms'])} ms, last p99 "
                f"{f(pace['last_p99_ms'])} ms, {pace['slowdowns']} slowdowns, slept {pace['slept_s']:.1f} s"
            )
        cpu = r.get("cpu")
        cpu_text = f"{cpu['server']:.1f} / {cpu['service']:.1f} / {cpu['rollout']:.1f}" if cpu else ""
        lines.append(
            f"| {r['phase']} | {r['seconds']:.1f} | {r['queries']} | {r['failed']} | {f(r['p50'])} | "
            f"{f(r['p99'])} | {f(r['max'])} | {f(ratio, 2)} | {by} | {cpu_text} | {facts} |"
        )
    lines += [
        "",
        f"Failed queries over the whole run: **{e['failed']} of {e['total']}**"
        + (f" ({', '.join(f'{k}: {n}' for k, n in sorted(e['errors'].items()))})" if e["errors"] else "")
        + f"; the service exited with {e['exit_code']} on SIGTERM; {e['resent']} requests were sent again on "
        "a new connection after the server had closed an idle keep-alive one before reading them (as HTTP "
        "clients do; their latency counts from when they were first due). 'answered by' counts the query "
        "model version each answer reports (attributed to the operation running when the request was due): "
        "the pair swaps at stage 0, at the blue-green alias move and at each rollback. Machine load average "
        f"(1 min) {e['load'][0]:.1f} at the start and {e['load'][1]:.1f} at the end, on 2 cores shared with "
        "other work: latencies are those of a busy machine.",
    ]
    worst = max((r for r in top if r["p99"] is not None), key=lambda r: r["p99"], default=None)
    if worst is not None and idle and idle["p99"]:
        lines.append(
            f"Highest p99: {worst['phase']} ({worst['p99']:.0f} ms, {worst['p99'] / idle['p99']:.1f}x idle)."
        )
    lines.append("")
    return "\n".join(lines)


def comparison(by_backend: dict[str, dict[str, Any]]) -> str:
    """Part E's goals side by side, one column per backend."""

    def row_of(e: dict[str, Any], name: str) -> dict[str, Any] | None:
        return next((r for r in e["rows"] if r["phase"] == name), None)

    def stages_of(e: dict[str, Any], name: str) -> list[dict[str, Any]]:
        rows = e["rows"]
        start = next(i for i, r in enumerate(rows) if r["phase"] == name)
        out = []
        for r in rows[start + 1 :]:
            if not r["phase"].startswith("..."):
                break
            out.append(r)
        return out

    def worst_ratio(e: dict[str, Any], rows: list[dict[str, Any]]) -> str:
        idle = row_of(e, "idle")["p99"]
        ratios = [r["p99"] / idle for r in rows if r and r["p99"] and r["queries"] >= 20]
        return f"{max(ratios):.2f}x" if ratios else "n/a"

    names = list(by_backend)
    lines = [
        "| goal | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    cells: dict[str, list[str]] = {}
    for e in by_backend.values():
        idle = row_of(e, "idle")
        free = row_of(e, "staged rollout, no throttle")
        paced = row_of(e, "staged rollout, SLO throttle 1.5x")
        replay = row_of(e, "rollback of the throttled one")
        paced_stages = stages_of(e, "staged rollout, SLO throttle 1.5x")
        backfill = [r for r in paced_stages if r["phase"] != "... stage 0"]
        share = paced["items_per_s"] / free["items_per_s"] if paced and free else None
        cells.setdefault("failed queries, whole run (goal 0)", []).append(f"{e['failed']} of {e['total']}")
        cells.setdefault("idle p50 / p99 ms", []).append(f"{idle['p50']:.1f} / {idle['p99']:.1f}")
        cells.setdefault("unthrottled rollout: items/s; worst backfill-stage p99/idle", []).append(
            f"{free['items_per_s']:.0f}; {worst_ratio(e, stages_of(e, 'staged rollout, no throttle')[1:])}"
        )
        cells.setdefault("paced backfill: worst stage p99/idle (goal <= 1.5x)", []).append(
            worst_ratio(e, backfill)
        )
        cells.setdefault("paced rollout: items/s, share of the unthrottled rollout", []).append(
            f"{paced['items_per_s']:.0f}, {share:.0%}" if share is not None else "n/a"
        )
        cells.setdefault("paced rollback replay p99/idle (goal <= 3x)", []).append(worst_ratio(e, [replay]))
    for goal, values in cells.items():
        lines.append(f"| {goal} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"
