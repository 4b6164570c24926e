"""The search service (``compatflow serve``): a real uvicorn process on 127.0.0.1 over a real milvus-lite
server, following staged and blue-green rollouts and a rollback while queries keep arriving."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import typer

from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE
from benchmarks.synthetic_upgrade import synthetic_encoders, synthetic_upgrade
from compat.io import free_loopback_port
from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.deployment import RolloutSection

N, Q, SEED, K = 400, 200, 3, 5  # the geometry the rollout tests complete with
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}
SYNTH_QUERY = f"{SYNTH_MODULE}:synthetic_query_encoder"
UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)
PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])
ROOT = Path(__file__).resolve().parents[2]


def caption_of(item_id: str) -> str:
    return f"a photo of {item_id}"


def colour_of(item_id: str) -> tuple[int, int, int]:
    code = sum(item_id.encode()) * 37
    return (code % 200 + 20, code // 7 % 200 + 20, code // 49 % 200 + 20)


def _picture(item_id: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), colour_of(item_id)).save(buffer, "PNG")
    return buffer.getvalue()


def _write_shard(path: Path) -> str:
    """A gallery shard holding each item's caption (``<key>.txt``), metadata (``<key>.json``) and a small
    picture of one colour (``<key>.png``)."""
    with tarfile.open(path, "w") as tar:
        for item_id in UPGRADE.item_ids:
            members = (
                ("txt", caption_of(item_id)),
                ("json", json.dumps({"phase": 0})),
                ("png", _picture(item_id)),
            )
            for ext, data in members:
                blob = data if isinstance(data, bytes) else data.encode()
                info = tarfile.TarInfo(f"{item_id}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    return str(path)


class Client:
    """A keep-alive HTTP client of one service (one per thread)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        payload = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        self.conn.request(method, path, body=payload, headers=headers)
        response = self.conn.getresponse()
        return response.status, response.read()

    def json(self, method: str, path: str, body: object = None) -> tuple[int, dict]:
        status, data = self.request(method, path, body)
        return status, json.loads(data)

    def close(self) -> None:
        self.conn.close()


