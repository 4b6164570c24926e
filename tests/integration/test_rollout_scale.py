"""The rollout at gallery scale: stages as filters on the keys each row carries, slices on workers.

The stages of every order partition a keyed collection near their fractions, placed on a sample; the plan
reads a sample, not the gallery; on a server, a stage fanned out over 2 worker processes leaves the gallery 1
process leaves, a range killed mid-way resumes with nothing lost or doubled, and the pace's rate cap is one
budget over the workers.
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
from components import rollout as ro
from components.adapters.index import ORDER_FIELDS, GalleryIndex
from components.deployment import RolloutSection
from components.rollout import workers

N, Q, SEED = 400, 200, 3
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}
UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)
PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])
ENCODERS = f"{SYNTH_MODULE}:synthetic_encoders"


def _keyed(tmp_path: Path, n: int = 1200) -> GalleryIndex:
    """A milvus-lite collection of ``n`` random unit vectors written with their order keys (centres fitted on
    them), embedded at 30 distinct times."""
    from components.rollout.keys import fit_centres

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(n, 8)).astype(np.float32)
    index = GalleryIndex(str(tmp_path / "keys.db"))
    name = index.create_collection("s", 8)
    ids = [f"it-{i:0{1 + i % 5}d}" for i in range(n)]  # ids of several widths
    times = [int(t) for t in rng.integers(0, 30, size=n)]
    index.index_items(
        ids, vectors, "v1", "s", embedded_at=times, collection=name, centres=fit_centres(vectors, 6)
    )
    index.switch_alias(name)
    return index


@pytest.mark.parametrize("policy", ["random", "oldest_first", "lambda_orth", "uncertainty"])
def test_stages_are_filters_that_partition_the_gallery_near_their_fractions(tmp_path, policy) -> None:
    """Every item in exactly one stage, each stage its slices' union and near its share; stages ordered by
    the policy's key (ties broken by order_key), placed on a sample read by filter."""
    from components.rollout.keys import KEY_FIELDS, SAMPLE_ROWS, plan_selection, sample_filter

    n, fractions = 1200, (0.1, 0.25, 0.5, 1.0)
    with _keyed(tmp_path, n) as index:
        sample = next(
            index.iter_rows(("embedded_at", *ORDER_FIELDS), filter=sample_filter(n, 400), batch_size=n)
        )
        assert 300 < len(sample) < 500  # a uniform sample by hash, not the gallery
        selection = plan_selection(policy, fractions, 7, sample)
        counts = [index.count(filter=selection.stage(j)) for j in range(1, 5)]
        assert sum(counts) == n
        for j, f in enumerate(fractions, start=1):
            assert abs(index.count(filter=selection.upto(j)) - f * n) < 0.06 * n
            slices = selection.slices(j, 5)
            assert sum(index.count(filter=s) for s in slices) == counts[j - 1]
        assert index.count(filter=selection.upto(0)) == 0 and SAMPLE_ROWS >= 400
        if policy != "random":
            field = KEY_FIELDS[policy]
            first = [
                r[field] for r in next(index.iter_rows((field,), filter=selection.stage(1), batch_size=n))
            ]
            rest = [
                r[field]
                for r in next(index.iter_rows((field,), filter=f"not ({selection.upto(1)})", batch_size=n))
            ]
            assert max(first) <= min(rest)
    other = plan_selection(policy, fractions, 8, sample)
    assert (other == selection) == (policy != "random")  # the seed moves the random window only


def test_order_scores_put_the_far_and_the_uncertain_first() -> None:
    """lambda-orth's key is minus the distance to the nearest centre; uncertainty's the top-2 gap."""
    from components.rollout.keys import order_scores

    centres = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    x = np.array([[1.0, 0.0], [1.0, 0.2], [1.0, 1.0]], dtype=np.float32)  # on a centre, near, between
    keys = order_scores(x, centres)
    assert np.argsort(keys["key_lambda_orth"]).tolist() == [2, 1, 0]
    assert np.argsort(keys["key_uncertainty"]).tolist() == [2, 1, 0]
    assert keys["key_uncertainty"][2] == pytest.approx(0.0, abs=1e-6)


def test_slice_ranges_split_a_stage() -> None:
    assert workers.split_ranges(7, 2) == [(0, 3), (3, 7)]
    assert workers.split_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert workers.split_ranges(1, 4) == [(0, 1)]
    assert workers.n_slices(200, 32) == 7 and workers.n_slices(0, 32) == 1


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


