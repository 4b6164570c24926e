"""The rollout engine on real milvus-lite: staged backfill, halts, blue-green, crashes, kill -9, search."""

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
from _milvus import SERVER_BACKENDS, server_uri

import schemas
from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE
from benchmarks.synthetic_upgrade import synthetic_encoders, synthetic_upgrade
from components import rollout as ro
from components.index import GalleryIndex
from components.rollout import engine, read_serving
from components.rollout.state import load_rows, saved_batches, stage_batches
from components.rollout.types import DEFAULT_FLUSH_ROWS
from components.search import Searcher

N, Q, SEED = 400, 200, 3
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}
SYNTH_QUERY = f"{SYNTH_MODULE}:synthetic_query_encoder"
UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)
PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])


def _index_old(paths: ro.RolloutPaths, index: GalleryIndex) -> None:
    UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"shard#{i}" for i in UPGRADE.item_ids])


def _config(**kw) -> ro.RolloutConfig:
    kw.setdefault("batch_size", 32)
    return ro.RolloutConfig(
        new_version="v2", query_model={"factory": SYNTH_QUERY, "options": OPTS, "side": "new"}, **kw
    )


def _vectors(index: GalleryIndex, collection: str | None = None) -> dict[str, np.ndarray]:
    rows = index.fetch(UPGRADE.item_ids, collection)
    return {r["item_id"]: np.asarray(r["vector"], dtype=np.float32) for r in rows}


def _assert_gallery(
    index: GalleryIndex, vectors: np.ndarray, version: str, collection: str | None = None
) -> None:
    """Every item has exactly one vector, of ``version``, equal to its row of ``vectors``."""
    assert index.count(collection) == N
    assert index.count_by_version(collection) == {version: N}
    got = _vectors(index, collection)
    assert len(got) == N
    assert np.allclose(np.stack([got[i] for i in UPGRADE.item_ids]), vectors, atol=1e-6)


@pytest.fixture
def setup(tmp_path):
    paths = ro.RolloutPaths.for_workspace(tmp_path / "ws")
    index = GalleryIndex(str(tmp_path / "ws" / "milvus" / "gallery.db"))
    _index_old(paths, index)
    yield paths, index
    index.close()


def test_staged_rollout_completes_and_rolls_back(setup) -> None:
    paths, index = setup
    source = index.serving_collection()
    state = ro.run_rollout(
        index, paths, _config(order="lambda_orth"), synthetic_encoders({"options": OPTS}), PROBE
    )
    schemas.validate(json.loads(paths.state.read_text()), "rollout_state", str(paths.state))
    assert state["state"] == "completed" and state["fraction_backfilled"] == 1.0
    assert [s["state"] for s in state["stages"]] == ["accepted"] * 5
    assert [p["fraction"] for p in state["curve"]] == [0.0, 0.1, 0.25, 0.5, 1.0]
    for stage in state["stages"]:
        assert all(stage["probe"][m] >= state["floors"][m] for m in state["floors"])
    assert state["curve"][-1]["t2i_R@1"] > state["curve"][0]["t2i_R@1"] > state["baseline"]["R@1"]
    assert index.serving_collection() == source  # staged: in place
    _assert_gallery(index, UPGRADE.new_gallery, "v2")
    record = read_serving(paths.serving)
    assert record["query_model"]["side"] == "new" and record["query_model"]["version"] == "v2"
    summary = ro.status(paths.state)
    assert (summary["state"], summary["stage"], summary["fraction_backfilled"]) == ("completed", 4, 1.0)
    # lineage: new rows carry the rollout id, old rows' source uri is kept
    row = index.fetch(["item-00007"])[0]
    assert row["rollout_id"] == state["rollout_id"] and row["source_uri"] == "shard#item-00007"
    # a rerun of the completed rollout is a no-op
    assert (
        ro.run_rollout(
            index, paths, _config(order="lambda_orth"), synthetic_encoders({"options": OPTS}), PROBE
        )["state"]
        == "completed"
    )

    back = ro.rollback(paths, index)
    assert back["state"] == "rolled_back" and back["query_model"]["side"] == "old"
    _assert_gallery(index, UPGRADE.old_gallery, "v1")
    assert read_serving(paths.serving)["query_model"]["version"] == "v1"
    assert ro.rollback(paths, index)["state"] == "rolled_back"  # idempotent