class Service:
    """``compatflow serve`` on a free loopback port; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, ws: Path, uri: str, tmp: Path, *, ready: bool = True) -> None:
        self.port = free_loopback_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [
            sys.executable,
            "-m",
            "pipelines.cli",
            "serve",
            "--workspace",
            str(ws),
            "--port",
            str(self.port),
        ]
        argv += ["--uri", uri, "--watch-interval", "0.1", "--log-level", "warning"]
        self.log_path = tmp / "serve.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}: {self.output()}")
            try:
                client = Client(self.port)
                status, _ = client.request("GET", "/readyz")
                client.close()
                if status == 200 or not ready:  # not ready: listening is enough
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"serve was not ready within 60 s: {self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


# The service's own behaviour (HTTP contract, bounds, digests, commands) is the same over either server: those
# tests run on milvus-lite's; the rollouts under load, where the index server's writes and alias switches
# meet live queries, run on both.
on_milvus_lite = pytest.mark.parametrize("milvus_server", ["milvus-lite"], indirect=True)


@pytest.fixture
def gallery(tmp_path, milvus_server):
    """A workspace whose v1 gallery lives on the milvus-lite server (its own alias), rows pointing to a
    real shard of captions; yields ``(paths, index, uri)``."""
    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    shard = _write_shard(tmp_path / "gallery-000000.tar")
    index = GalleryIndex(milvus_server, f"s{uuid.uuid4().hex[:10]}")
    UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"{shard}#{i}" for i in UPGRADE.item_ids])
    yield paths, index, milvus_server
    index.close()


@pytest.fixture
def service(gallery, tmp_path):
    paths, _, uri = gallery
    svc = Service(paths.serving.parent, uri, tmp_path)
    yield svc
    assert svc.stop() == 0, svc.output()  # SIGTERM: in-flight requests finish, then exit 0


def _config(options: dict[str, str], **kw) -> ro.RolloutConfig:
    kw.setdefault("batch_size", 32)
    kw.setdefault("order", "random")
    return ro.RolloutConfig.from_section(
        RolloutSection(),
        new_version="v2",
        query_model={"factory": SYNTH_QUERY, "options": options, "side": "new"},
        **kw,
    )


def _top_ids(index: GalleryIndex, text: str, side: str, collection: str, rot=None) -> list[str]:
    q = UPGRADE.query_vectors([text], side)
    if rot is not None:
        q = q @ rot
    return [h.item_id for h in index.search(q, k=K, collection=collection)[0]]


@on_milvus_lite
def test_contract_health_and_metrics(gallery, service) -> None:
    paths, index, _ = gallery
    client = Client(service.port)
    texts = UPGRADE.query_texts[:3]
    status, body = client.json("POST", "/search", {"queries": texts, "k": K})
    assert status == 200, body
    assert len(body["results"]) == 3 and body["model_version"] == "v1"
    for text, row in zip(texts, body["results"], strict=True):
        assert [h["id"] for h in row] == _top_ids(index, text, "old", index.serving_collection())
        assert all(set(h) >= {"id", "score", "caption"} for h in row)
        assert [h["caption"] for h in row] == [caption_of(h["id"]) for h in row]
        assert [h["score"] for h in row] == sorted((h["score"] for h in row), reverse=True)  # best first
    status, body = client.json("POST", "/search", {"queries": texts[:1], "k": 2, "phases": [7]})
    assert status == 200 and body["results"] == [[]]  # a filter no item matches

    for bad, field in (
        ({"queries": [], "k": 3}, "queries"),
        ({"queries": ["find item-00001", "   "], "k": 3}, "queries"),
        ({"queries": ["find item-00001"], "k": 0}, "k"),
        ({"k": 3}, "queries"),
        ({"queries": "find item-00001", "k": 3}, "queries"),
    ):
        status, body = client.json("POST", "/search", bad)
        assert status == 422 and isinstance(body["detail"], str), body
        assert body["detail"].startswith(field), body["detail"]
    status, body = client.json("POST", "/search", {"queries": ["  "], "k": 3})
    assert "empty" in body["detail"]

    assert client.json("GET", "/healthz") == (200, {"status": "ok"})
    status, ready = client.json("GET", "/readyz")
    assert status == 200 and ready["ready"] and ready["model_version"] == "v1"
    status, text = client.request("GET", "/metrics")
    metrics = text.decode()
    assert status == 200
    assert "compatflow_query_latency_seconds_bucket" in metrics
    assert "compatflow_query_latency_seconds_count 2.0" in metrics  # the two answered requests
    assert 'compatflow_serving_model_info{collection="' in metrics and 'version="v1"' in metrics
    assert "compatflow_query_errors_total" in metrics

    # a damaged record is not followed: the last good pair keeps answering, /readyz says why it is not ready
    good = paths.serving.read_text()
    damaged = paths.serving.with_name("serving.json.tmp")
    damaged.write_text('{"uri": ')
    damaged.replace(paths.serving)
    status, ready = client.json("GET", "/readyz")
    assert status == 503 and "not valid JSON" in ready["detail"], ready
    status, body = client.json("POST", "/search", {"queries": texts[:1], "k": K})
    assert status == 200 and body["model_version"] == "v1"
    damaged.write_text(good)
    damaged.replace(paths.serving)
    assert client.json("GET", "/readyz")[0] == 200
    client.close()


class Load:
    """Threads firing queries at the service until stopped; every answer is kept with the pair it names."""

    def __init__(self, port: int, threads: int = 3) -> None:
        self.answers: list[
            tuple[int, str, str, str, list[str]]
        ] = []  # thread, text, version, collection, ids
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(port, t)) for t in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, port: int, me: int) -> None:
        client = Client(port)
        i = me
        while not self._stop.is_set():
            text = UPGRADE.query_texts[i % Q]
            i += 7
            try:
                status, body = client.json("POST", "/search", {"queries": [text], "k": K})
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none may happen
                self.failures.append(f"{type(exc).__name__}: {exc}")
                client.close()
                client = Client(port)
                continue
            if status != 200:
                self.failures.append(f"{status}: {body}")
                continue
            ids = [h["id"] for h in body["results"][0]]
            self.answers.append((me, text, body["model_version"], body["collection"], ids))
        client.close()

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.answers) < n and time.monotonic() < deadline and not self.failures:
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


@on_milvus_lite
def test_thumbnails_on_request(gallery, service) -> None:
    """``"thumbnails": true``: each hit carries its gallery picture as a small JPEG data URI, read from the
    shard its row points to; without it, no thumbnail field."""
    import base64

    from PIL import Image

    client = Client(service.port)
    texts = UPGRADE.query_texts[:2]
    status, body = client.json("POST", "/search", {"queries": texts, "k": K, "thumbnails": True})
    assert status == 200, body
    for row in body["results"]:
        assert [h["caption"] for h in row] == [caption_of(h["id"]) for h in row]
        for hit in row:
            head, data = hit["thumbnail"].split(",", 1)
            assert head == "data:image/jpeg;base64"
            picture = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
            assert picture.size == (24, 16)  # smaller than the thumbnail side: never enlarged
            assert picture.getpixel((12, 8)) == pytest.approx(colour_of(hit["id"]), abs=6)
    status, body = client.json("POST", "/search", {"queries": texts[:1], "k": K})
    assert status == 200 and all("thumbnail" not in h for h in body["results"][0])
    status, body = client.json("POST", "/search", {"queries": texts[:1], "thumbnails": "many"})
    assert status == 422 and "thumbnails" in body["detail"]
    client.close()


def test_blue_green_swap_and_rollback_under_load(gallery, service) -> None:
    """Every answer is exactly what its (query model, collection) pair gives: never the new model on the old
    collection or the old model on the new one; no query fails across the swap and the rollback."""
    paths, index, _ = gallery
    source = index.serving_collection()
    options = {**OPTS, "new_dim": "48"}
    encoders = synthetic_encoders({"options": options})
    load = Load(service.port)
    try:
        load.wait_for(30)
        state = ro.run_rollout(index, paths, _config(options), encoders, PROBE).document()
        assert state["mode"] == "blue_green" and state["status"] == "completed", state.get("halt_reason")
        target = index.serving_collection()
        assert target != source
        n = len(load.answers)
        load.wait_for(n + 60)
        ro.rollback(paths, index)
        n = len(load.answers)
        load.wait_for(n + 60)
    finally:
        load.stop()
    assert not load.failures, load.failures[:5]
    from benchmarks.synthetic_upgrade import space_change

    rot, _ = space_change(options, UPGRADE.old_gallery.shape[1])
    expected = {
        ("v1", source): {t: _top_ids(index, t, "old", source) for t in UPGRADE.query_texts},
        ("v2", target): {t: _top_ids(index, t, "new", target, rot) for t in UPGRADE.query_texts},
    }
    pairs = [(version, collection) for _, _, version, collection, _ in load.answers]
    assert set(pairs) == set(expected), set(pairs)  # both pairs answered, and only those
    wrong = [a for a in load.answers if a[4] != expected[(a[2], a[3])][a[1]]]
    assert not wrong, wrong[:3]
    for me in range(3):  # each thread saw v1, then v2, then v1 again: one swap each way, no flapping
        seq = [a[2] for a in load.answers if a[0] == me]
        changes = [seq[0]] + [b for a, b in zip(seq, seq[1:], strict=False) if a != b]
        assert changes == ["v1", "v2", "v1"], changes


def test_staged_rollout_under_load_and_metrics(gallery, service) -> None:
    """Stage 0 switches the query model onto the rollout's collection (read over the source); queries keep
    flowing through every stage and each answer comes from a pair the record named."""
    paths, index, _ = gallery
    source = index.serving_collection()
    load = Load(service.port, threads=2)
    try:
        load.wait_for(20)
        config = _config(OPTS, fractions=(0.5, 1.0), slo_p99_factor=1.5)
        state = ro.run_rollout(index, paths, config, synthetic_encoders({"options": OPTS}), PROBE).document()
        assert state["status"] == "completed" and state["mode"] != "blue_green"
        pace = state["pace"]  # paced on the users' queries the service answered, read from its /metrics
        assert pace["latency_from"] == "service" and pace["idle_p99_ms"] > 0 and pace["last_p99_ms"] > 0
        n = len(load.answers)
        load.wait_for(n + 40)
    finally:
        load.stop()
    assert not load.failures, load.failures[:5]
    target = state["gallery"]["collection"]
    assert {(a[2], a[3]) for a in load.answers} == {("v1", source), ("v2", target)}  # the record's pairs only
    for me in range(2):
        seq = [a[2] for a in load.answers if a[0] == me]
        assert seq[0] == "v1" and seq[-1] == "v2" and seq == sorted(seq), "one switch, never back"
    final = {t: _top_ids(index, t, "new", target) for t in UPGRADE.query_texts}
    assert all(ids == final[text] for _, text, _, _, ids in load.answers[-20:])
    client = Client(service.port)
    _, text = client.request("GET", "/metrics")
    metrics = text.decode()
    client.close()
    rid = state["rollout_id"]
    assert f'compatflow_rollout_stage{{rollout_id="{rid}",status="completed"}} 2.0' in metrics
    assert f'compatflow_rollout_fraction_backfilled{{rollout_id="{rid}",status="completed"}} 1.0' in metrics
    assert "compatflow_rollout_probe_recall_at_1" in metrics
    assert 'version="v2"' in metrics and 'version="v1"' not in metrics
    assert "compatflow_serving_swaps_total 1.0" in metrics


@on_milvus_lite
def test_service_announces_itself_while_it_runs(gallery, tmp_path) -> None:
    """A running service is found in its workspace (services/<port>.json) and gone after SIGTERM; a file
    left by a process that no longer runs is ignored."""
    from components.adapters.services import live_services

    paths, _, uri = gallery
    svc = Service(paths.serving.parent, uri, tmp_path)
    try:
        assert live_services(paths.services) == [f"http://127.0.0.1:{svc.port}"]
    finally:
        assert svc.stop() == 0, svc.output()
    assert list(paths.services.glob("*.json")) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"url": "http://127.0.0.1:9", "pid": dead.pid, "hostname": socket.gethostname()}
    (paths.services / "9.json").write_text(json.dumps(stale))
    assert live_services(paths.services) == []


@on_milvus_lite
def test_search_command_prints_captions(gallery, capsys) -> None:
    paths, index, uri = gallery
    text = UPGRADE.query_texts[0]
    argv = [sys.executable, "-m", "pipelines.cli", "search", text, "-k", "3", "--uri", uri]
    argv += ["--workspace", str(paths.serving.parent)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    top = _top_ids(index, text, "old", index.serving_collection())[:3]
    for item_id in top:
        assert f"{item_id}  {caption_of(item_id)}" in out.stdout or caption_of(item_id) in out.stdout
    # the host check runs before anything listens; called alone, a regression could never bind a wildcard
    from pipelines.commands.serve import _check_host

    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(typer.Exit) as refused:
            _check_host(wildcard)
        assert refused.value.exit_code == 2 and "every interface is refused" in capsys.readouterr().err


@on_milvus_lite
def test_search_command_asks_the_running_service(gallery, service) -> None:
    """With a compatflow serve of the workspace announced, the command's hits are the service's answer."""
    paths, index, _ = gallery

    def answered() -> float:  # a connection of its own: a kept-alive one may time out while the CLI runs
        metrics = Client(service.port).request("GET", "/metrics")[1].decode()
        return float(re.search(r"^compatflow_queries_total (\S+)$", metrics, re.M)[1])

    before, text = answered(), UPGRADE.query_texts[0]
    argv = [sys.executable, "-m", "pipelines.cli", "search", text, "-k", "3", "--json"]
    argv += ["--workspace", str(paths.serving.parent)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert [h["item_id"] for h in json.loads(out.stdout)] == _top_ids(
        index, text, "old", index.serving_collection()
    )[:3]
    assert answered() == before + 1


def _raw_post(port: int, head: bytes, chunks: list[bytes] = ()) -> bytes:
    """Send a request head and body chunks on a raw socket; return what the service answers (until close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:  # the service answered and closed while the body was still being sent
            pass
        answer = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                answer += data
    return answer


@on_milvus_lite
def test_every_search_bound_is_refused_before_the_work(gallery, service) -> None:
    """k, queries per request and characters per query are 422s naming the field (the CLI refuses the same
    k); a body over the limit is a 413 answered before it is read, declared or chunked."""
    from components.serving.limits import MAX_BODY_BYTES, MAX_K, MAX_QUERIES, MAX_QUERY_CHARS

    paths, _, uri = gallery
    client = Client(service.port)
    text = UPGRADE.query_texts[0]
    for bad, field in (
        ({"queries": [text], "k": MAX_K + 1}, "k"),
        ({"queries": [text] * (MAX_QUERIES + 1), "k": 3}, "queries"),
        ({"queries": [text, "x" * (MAX_QUERY_CHARS + 1)], "k": 3}, "queries.1"),
    ):
        status, body = client.json("POST", "/search", bad)
        assert status == 422 and body["detail"].startswith(field), body
    status, body = client.json("POST", "/search", {"queries": [text], "k": MAX_K})
    assert status == 200 and len(body["results"][0]) == N, body  # k beyond the gallery: the gallery
    t0 = time.monotonic()
    head = b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = _raw_post(service.port, head + b"Content-Length: 104857600\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"over the limit of 1048576 bytes" in answer and time.monotonic() - t0 < 5
    chunk = b"x" * 65536
    body_chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (2 * MAX_BODY_BYTES // len(chunk))
    answer = _raw_post(service.port, head + b"Transfer-Encoding: chunked\r\n\r\n", body_chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    status, body = client.json("POST", "/search", {"queries": [text], "k": 3})
    assert status == 200  # the service goes on
    client.close()
    argv = [sys.executable, "-m", "pipelines.cli", "search", text, "-k", "1000000000", "--uri", uri]
    argv += ["--workspace", str(paths.serving.parent)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "k must be between 1 and 1000, got 1000000000" in out.stderr, out.stderr


def _checkpoint(directory: Path, seed: int) -> Path:
    """A small safetensors checkpoint folder (weights and a config that differ per seed)."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    weights = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    save_file({"visual.proj": weights}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"embed_dim": 4, "seed": seed}))
    return directory


@on_milvus_lite
def test_query_model_must_match_the_registered_digest(gallery, tmp_path) -> None:
    """A served model folder whose weights are swapped for an earlier version's, every sidecar digest and the
    manifest rewritten to match, passes a check against itself: the search command and the service refuse it
    against the registry's digest, and /readyz says so."""
    import shutil

    from compat.models.integrity import MANIFEST, file_manifest
    from components.adapters.registry import Registry
    from components.serving.record import read_serving, write_serving

    paths, _, uri = gallery
    ws = paths.serving.parent
    registry = Registry(ws)
    for seed in (1, 2):
        run_id = registry.start_run(f"run-{seed}", params={"seed": seed})
        registry.register_candidate(
            run_id, _checkpoint(tmp_path / f"m{seed}", seed), data_phase=0, method="bct"
        )
    digest = registry.version_info("2")["tags"]["checkpoint.sha256"]
    copy = registry.download("2", ws / "models" / "v2")
    record = read_serving(paths.serving)
    query_model = {**record.query_model.document(), "version": "2", "uri": str(copy)}
    write_serving(paths.serving, **{**record.model_dump(), "query_model": query_model})
    text = UPGRADE.query_texts[0]
    argv = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "search",
        text,
        "-k",
        "3",
        "--uri",
        uri,
        "--workspace",
        str(ws),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr  # the registered files: served

    for name in ("model.safetensors", "config.json"):  # version 1's weights, re-hashed to match
        shutil.copy(tmp_path / "m1" / name, copy / name)
    (copy / MANIFEST).write_text(json.dumps(file_manifest(copy), indent=2, sort_keys=True) + "\n")
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "does not match the digest registered" in refused.stderr
    assert f"registered digest sha256 {digest}" in refused.stderr and "query model 2" in refused.stderr

    service = Service(ws, uri, tmp_path, ready=False)
    try:
        client = Client(service.port)
        status, ready = client.json("GET", "/readyz")
        assert status == 503 and "does not match the digest registered" in ready["detail"], ready
        assert digest in ready["detail"]
        status, body = client.json("POST", "/search", {"queries": [text], "k": 3})
        assert status == 503 and digest in body["detail"]  # never answered by the swapped weights
        client.close()
    finally:
        assert service.stop() == 0, service.output()
    from components.serving.record import ServingError
    from components.serving.verify import RegistryDigestCheck

    with pytest.raises(ServingError, match="version 7 is not in the registry"):
        RegistryDigestCheck(ws)({"version": "7", "uri": str(copy)})


@on_milvus_lite
def test_a_deleted_workspace_copy_is_downloaded_on_use(gallery, tmp_path) -> None:
    """What status says is true: a search whose query model's ``models/vN`` is missing downloads the
    registered files (verified) and answers; a copy that differs is refused, and deleting it downloads it
    again."""
    import re
    import shutil

    from compat.models.integrity import verify_checkpoint
    from components.adapters.registry import Registry
    from components.serving.record import ServingError, read_serving, write_serving
    from components.serving.search import search
    from components.serving.verify import RegistryDigestCheck
    from components.state.workspace import Workspace
    from pipelines.status import production_check

    paths, _, uri = gallery
    ws = Workspace(paths.serving.parent)
    registry = Registry(ws)
    run_id = registry.start_run("run-1")
    gate = {"decision": "pass", "reasons": []}
    registry.register_candidate(
        run_id, _checkpoint(tmp_path / "m1", 1), data_phase=0, method="bct", gate=gate
    )
    registry.promote("1", rollout=None)
    digest = registry.version_info("1")["tags"]["checkpoint.sha256"]
    copy = ws.model_dir("1")
    record = read_serving(paths.serving)
    query_model = {**record.query_model.document(), "version": "1", "uri": str(copy)}
    write_serving(paths.serving, **{**record.model_dump(), "query_model": query_model})

    def status() -> dict:
        return production_check(ws, registry.model_name, registry.status())

    def query() -> list:
        verify = RegistryDigestCheck(ws)
        return search(UPGRADE.query_texts[:1], 3, record_path=paths.serving, uri=uri, verify=verify)[0]

    assert not copy.exists() and status()["ok"] is None and "downloaded" in status()["message"]
    assert len(query()) == 3  # downloaded on use
    verify_checkpoint(copy, digest)
    assert status()["ok"] is True

    (copy / "config.json").write_text(json.dumps({"embed_dim": 4, "seed": 9}))
    with pytest.raises(
        ServingError, match=re.escape(f"delete {copy} to download the registered files again")
    ):
        query()
    assert status()["ok"] is False and f"delete {copy} to download it again" in status()["message"]
    shutil.rmtree(copy)  # as both messages say
    assert len(query()) == 3
    verify_checkpoint(copy, digest)


@on_milvus_lite
def test_query_overtaken_by_an_in_place_switch_runs_again(gallery) -> None:
    """Stage 0 of an in-place rollout moves the query model on the same collection while a query runs: the
    answer comes from the new query model (the old one could meet the backfill's first new vectors)."""
    from components.serving.pair import PairFollower
    from components.serving.record import read_serving, write_serving

    paths, index, _ = gallery
    record = read_serving(paths.serving)
    follower = PairFollower(paths.serving, index=index)
    text = UPGRADE.query_texts[3]
    seen = []

    def query(pair):
        seen.append(pair.version)
        if len(seen) == 1:  # the record is rewritten while the first run is in flight
            fields = {k: getattr(record, k) for k in ("uri", "alias", "collection", "space", "dim")}
            new_model = {"version": "v2", "factory": SYNTH_QUERY, "options": OPTS, "side": "new"}
            write_serving(paths.serving, **fields, query_model=new_model, previous=None, rollout_id="r")
        return pair.search([text], K)

    hits, pair = follower.answer(query)
    assert seen == ["v1", "v2"] and pair.version == "v2" and pair.collection == record.collection
    assert [h.item_id for h in hits[0]] == _top_ids(index, text, "new", record.collection)
    follower.close()