def test_the_plan_reads_a_sample_not_the_gallery(tmp_path, monkeypatch) -> None:
    """A sample of about 60 rows places the stages of 400 items; the rollout completes, its rollback is a
    switch back to the untouched source."""
    from components.rollout import keys

    monkeypatch.setattr(keys, "SAMPLE_ROWS", 60)
    paths = ro.RolloutPaths.for_workspace(tmp_path / "ws")
    with GalleryIndex(str(tmp_path / "ws" / "milvus" / "gallery.db")) as index:
        _index_old(paths, index)
        before = _gallery(index)
        state = ro.run_rollout(index, paths, _config(order="oldest_first"), _encoders(), PROBE).document()
        assert state["status"] == "completed" and state["n_items"] == N
        assert 20 < state["order"]["sample"] < 120
        assert index.count_by_version() == {"v2": N} and index.count() == N
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
    a = ro.run_rollout(one, one_paths, _config(), _encoders(), PROBE).document()
    b = ro.run_rollout(two, two_paths, _config(workers=2), _encoders(), PROBE).document()
    assert a["status"] == b["status"] == "completed"
    assert all(len(s["workers"]) == 2 for s in b["stages"][1:])
    assert sum(w["written"] for s in b["stages"][1:] for w in s["workers"]) == N
    ga, gb = _gallery(one), _gallery(two)
    assert two.count() == N and two.count_by_version() == {"v2": N}
    assert all(gb[i][0] == "v2" and np.allclose(ga[i][1], gb[i][1], atol=1e-6) for i in UPGRADE.item_ids)


def test_a_worker_killed_mid_range_resumes_with_nothing_lost_or_doubled(on_server, tmp_path) -> None:
    """A worker process SIGKILLed mid-range and run again: every item of its range has its new vector, once;
    the source is untouched."""
    paths, index = on_server("ws")
    before = _gallery(index)
    config = _config(workers=2, fractions=(1.0,), range_tasks=True)
    state = ro.run_rollout(index, paths, config, _encoders(delay_s="0.15"), PROBE)
    work = paths.work(state.rollout_id)
    (start, end), *_ = workers.pending_ranges(state, work)
    cursor = workers.range_cursor(work, 1, start, end)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    spec = str(work / workers.SPEC_FILE)
    code = f"from components.rollout.workers import run_range; run_range({spec!r}, {start}, {end})"
    cmd = [sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # its imports alone take a minute or more on two busy cores
    while time.monotonic() < deadline and proc.poll() is None:
        if cursor.is_file() and 2 <= json.loads(cursor.read_text())["position"] < end:
            break
        time.sleep(0.02)
    proc.kill()  # mid-range, or (the assertions below fail) not started in time
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read().decode()[-2000:]
    assert 2 <= json.loads(cursor.read_text())["position"] < end
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert json.loads(cursor.read_text())["position"] == end
    target = state.gallery.collection
    mine = index.count(target)
    for s, e in workers.pending_ranges(state, work):
        workers.run_range(work / workers.SPEC_FILE, s, e)
    state = ro.run_rollout(index, paths, config, _encoders(), PROBE).document()
    assert state["status"] == "completed" and 0 < mine < N
    assert index.count(target) == N and index.count_by_version(target) == {"v2": N}  # none doubled
    assert _gallery(index).keys() == before.keys()
    source = state["gallery"]["source_collection"]
    assert index.count_by_version(source) == {"v1": N}


def test_the_rate_cap_is_one_budget_over_two_workers(on_server) -> None:
    """max_items_per_s 400 over 2 workers: each paces at 200/s, so its ~200 items take about 1 s, not the
    0.5 s two uncoordinated workers at the full cap would take."""
    paths, index = on_server("ws")
    config = _config(workers=2, fractions=(1.0,), max_items_per_s=400.0, batch_size=20)
    state = ro.run_rollout(index, paths, config, _encoders(), PROBE).document()
    assert state["status"] == "completed"
    stage = state["stages"][1]
    assert [w["pace"]["items_per_s_allowed"] for w in stage["workers"]] == [200.0, 200.0]
    assert sum(w["written"] for w in stage["workers"]) == N  # half the slices each: about half the items
    assert all(w["seconds"] >= 0.9 * w["written"] / 200.0 for w in stage["workers"])


def test_ranges_run_by_pipeline_tasks_one_stage_at_a_time(on_server) -> None:
    """``range_tasks`` (the cluster pipeline's ParallelFor): each call returns once a stage's ranges wait,
    the ranges run on their own (``run_range``, as each parallel task does), and the next call probes that
    stage and hands out the next one's, until the rollout completes."""
    paths, index = on_server("ws")
    config = _config(workers=2, fractions=(0.5, 1.0), range_tasks=True)
    handed_out = []
    for _ in range(4):
        state = ro.run_rollout(index, paths, config, _encoders(), PROBE)
        work = paths.work(state.rollout_id)
        pending = workers.pending_ranges(state, work)
        if not pending:
            break
        handed_out.append(pending)
        for start, end in pending:
            workers.run_range(work / workers.SPEC_FILE, start, end)
    assert handed_out == [[(0, 3), (3, 7)], [(0, 3), (3, 7)]]  # 200 items a stage: 7 slices of ~32 each
    assert state.status == "completed" and [s.status for s in state.stages] == ["accepted"] * 3
    assert index.count() == N and index.count_by_version() == {"v2": N}