def test_regression_halts_and_restores_the_stage(setup) -> None:
    paths, index = setup
    broken = synthetic_encoders({"options": {**OPTS, "broken": "1"}})
    state = ro.run_rollout(index, paths, _config(), broken, PROBE)
    assert state["state"] == "halted" and state["restored"]
    assert state["stages"][0]["state"] == "accepted" and state["stages"][1]["state"] == "halted"
    probe, floors = state["stages"][1]["probe"], state["floors"]
    broken_metrics = [m for m in floors if probe[m] < floors[m]]
    assert broken_metrics and all(m in state["halt_reason"] for m in broken_metrics)
    assert state["fraction_backfilled"] == 0.0 and state["cursor"]["position"] == 0
    _assert_gallery(index, UPGRADE.old_gallery, "v1")  # the stage's items got their old vectors back
    # fail closed: running the same configuration again does not retry the regression
    assert ro.run_rollout(index, paths, _config(), broken, PROBE)["state"] == "halted"
    assert index.count_by_version() == {"v1": N}


def test_stage0_floor_blocks_the_query_switch(setup) -> None:
    paths, index = setup
    state = ro.run_rollout(
        index, paths, _config(floors={"R@1": 99.0}), synthetic_encoders({"options": OPTS}), PROBE
    )
    assert state["state"] == "halted" and state["stage"] == 0
    assert state["floors"]["R@1"] == 99.0 and state["floors"]["R@5"] == state["baseline"]["R@5"]
    assert read_serving(paths.serving)["query_model"]["version"] == "v1"  # queries never switched
    assert index.count_by_version() == {"v1": N}


def test_probe_of_another_gallery_is_refused(setup) -> None:
    paths, index = setup
    stranger = ro.ProbeSet(PROBE.texts[:3], [["not-an-item"]] * 3)
    with pytest.raises(ro.RolloutError, match="another gallery"):
        ro.run_rollout(index, paths, _config(), synthetic_encoders({"options": OPTS}), stranger)
    assert not paths.state.exists()


class _Crash(RuntimeError):
    pass


def test_crash_between_upsert_and_state_write_repeats_the_batch(setup, monkeypatch) -> None:
    """The batch whose state write failed is upserted again on resume; its restore file keeps the old rows."""
    paths, index = setup
    real_save = ro.save_state
    calls = {"n": 0}

    def flaky_save(path, state):
        calls["n"] += 1
        if state["cursor"]["position"] == 72 and state["state"] == "running":
            raise _Crash("power cut after upsert")
        real_save(path, state)

    monkeypatch.setattr(engine, "save_state", flaky_save)
    encoders = synthetic_encoders({"options": OPTS})
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(), encoders, PROBE)
    saved = json.loads(paths.state.read_text())
    assert saved["state"] == "running" and saved["cursor"]["position"] == 40
    assert index.count_by_version()["v2"] >= 72  # the batch 40..72 is already upserted
    monkeypatch.setattr(engine, "save_state", real_save)
    state = ro.run_rollout(index, paths, _config(), encoders, PROBE)
    assert state["state"] == "completed"
    _assert_gallery(index, UPGRADE.new_gallery, "v2")
    ro.rollback(paths, index)  # the repeated batch restored the rows it first replaced: the old ones
    _assert_gallery(index, UPGRADE.old_gallery, "v1")


def _failing_encoders(at_call: int) -> ro.RolloutEncoders:
    """The synthetic upgrade's encoders whose gallery encoder dies on its ``at_call``-th batch."""
    good = synthetic_encoders({"options": OPTS})
    calls = {"n": 0}

    def failing(refs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise _Crash("encoder died")
        return good.new_gallery(refs)

    return ro.RolloutEncoders(good.old_query, good.new_query, failing)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_encoder_failure_resumes_from_the_cursor(setup, prefetch) -> None:
    """Batches prepared ahead of a failure are never written: the index holds exactly the cursor's prefix."""
    paths, index = setup
    good = synthetic_encoders({"options": OPTS})
    bad = _failing_encoders(5)
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(prefetch=prefetch), bad, PROBE)
    saved = json.loads(paths.state.read_text())
    assert saved["state"] == "running" and saved["cursor"]["position"] > 0
    assert index.count_by_version() == {
        "v1": N - saved["cursor"]["position"],
        "v2": saved["cursor"]["position"],
    }
    with pytest.raises(ValueError, match="prefetch"):
        _config(prefetch=0)
    other = _config(order="oldest_first")
    with pytest.raises(ro.RolloutError, match="is running"):  # another configuration may not start meanwhile
        ro.run_rollout(index, paths, other, good, PROBE)
    assert ro.run_rollout(index, paths, _config(), good, PROBE)["state"] == "completed"
    _assert_gallery(index, UPGRADE.new_gallery, "v2")


