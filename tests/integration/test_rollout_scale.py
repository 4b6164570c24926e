"""The rollout at gallery scale: the order streamed into ranked chunks on disk, rank ranges on workers.

The order's pieces are checked against in-memory answers with sizes forced small (several spill blocks, sort
runs and chunks from a few hundred items); the engine plans a collection larger than one read; on a server, a
stage fanned out over 2 worker processes leaves the gallery 1 process leaves, a range killed mid-way resumes
with nothing lost or doubled, and the pace's rate cap is one budget over the workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from _milvus import server_uri

from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE
from benchmarks.synthetic_upgrade import synthetic_encoders, synthetic_upgrade
from compat.backfill import order_digest
from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.deployment import RolloutSection
from components.rollout import order as order_mod
from components.rollout import plan, workers
from components.rollout.order import OrderError, RankedOrder, Spill, build_order, hash_ids

N, Q, SEED = 400, 200, 3
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}
UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)
PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])
ENCODERS = f"{SYNTH_MODULE}:synthetic_encoders"


def _rows(n: int, dim: int = 4, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "item_id": f"it-{i:0{1 + i % 5}d}",  # ids of several widths
            "embedded_at": int(rng.integers(0, 50)),  # ties: broken by item id
            "vector": rng.normal(size=dim).tolist(),
        }
        for i in range(n)
    ]


def _spill(tmp_path: Path, rows: list[dict], with_vectors: bool = False) -> Spill:
    batches = (rows[s : s + 37] for s in range(0, len(rows), 37))
    return Spill(tmp_path / "spill", block_rows=60).write(batches, with_vectors=with_vectors)


@pytest.mark.parametrize("order", ["random", "oldest_first"])
def test_ranked_chunks_equal_an_in_memory_sort_across_runs_and_chunks(tmp_path, order) -> None:
    rows = _rows(500)
    spill = _spill(tmp_path, rows)
    assert len(spill.blocks) == 7 and spill.n_items == 500  # blocks of 2 reads of 37
    ranked = build_order(spill, tmp_path / "order", order, seed=7, run_rows=90, chunk_rows=64)
    ids = np.asarray([r["item_id"].encode() for r in rows])
    key = (
        (hash_ids(ids, 7) >> np.uint64(11)).astype(np.float64)
        if order == "random"
        else np.asarray([r["embedded_at"] for r in rows], dtype=np.float64)
    )
    expected = [ids[i].decode() for i in np.lexsort((ids, key))]
    assert len(ranked) == 500 and len(ranked.manifest["chunks"]) == 8
    assert ranked[0:500] == expected
    assert ranked[60:130] == expected[60:130] and ranked[499] == expected[499]  # across chunk bounds
    assert ranked.digest == order_digest(expected)
    assert not (tmp_path / "order" / "runs").exists()


def test_random_order_is_seeded_and_independent_of_the_read_order(tmp_path) -> None:
    rows = _rows(300)
    a = build_order(_spill(tmp_path / "a", rows), tmp_path / "oa", "random", seed=1, run_rows=70)
    b = build_order(_spill(tmp_path / "b", rows[::-1]), tmp_path / "ob", "random", seed=1, run_rows=70)
    c = build_order(_spill(tmp_path / "c", rows), tmp_path / "oc", "random", seed=2, run_rows=70)
    assert a[0:300] == b[0:300] and a[0:300] != c[0:300]
    assert sorted(a[0:300]) == sorted(r["item_id"] for r in rows)


def test_lambda_orth_streamed_ranks_the_members_farthest_from_their_class_mean_first(tmp_path) -> None:
    """Two tight clusters and four planted outliers (lambda-orth Sec. 3.6: descending distance to the class
    mean): the outliers lead, the farthest first, whatever block or sample they are read in."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(400):
        centre = np.array([20.0, 0, 0, 0]) if i % 2 else np.array([-20.0, 0, 0, 0])
        rows.append(
            {"item_id": f"c{i:03d}", "embedded_at": 0, "vector": (centre + 0.1 * rng.normal(size=4)).tolist()}
        )
    for j, (sign, dist) in enumerate([(1, 6.0), (-1, 5.0), (1, 4.0), (-1, 3.0)]):
        v = np.array([20.0 * sign, dist, 0, 0])
        rows.insert(97 * (j + 1), {"item_id": f"out{j}", "embedded_at": 0, "vector": v.tolist()})
    spill = _spill(tmp_path, rows, with_vectors=True)
    ranked = build_order(spill, tmp_path / "order", "lambda_orth", n_clusters=2, sample_rows=50, run_rows=100)
    assert ranked[0:4] == ["out0", "out1", "out2", "out3"]


def test_a_modified_chunk_or_another_order_is_refused(tmp_path) -> None:
    ranked = build_order(_spill(tmp_path, _rows(200)), tmp_path / "order", "random", chunk_rows=64)
    with pytest.raises(OrderError, match="not the"):
        RankedOrder(ranked.directory, expected_digest="0" * 64)
    chunk = ranked.directory / ranked.manifest["chunks"][1]["file"]
    ids = np.load(chunk)
    np.save(chunk, ids[::-1])
    fresh = RankedOrder(ranked.directory, expected_digest=ranked.digest)
    assert fresh[0:10] == ranked[0:10]  # an untouched chunk reads
    with pytest.raises(OrderError, match="was modified"):
        fresh[70:80]


def test_rank_ranges_split_on_the_stage_grid() -> None:
    assert workers.split_ranges(40, 100, 32, 2) == [(40, 72), (72, 100)]
    assert workers.split_ranges(0, 300, 32, 3) == [(0, 128), (128, 224), (224, 300)]
    assert workers.split_ranges(0, 10, 32, 4) == [(0, 10)]
    assert workers.split_ranges(5, 5, 32, 2) == []


def _index_old(paths: ro.RolloutPaths, index: GalleryIndex) -> None:
    UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"shard#{i}" for i in UPGRADE.item_ids])


def _config(**kw) -> ro.RolloutConfig:
    kw.setdefault("batch_size", 32)
    kw.setdefault("order", "random")
    return ro.RolloutConfig.from_section(
        RolloutSection(),
        new_version="v2",
        query_model={"factory": f"{SYNTH_MODULE}:synthetic_query_encoder", "options": OPTS, "side": "new"},
        **kw,
    )


def _encoders(**options) -> ro.RolloutEncoders:
    args = {"options": {**OPTS, **options}}
    built = synthetic_encoders(args)
    built.recipe = {"factory": ENCODERS, "args": args}
    return built


def _gallery(index: GalleryIndex) -> dict[str, tuple[str, np.ndarray]]:
    rows = index.fetch(UPGRADE.item_ids)
    return {r["item_id"]: (r["model_version"], np.asarray(r["vector"], dtype=np.float32)) for r in rows}


def test_plan_streams_a_collection_larger_than_one_read(tmp_path, monkeypatch) -> None:
    """Reads of 50 rows, spill blocks of 60 and sort runs of 90 items: the plan's order holds every item
    once, the rollout completes and its rollback restores every old vector."""
    monkeypatch.setattr(plan, "READ_ROWS", 50)
    monkeypatch.setattr(order_mod, "SPILL_ROWS", 60)
    monkeypatch.setattr(order_mod, "RUN_ROWS", 90)
    monkeypatch.setattr(order_mod, "CHUNK_ROWS", 64)
    paths = ro.RolloutPaths.for_workspace(tmp_path / "ws")
    with GalleryIndex(str(tmp_path / "ws" / "milvus" / "gallery.db")) as index:
        _index_old(paths, index)
        before = _gallery(index)
        state = ro.run_rollout(index, paths, _config(order="oldest_first"), _encoders(), PROBE)
        assert state["status"] == "completed" and state["n_items"] == N
        ranked = RankedOrder(state["order"]["path"], expected_digest=state["order"]["digest"])
        assert sorted(ranked[0:N]) == sorted(UPGRADE.item_ids) and len(ranked.manifest["chunks"]) == 7
        assert index.count_by_version() == {"v2": N} and index.count() == N
        assert not (Path(state["order"]["path"]).parent / "spill").exists()
        ro.rollback(paths, index)
        after = _gallery(index)
    assert all(after[i][0] == "v1" and np.allclose(after[i][1], before[i][1]) for i in UPGRADE.item_ids)


def test_workers_need_a_server_for_the_gallery(tmp_path) -> None:
    paths = ro.RolloutPaths.for_workspace(tmp_path / "ws")
    with GalleryIndex(str(tmp_path / "ws" / "milvus" / "gallery.db")) as index:
        _index_old(paths, index)
        with pytest.raises(ro.RolloutError, match="needs the gallery on a server"):
            ro.run_rollout(index, paths, _config(workers=2), _encoders(), PROBE)


@pytest.fixture
def on_server(tmp_path, request):
    """A fresh gallery of the synthetic upgrade on the session's ``milvus-lite server``."""

    def make(name: str) -> tuple[ro.RolloutPaths, GalleryIndex]:
        uri = server_uri(request, "milvus-lite")
        index = GalleryIndex(uri, f"g{uuid.uuid4().hex[:10]}")
        request.addfinalizer(index.close)
        paths = ro.RolloutPaths.for_workspace(tmp_path / name)
        _index_old(paths, index)
        return paths, index

    return make