def test_forward_transform_goes_through_a_new_collection(setup) -> None:
    """Old vectors read through a gallery transform (here zero-padding to 40 dims) live in a copy."""
    paths, index = setup
    source = index.serving_collection()
    good = synthetic_encoders({"options": OPTS})

    def pad(v):
        return np.concatenate([v, np.zeros((len(v), 8), np.float32)], axis=1)

    enc = ro.RolloutEncoders(
        good.old_query,
        good.new_query,
        lambda refs: pad(good.new_gallery(refs)),
        query_transform=pad,
        gallery_transform=pad,
        transform_tag="zero_pad:v2",
    )
    state = ro.run_rollout(index, paths, _config(order="uncertainty"), enc, PROBE)
    assert state["state"] == "completed"
    target = index.serving_collection()
    assert target != source and index.collection_dim(target) == 40
    _assert_gallery(index, pad(UPGRADE.new_gallery), "v2", target)
    _assert_gallery(index, UPGRADE.old_gallery, "v1", source)  # untouched, kept for rollback
    ro.rollback(paths, index)
    assert index.serving_collection() == source and read_serving(paths.serving)["dim"] == 32


def test_space_change_goes_blue_green(setup) -> None:
    paths, index = setup
    source = index.serving_collection()
    good = synthetic_encoders({"options": OPTS})
    rot = np.linalg.qr(np.random.default_rng(0).normal(size=(48, 48)))[0][:32].astype(np.float32)  # 32 -> 48

    enc = ro.RolloutEncoders(
        good.old_query,
        lambda t: good.new_query(t) @ rot,
        lambda refs: good.new_gallery(refs) @ rot,
        space="s2",
    )
    state = ro.run_rollout(index, paths, _config(), enc, PROBE)
    assert state["mode"] == "blue_green" and state["state"] == "completed"
    target = index.serving_collection()
    assert target.endswith("_s2_1") and index.collection_space(target) == "s2"
    _assert_gallery(index, UPGRADE.new_gallery @ rot, "v2", target)
    assert index.count_by_version(source) == {"v1": N}
    assert read_serving(paths.serving)["space"] == "s2"
    ro.rollback(paths, index)
    assert index.serving_collection() == source and read_serving(paths.serving)["space"] == "s1"


def test_search_api_and_cli_serve_the_record(tmp_path) -> None:
    from typer.testing import CliRunner

    from components.search import search
    from pipelines.cli import app

    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    with GalleryIndex(str(ws / "milvus" / "gallery.db")) as index:
        _index_old(paths, index)
        server = Searcher(paths.serving)  # long-lived: picks up the query switch without a restart
        before = server.search(UPGRADE.query_texts[:1], 3)[0]
        assert (
            before[0]["item_id"]
            == index.search(UPGRADE.query_vectors(UPGRADE.query_texts[:1], "old"), 3)[0][0].item_id
        )
        ro.run_rollout(
            index, paths, _config(fractions=(0.5, 1.0)), synthetic_encoders({"options": OPTS}), PROBE
        )
        text = UPGRADE.query_texts[0]
        expected = index.search(UPGRADE.query_vectors([text], "new"), k=5)[0]
        api = search([text], 5, record_path=paths.serving, index=index)[0]
        assert server.query_model["version"] == "v1"
        live = server.search([text], 5)[0]
        assert server.query_model["version"] == "v2"
        server.close()
    assert live == api
    assert [h["item_id"] for h in api] == [h.item_id for h in expected]
    result = CliRunner().invoke(app, ["search", text, "-k", "5", "--json", "--workspace", str(ws)])
    assert result.exit_code == 0, result.output
    hits = json.loads(result.output)
    assert [h["item_id"] for h in hits] == [h.item_id for h in expected]
    assert set(hits[0]) == {"item_id", "score", "model_version", "caption"}
    assert hits[0]["model_version"] == "v2" and hits[0]["caption"] is None  # its rows name no real shard
    result = CliRunner().invoke(app, ["rollout", "status", "--json", "--workspace", str(ws)])
    assert json.loads(result.output)["state"] == "completed"
    refused = CliRunner().invoke(app, ["search", "  ", "--workspace", str(ws)])
    assert refused.exit_code == 2 and "empty query text" in refused.output

    from components.rollout.production_rollback import on_rollback
    from components.status import gallery_part

    doc = gallery_part(ws)
    assert doc["gallery"]["count"] == N == sum(doc["gallery"]["by_version"].values())
    assert doc["rollout"]["fraction_backfilled"] == 1.0 and doc["rollout"]["state"] == "completed"
    with pytest.raises(ro.RolloutError, match="no completed rollout of version 7"):
        on_rollback({"workspace": ws, "from_version": "7"})
    on_rollback({"workspace": ws, "from_version": "v2"})
    assert gallery_part(ws)["gallery"]["by_version"] == {"v1": N}


def _run_args(ws: Path, *where: str) -> list[str]:
    """``rollout run`` of v2 with the known-geometry encoders on workspace ``ws`` (``where``: its flags)."""
    return [
        "rollout",
        "run",
        *where,
        "--new-version",
        "v2",
        "--encoders",
        f"{SYNTH_MODULE}:synthetic_encoders",
        "--query-factory",
        SYNTH_QUERY,
        "--probe",
        str(ws / "probe.json"),
        *[f"--option={k}={v}" for k, v in OPTS.items()],
    ]


def _cli(ws: Path, *extra: str) -> list[str]:
    cli = [sys.executable, "-m", "pipelines.cli"]
    return [*cli, *_run_args(ws, "--workspace", str(ws)), "--batch-size", "16", "--order", "random", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", *SERVER_BACKENDS])
def test_kill_9_mid_stage_then_resume(tmp_path, backend, request) -> None:
    """SIGKILL a real rollout process mid-stage; a rerun completes with one v2 vector per item."""
    ws = tmp_path / "ws"
    paths = ro.RolloutPaths.for_workspace(ws)
    if backend in SERVER_BACKENDS:
        uri, alias = server_uri(request, backend), f"g{uuid.uuid4().hex[:10]}"
    else:
        uri, alias = str(ws / "milvus" / "gallery.db"), "gallery"
    with GalleryIndex(uri, alias) as index:
        _index_old(paths, index)
    (ws / "probe.json").write_text(json.dumps(PROBE.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        _cli(ws, "--option=delay_s=0.08"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    killed_at = None
    deadline = time.monotonic() + 120
    while killed_at is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            state = json.loads(paths.state.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            state = None
        if state and state["stage"] == 3:
            lo, hi = state["stages"][2]["target_position"], state["stages"][3]["target_position"]
            if lo < state["cursor"]["position"] < hi:
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = state["cursor"]["position"]
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert killed_at is not None, (
        f"the rollout was not caught mid-stage: {proc.stdout.read().decode()[-2000:]}"
    )
    assert proc.returncode == -signal.SIGKILL
    state = json.loads(paths.state.read_text())
    assert state["state"] == "running" and state["stage"] == 3
    with GalleryIndex(uri, alias) as index:  # mid-stage: a mixed gallery, nothing lost
        assert index.count() == N and set(index.count_by_version()) == {"v1", "v2"}

    rerun = subprocess.run(_cli(ws, "--json"), env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    final = json.loads(rerun.stdout)
    assert final["state"] == "completed" and final["rollout_id"] == state["rollout_id"]
    assert [p["fraction"] for p in final["curve"]] == [0.0, 0.1, 0.25, 0.5, 1.0]
    with GalleryIndex(uri, alias) as index:
        _assert_gallery(index, UPGRADE.new_gallery, "v2")


@pytest.mark.slow
def test_cli_with_real_models_end_to_end(tmp_path) -> None:
    """index -> run -> search -> rollback through the CLI with a real cf-tiny checkpoint and real shards.

    The new model has the old one's weights (no trained models ship with the repository): every probe
    equals its floor, so the rollout completes and each stage exercises the real encoders end to end.
    """
    from typer.testing import CliRunner

    from compat.data.shards import write_shard
    from compat.data.synth import make_sample
    from compat.models import build_model, save_checkpoint
    from pipelines.cli import app

    shard = tmp_path / "gallery-000.tar"
    write_shard(shard, (make_sample(0, 0, "gallery", i, 64) for i in range(96)))
    ckpt = tmp_path / "model"
    save_checkpoint(build_model("cf-tiny", seed=0), ckpt, version="v1")
    ws = tmp_path / "ws"
    run = CliRunner().invoke
    common = ["--workspace", str(ws)]
    result = run(
        app,
        [
            "rollout",
            "index",
            "--model",
            str(ckpt),
            "--version",
            "v1",
            "--space",
            "tiny",
            "--gallery",
            str(shard),
            "--probe-size",
            "48",
            *common,
        ],
    )
    assert result.exit_code == 0, result.output
    result = run(
        app,
        [
            "rollout",
            "run",
            "--new-version",
            "v2",
            "--new-model",
            str(ckpt),
            "--batch-size",
            "32",
            "--json",
            *common,
        ],
    )
    assert result.exit_code == 0, result.output
    state = json.loads(result.output[result.output.index("{") :])
    assert state["state"] == "completed" and state["query_model"]["uri"] == str(ckpt)
    probe = json.loads((ws / "rollout" / "probe.json").read_text())
    with GalleryIndex(str(ws / "milvus" / "gallery.db")) as index:
        assert index.count_by_version() == {"v2": 96}
        key = probe["positives"][0][0]
        row = index.fetch([key])[0]
        assert row["source_uri"] == f"{shard}#{key}" and row["rollout_id"] == state["rollout_id"]
    result = run(app, ["search", probe["texts"][0], "-k", "3", "--json", *common])
    assert result.exit_code == 0, result.output
    hits = json.loads(result.output[result.output.index("[") :])
    assert len(hits) == 3 and {h["model_version"] for h in hits} == {"v2"}
    result = run(app, ["rollout", "rollback", *common])
    assert result.exit_code == 0, result.output
    with GalleryIndex(str(ws / "milvus" / "gallery.db")) as index:
        assert index.count_by_version() == {"v1": 96}


def test_cli_rollout_takes_its_settings_from_the_config(setup, tmp_path) -> None:
    """`rollout run --config` plans with the config's rollout section; a flag overrides one setting."""
    import yaml
    from typer.testing import CliRunner

    from pipelines.cli import app

    paths, index = setup
    index.close()
    ws = paths.state.parent
    config = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "pipelines/configs/local.yaml").read_text()
    )
    config["workspace"] = str(ws)
    config["rollout"].update(order="oldest_first", fractions=[0.5, 1.0], batch_size=32)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    (ws / "probe.json").write_text(json.dumps(PROBE.to_dict()))
    result = CliRunner().invoke(app, [*_run_args(ws, "--config", str(path)), "--json", "--batch-size", "64"])
    assert result.exit_code == 0, result.output
    state = json.loads(result.output)
    assert state["order"]["policy"] == "oldest_first"
    assert [p["fraction"] for p in state["curve"]] == [0.0, 0.5, 1.0]
    assert state["batch_size"] == 64  # the flag overrode the config's 32


# ------------------------------------------------------------------------------------------------- pacing
class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_pace_caps_the_rate() -> None:
    from components.rollout.pacing import Pace

    clock = _FakeClock()
    pace = Pace(max_items_per_s=100, clock=clock, sleep=clock.sleep)
    pace.begin()
    for _ in range(4):
        clock.now += 0.1  # a batch of 50 items takes 0.1 s; the cap allows 50 items per 0.5 s
        pace.after_batch(50)
    assert clock.now == pytest.approx(2.0) and pace.slept_s == pytest.approx(1.6)
    assert pace.to_dict()["items_per_s_allowed"] == 100


def test_pace_halves_when_queries_slow_down_and_recovers_when_they_are_quiet() -> None:
    from components.rollout.pacing import (
        FLOOR_SHARE,
        GROWTH,
        MIN_SAMPLES,
        SAMPLE_INTERVAL_S,
        Pace,
        SearchLatency,
    )

    clock = _FakeClock()
    latency = {"ms": 30.0}
    pace = Pace(p99_factor=1.5, clock=clock, sleep=clock.sleep)
    idle = iter([10.0] * 30)
    source = SearchLatency(lambda: next(idle, latency["ms"]))
    assert pace.watch([source]) is source and pace.idle_p99_ms == pytest.approx(10.0)
    pace.begin()
    for _ in range(MIN_SAMPLES):  # 100 items/s unpaced, queries at 3x idle
        clock.now += 1.0
        pace.after_batch(100)
    assert pace.slowdowns == 1 and pace.rate == pytest.approx(50.0) and pace.last_p99_ms == 30.0
    for _ in range(40 * MIN_SAMPLES):  # still slow: halves again and again, down to the floor only
        clock.now += SAMPLE_INTERVAL_S
        pace.after_batch(10)
    assert pace.rate == pytest.approx(FLOOR_SHARE * 100.0)
    slow = pace.rate
    latency["ms"] = 5.0
    for _ in range(MIN_SAMPLES):  # quiet again: the rate grows
        pace.after_batch(10)
    assert pace.rate == pytest.approx(slow * GROWTH)
    assert pace.to_dict()["latency_from"] == "searches"
    with pytest.raises(ValueError, match="p99_factor must be above 1"):
        Pace(p99_factor=0.5)


def test_resumed_pace_keeps_its_idle_p99_only_for_the_same_source() -> None:
    from components.rollout.pacing import Pace, SearchLatency

    calls = {"n": 0}

    def timed() -> float:
        calls["n"] += 1
        return 4.0

    recorded = {"idle_p99_ms": 9.0, "latency_from": "searches"}
    pace = Pace.resumed(recorded, 1.5, None)
    pace.watch([SearchLatency(timed)])
    assert pace.idle_p99_ms == 9.0 and calls["n"] == 0  # the idle p99 measured before the crash
    pace = Pace.resumed({**recorded, "latency_from": "service"}, 1.5, None)
    pace.watch([SearchLatency(timed)])
    assert pace.idle_p99_ms == pytest.approx(4.0) and calls["n"] == 30  # another source: measured again


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    from components.rollout.pacing import histogram_quantile

    inf = float("inf")
    # 100 observations: 50 up to 5 ms, 40 in (5, 10], 10 in (10, 20]: p99 is 90 % of the way into (10, 20]
    assert histogram_quantile(0.99, [5.0, 10.0, 20.0, inf], [50, 90, 100, 100]) == pytest.approx(19.0)
    assert histogram_quantile(0.5, [5.0, 10.0, 20.0, inf], [50, 90, 100, 100]) == pytest.approx(5.0)
    assert histogram_quantile(0.99, [5.0, 10.0, inf], [10, 10, 20]) == 10.0  # in +Inf: the highest bound
    assert histogram_quantile(0.99, [5.0, inf], [0, 0]) is None


def test_rollout_records_its_pace_and_holds_the_cap(setup, monkeypatch) -> None:
    """A real rollout measures the idle p99, times a query per batch and keeps to max_items_per_s; paced, it
    writes in small upserts and flushes often (no single write holds users' queries for long)."""
    from components.rollout.writes import PACED_FLUSH_ROWS, PACED_UPSERT_ROWS

    paths, index = setup
    calls = _Recorder(index, monkeypatch)
    cap = 150.0  # N items take ~2.7 s: about ten latency samples (one per SAMPLE_INTERVAL_S)
    t0 = time.perf_counter()
    state = ro.run_rollout(
        index,
        paths,
        _config(fractions=(0.5, 1.0), batch_size=50, slo_p99_factor=1.5, max_items_per_s=cap),
        synthetic_encoders({"options": OPTS}),
        PROBE,
    )
    elapsed = time.perf_counter() - t0
    assert state["state"] == "completed"
    pace = state["pace"]
    assert pace["idle_p99_ms"] > 0 and pace["last_p99_ms"] is not None and pace["max_items_per_s"] == cap
    assert pace["latency_from"] == "searches"  # no service announced in this workspace
    assert elapsed >= N / cap * 0.9  # every item paced: N items at the cap take N / cap seconds
    assert all(s["items_per_s"] <= cap * 1.05 for s in state["stages"] if "items_per_s" in s)
    assert (
        calls.rows("upsert") == N and max(n for op, n in calls.calls if op == "upsert") == PACED_UPSERT_ROWS
    )
    assert calls.most_unflushed() <= PACED_FLUSH_ROWS + 50
    schemas.validate(json.loads(paths.state.read_text()), "rollout_state", "state")
    from typer.testing import CliRunner

    from pipelines.cli import app

    shown = CliRunner().invoke(app, ["rollout", "status", "--workspace", str(paths.state.parent)])
    assert shown.exit_code == 0 and "paced on searches" in shown.output, shown.output


class _Recorder:
    """Wraps a GalleryIndex's writes and reads: what a rollout asks of Milvus, in order."""

    def __init__(self, index: GalleryIndex, monkeypatch) -> None:
        self.calls: list[tuple[str, int]] = []
        for name in ("upsert", "flush", "fetch"):
            real = getattr(index, name)

            def record(*args, _name=name, _real=real, **kw):
                rows = len(args[0]) if _name in ("upsert", "fetch") else 0
                self.calls.append((_name, rows))
                return _real(*args, **kw)

            monkeypatch.setattr(index, name, record)

    def rows(self, name: str) -> int:
        return sum(n for op, n in self.calls if op == name)

    def most_unflushed(self) -> int:
        most = run = 0
        for op, n in self.calls:
            run = 0 if op == "flush" else run + (n if op == "upsert" else 0)
            most = max(most, run)
        return most


def test_in_place_batches_save_what_they_replace_and_flushes_bound_unflushed_rows(setup, monkeypatch) -> None:
    """An in-place rollout reads each row once, by its batch, just before overwriting it (saved for restore
    first: the plan reads no vector), and never leaves more than ``flush_rows`` (+ one batch) unflushed; its
    rollback restores the old gallery."""
    paths, index = setup
    calls = _Recorder(index, monkeypatch)
    state = ro.run_rollout(
        index,
        paths,
        _config(fractions=(0.5, 1.0), flush_rows=64),
        synthetic_encoders({"options": OPTS}),
        PROBE,
    )
    assert state["state"] == "completed"
    assert calls.rows("fetch") == N and calls.rows("upsert") == N
    assert 64 <= calls.most_unflushed() < 64 + 32
    files = list(saved_batches(paths.restore_dir(state["rollout_id"]), stage_batches(state)))
    assert len(files) == 2 * 7  # two stages of 200 items in batches of 32
    saved = [r["item_id"] for f in files for r in load_rows(f)]
    assert sorted(saved) == sorted(UPGRADE.item_ids)
    _assert_gallery(index, UPGRADE.new_gallery, "v2")
    ro.rollback(paths, index)
    _assert_gallery(index, UPGRADE.old_gallery, "v1")


def test_rollback_replays_only_the_batches_that_ran(setup, monkeypatch) -> None:
    """After a failure at the cursor, the rollback writes back the batches up to the cursor (the one in
    flight included), not the whole saved order, and the gallery is the old one again."""
    paths, index = setup
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(prefetch=1), _failing_encoders(4), PROBE)
    position = json.loads(paths.state.read_text())["cursor"]["position"]
    assert 0 < position < N
    writes = _Recorder(index, monkeypatch)
    state = ro.rollback(paths, index)
    assert state["state"] == "rolled_back"
    assert position <= writes.rows("upsert") <= position + 32
    _assert_gallery(index, UPGRADE.old_gallery, "v1")


def test_rollback_replay_keeps_the_rollouts_pace(setup, monkeypatch) -> None:
    """The replay of saved rows runs at the rate cap its rollout recorded, and flushes as it goes."""
    paths, index = setup
    cap = 2000.0
    state = ro.run_rollout(
        index,
        paths,
        _config(max_items_per_s=cap, flush_rows=100),
        synthetic_encoders({"options": OPTS}),
        PROBE,
    )
    assert state["pace"]["max_items_per_s"] == cap
    writes = _Recorder(index, monkeypatch)
    t0 = time.perf_counter()
    state = ro.rollback(paths, index)
    assert time.perf_counter() - t0 >= 0.9 * N / cap
    assert state["rollback"]["pace"]["max_items_per_s"] == cap
    assert writes.rows("upsert") == N and writes.most_unflushed() <= DEFAULT_FLUSH_ROWS
    _assert_gallery(index, UPGRADE.old_gallery, "v1")