def test_two_workers_leave_the_same_gallery_as_one(on_server) -> None:
    one_paths, one = on_server("one")
    two_paths, two = on_server("two")
    a = ro.run_rollout(one, one_paths, _config(), _encoders(), PROBE)
    b = ro.run_rollout(two, two_paths, _config(workers=2), _encoders(), PROBE)
    assert a["status"] == b["status"] == "completed"
    assert all(len(s["workers"]) == 2 for s in b["stages"][1:])
    assert sum(w["written"] for s in b["stages"][1:] for w in s["workers"]) == N
    ga, gb = _gallery(one), _gallery(two)
    assert two.count() == N and two.count_by_version() == {"v2": N}
    assert all(gb[i][0] == "v2" and np.allclose(ga[i][1], gb[i][1], atol=1e-6) for i in UPGRADE.item_ids)


def test_a_worker_killed_mid_range_resumes_with_nothing_lost_or_doubled(on_server, tmp_path) -> None:
    """A worker process SIGKILLed mid-range and run again: every item of its range has its new vector, the
    gallery holds each item once, and the rollback restores the rows the batches first replaced."""
    paths, index = on_server("ws")
    before = _gallery(index)
    rollout = ro.Rollout(index, paths, _config(workers=2, fractions=(1.0,)), _encoders(delay_s="0.15"), PROBE)
    state = rollout._plan()
    rollout._stage0(state)
    spec = workers.write_spec(
        paths.work(state["rollout_id"]),
        {
            "uri": index.uri,
            "alias": index.alias,
            "source": state["gallery"]["collection"],
            "target": state["gallery"]["collection"],
            "serving": state["gallery"]["collection"],
            "keep": True,
            "restore_dir": str(paths.restore_dir(state["rollout_id"])),
            "order": {"path": state["order"]["path"], "digest": state["order"]["digest"]},
            "batch_size": 32,
            "flush_rows": 0,
            "new_version": "v2",
            "space": state["gallery"]["space"],
            "dim": state["gallery"]["dim"],
            "rollout_id": state["rollout_id"],
            "encoders": rollout.encoders.recipe,
            "pace": {},
            "workers": 1,
            "services_dir": str(paths.services),
        },
    )
    start, end = 0, N
    cursor = workers.range_cursor(spec.parent, start, end)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, "-m", "components.rollout.workers", str(spec), str(start), str(end)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if cursor.is_file() and 96 <= json.loads(cursor.read_text())["position"] < end:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read().decode()[-2000:]
    killed_at = json.loads(cursor.read_text())["position"]
    assert 96 <= killed_at < end and index.count() == N
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    final = json.loads(cursor.read_text())
    assert final["position"] == end and final["written"] >= N
    assert index.count() == N and index.count_by_version() == {"v2": N}
    state["cursor"]["ranges"] = [[start, end]]
    ro.save_state(paths.state, state)
    ro.rollback(paths, index)
    after = _gallery(index)
    assert all(after[i][0] == "v1" and np.allclose(after[i][1], before[i][1]) for i in UPGRADE.item_ids)


def test_the_rate_cap_is_one_budget_over_two_workers(on_server) -> None:
    """max_items_per_s 400 over 2 workers: each paces at 200/s, and the whole backfill of 400 items takes
    about 1 s of pacing, not the 0.5 s two uncoordinated workers at the full cap would take."""
    paths, index = on_server("ws")
    config = _config(workers=2, fractions=(1.0,), max_items_per_s=400.0, batch_size=20)
    state = ro.run_rollout(index, paths, config, _encoders(), PROBE)
    assert state["status"] == "completed"
    stage = state["stages"][1]
    assert [w["pace"]["items_per_s_allowed"] for w in stage["workers"]] == [200.0, 200.0]
    assert all(w["written"] == 200 and w["seconds"] >= 0.9 for w in stage["workers"])


def test_ranges_run_by_pipeline_tasks_one_stage_at_a_time(on_server) -> None:
    """``range_tasks`` (the cluster pipeline's ParallelFor): each call returns once a stage's ranges wait,
    the ranges run on their own (``run_range``, as each parallel task does), and the next call probes that
    stage and hands out the next one's, until the rollout completes."""
    paths, index = on_server("ws")
    config = _config(workers=2, fractions=(0.5, 1.0), range_tasks=True)
    handed_out = []
    for _ in range(4):
        state = ro.run_rollout(index, paths, config, _encoders(), PROBE)
        work = paths.work(state["rollout_id"])
        pending = workers.pending_ranges(state, work)
        if not pending:
            break
        handed_out.append(pending)
        for start, end in pending:
            workers.run_range(work / workers.SPEC_FILE, start, end)
    assert handed_out == [[(0, 128), (128, 200)], [(200, 328), (328, 400)]]  # 7 batches of 32 each
    assert state["status"] == "completed" and [s["status"] for s in state["stages"]] == ["accepted"] * 3
    assert index.count() == N and index.count_by_version() == {"v2": N}
