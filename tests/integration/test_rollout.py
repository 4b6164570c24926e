"""The rollout engine on real milvus-lite: staged backfill, halts, blue-green, crashes, kill -9, search."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from _rollouts import (
    OPTS,
    PROBE,
    SYNTH_QUERY,
    UPGRADE,
    N,
    _assert_gallery,
    _index_old,
    _run_args,
)

import schemas
from benchmarks.synthetic_upgrade import synthetic_encoders
from components import rollout as ro
from components.adapters.index import GalleryIndex
from components.deployment import RolloutSection
from components.rollout import engine, read_serving
from components.rollout.plan import probe_margin
from components.serving.search import Searcher


def _config(**kw) -> ro.RolloutConfig:
    kw.setdefault("batch_size", 32)
    kw.setdefault("order", "random")
    return ro.RolloutConfig.from_section(
        RolloutSection(),
        new_version="v2",
        query_model={"factory": SYNTH_QUERY, "options": OPTS, "side": "new"},
        **kw,
    )


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
    ).document()
    schemas.validate(json.loads(paths.state.read_text()), "rollout_state", str(paths.state))
    assert state["status"] == "completed" and state["fraction_backfilled"] == 1.0
    assert [s["status"] for s in state["stages"]] == ["accepted"] * 5
    assert [p["fraction"] for p in state["curve"]] == [0.0, 0.1, 0.25, 0.5, 1.0]
    for stage in state["stages"]:
        assert all(stage["probe"][m] >= state["floors"][m] for m in state["floors"])
    assert state["curve"][-1]["t2i_R@1"] > state["curve"][0]["t2i_R@1"] > state["baseline"]["R@1"]
    target = index.serving_collection()
    assert (
        target == state["gallery"]["collection"] != source
    )  # its own collection, behind the alias at the end
    _assert_gallery(index, UPGRADE.new_gallery, "v2")
    _assert_gallery(index, UPGRADE.old_gallery, "v1", source)  # never written: the rollback's way back
    assert (
        state["plan_seconds"] < 5 and state["order"]["sample"] == N
    )  # a sample (here the whole small gallery)
    record = read_serving(paths.serving)
    assert record.query_model.side == "new" and record.query_model.version == "v2"
    summary = ro.status(paths.state)
    assert (summary["status"], summary["stage"], summary["fraction_backfilled"]) == ("completed", 4, 1.0)
    # lineage: new rows carry the rollout id, old rows' source uri is kept
    row = index.fetch(["item-00007"])[0]
    assert row["rollout_id"] == state["rollout_id"] and row["source_uri"] == "shard#item-00007"
    # a rerun of the completed rollout is a no-op
    assert (
        ro.run_rollout(
            index, paths, _config(order="lambda_orth"), synthetic_encoders({"options": OPTS}), PROBE
        ).document()["status"]
        == "completed"
    )

    back = ro.rollback(paths, index).document()
    assert back["status"] == "rolled_back" and back["query_model"]["side"] == "old"
    assert back["rollback"]["seconds"] < 5 and index.serving_collection() == source  # a switch
    _assert_gallery(index, UPGRADE.old_gallery, "v1")
    assert read_serving(paths.serving).query_model.version == "v1"
    assert ro.rollback(paths, index).document()["status"] == "rolled_back"  # idempotent


def test_regression_halts_and_restores_the_stage(setup) -> None:
    paths, index = setup
    broken = synthetic_encoders({"options": {**OPTS, "broken": "1"}})
    state = ro.run_rollout(index, paths, _config(), broken, PROBE).document()
    assert state["status"] == "halted" and state["restored"]
    assert state["stages"][0]["status"] == "accepted" and state["stages"][1]["status"] == "halted"
    probe, floors = state["stages"][1]["probe"], state["floors"]
    broken_metrics = [m for m in floors if probe[m] < floors[m]]
    assert broken_metrics and all(m in state["halt_reason"] for m in broken_metrics)
    assert state["fraction_backfilled"] == 0.0
    record = read_serving(paths.serving)  # a switch back to the source, which no stage wrote
    assert record.collection == state["gallery"]["source_collection"] and record.layers is None
    assert record.query_model.version == "v1"
    assert not index.has_collection(state["gallery"]["collection"])
    _assert_gallery(index, UPGRADE.old_gallery, "v1")
    # fail closed: running the same configuration again does not retry the regression
    assert ro.run_rollout(index, paths, _config(), broken, PROBE).document()["status"] == "halted"
    assert index.count_by_version() == {"v1": N}


def test_stage0_floor_blocks_the_query_switch(setup) -> None:
    paths, index = setup
    state = ro.run_rollout(
        index, paths, _config(floors={"R@1": 99.0}), synthetic_encoders({"options": OPTS}), PROBE
    ).document()
    assert state["status"] == "halted" and state["stage"] == 0
    assert state["floors"]["R@1"] == 99.0  # configured above old/old; R@5's floor: old/old less one SE
    n = len(PROBE.texts)
    assert state["floors"]["R@5"] == pytest.approx(
        state["baseline"]["R@5"] - probe_margin(state["baseline"]["R@5"], n, 1.0)
    )
    assert state["probe_tolerance"] == 1.0
    assert read_serving(paths.serving).query_model.version == "v1"  # queries never switched
    assert index.count_by_version() == {"v1": N}


def test_probe_of_another_gallery_is_refused(setup) -> None:
    paths, index = setup
    stranger = ro.ProbeSet(PROBE.texts[:3], [["not-an-item"]] * 3)
    with pytest.raises(ro.RolloutError, match="another gallery"):
        ro.run_rollout(index, paths, _config(), synthetic_encoders({"options": OPTS}), stranger)
    assert not paths.state.exists()


class _Crash(RuntimeError):
    pass


def test_crash_between_writes_and_state_write_repeats_the_stage_once(setup, monkeypatch) -> None:
    """A stage whose state write failed after its slices were written resumes from the slices' cursors: no
    item is written twice, none is lost."""
    paths, index = setup
    real_save = ro.save_state

    def flaky_save(path, state):
        if state.stage == 2 and state.stages[2].workers is not None and state.status == "running":
            raise _Crash("power cut after the stage's writes")
        real_save(path, state)

    monkeypatch.setattr(engine, "save_state", flaky_save)
    encoders = synthetic_encoders({"options": OPTS})
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(), encoders, PROBE)
    saved = json.loads(paths.state.read_text())
    assert saved["status"] == "running" and saved["stage"] == 2 and saved["cursor"]["ranges"]
    target = saved["gallery"]["collection"]
    written = index.count(target)
    assert 0 < written < N
    monkeypatch.setattr(engine, "save_state", real_save)
    state = ro.run_rollout(index, paths, _config(), encoders, PROBE).document()
    assert state["status"] == "completed"
    _assert_gallery(index, UPGRADE.new_gallery, "v2", target)  # N rows: none doubled
    ro.rollback(paths, index)
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


@pytest.mark.parametrize("order", ["random", "oldest_first", "lambda_orth"])
def test_encoder_failure_resumes_from_the_cursor(setup, order) -> None:
    """A slice encoded ahead of a failure is never written: the target holds whole slices, each once, and
    the served gallery still answers with every item once."""
    paths, index = setup
    good = synthetic_encoders({"options": OPTS})
    bad = _failing_encoders(5)
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(order=order), bad, PROBE)
    saved = json.loads(paths.state.read_text())
    assert saved["status"] == "running" and saved["stage"] >= 1
    target, source = saved["gallery"]["collection"], saved["gallery"]["source_collection"]
    assert index.count_by_version(source) == {"v1": N}  # never written
    written = index.count(target)
    assert index.count_by_version(target) == {"v2": written} and 0 < written < N
    record = read_serving(paths.serving)  # the mixed gallery: every item once, new vectors where written
    hits = index.search(UPGRADE.query_vectors(UPGRADE.query_texts[:5], "new"), k=N, layers=record.layers)
    assert all(len({h.item_id for h in row}) == len(row) for row in hits)
    other = _config(order="random" if order != "random" else "oldest_first")
    with pytest.raises(ro.RolloutError, match="is running"):  # another configuration may not start meanwhile
        ro.run_rollout(index, paths, other, good, PROBE)
    assert ro.run_rollout(index, paths, _config(order=order), good, PROBE).document()["status"] == "completed"
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
    state = ro.run_rollout(index, paths, _config(order="uncertainty"), enc, PROBE).document()
    assert state["status"] == "completed"
    target = index.serving_collection()
    assert target != source and index.collection_dim(target) == 40
    _assert_gallery(index, pad(UPGRADE.new_gallery), "v2", target)
    _assert_gallery(index, UPGRADE.old_gallery, "v1", source)  # untouched, kept for rollback
    ro.rollback(paths, index)
    assert index.serving_collection() == source and read_serving(paths.serving).dim == 32


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
    state = ro.run_rollout(index, paths, _config(), enc, PROBE).document()
    assert state["mode"] == "blue_green" and state["status"] == "completed"
    target = index.serving_collection()
    assert target.endswith("_s2_1") and index.collection_space(target) == "s2"
    _assert_gallery(index, UPGRADE.new_gallery @ rot, "v2", target)
    assert index.count_by_version(source) == {"v1": N}
    assert read_serving(paths.serving).space == "s2"
    ro.rollback(paths, index)
    assert index.serving_collection() == source and read_serving(paths.serving).space == "s1"


def test_search_api_and_cli_serve_the_record(tmp_path) -> None:
    from typer.testing import CliRunner

    from components.serving.search import search
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
        assert server.pair.version == "v1"
        live = server.search([text], 5)[0]
        assert server.pair.version == "v2"
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
    assert json.loads(result.output)["status"] == "completed"
    refused = CliRunner().invoke(app, ["search", "  ", "--workspace", str(ws)])
    assert refused.exit_code == 2 and "empty query text" in refused.output

    from components.rollout.production_rollback import on_rollback
    from pipelines.status import gallery_part

    doc = gallery_part(ws)
    assert doc["gallery"]["count"] == N == sum(doc["gallery"]["by_version"].values())
    assert doc["rollout"]["fraction_backfilled"] == 1.0 and doc["rollout"]["status"] == "completed"
    with pytest.raises(ro.RolloutError, match="no completed rollout of version 7"):
        on_rollback({"workspace": ws, "from_version": "7"})
    on_rollback({"workspace": ws, "from_version": "v2"})
    assert gallery_part(ws)["gallery"]["by_version"] == {"v1": N}


def test_cli_rollout_takes_its_settings_from_the_config(setup, tmp_path) -> None:
    """`rollout run --config` plans with the config's rollout section; a flag overrides one setting."""
    import yaml
    from typer.testing import CliRunner

    from pipelines.cli import app

    paths, index = setup
    index.close()
    ws = paths.state.parent
    config = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "pipelines/configs/local.yaml").read_text()
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
    ).document()
    elapsed = time.perf_counter() - t0
    assert state["status"] == "completed"
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


def test_a_rollout_reads_a_sample_and_its_slices_and_bounds_unflushed_rows(setup, monkeypatch) -> None:
    """No read by id and no whole read: the plan reads a sample, each stage its slices (every item once in
    all), written into the target never more than ``flush_rows`` (+ one slice) unflushed; no upsert but the
    sweep's."""
    paths, index = setup
    calls = _Recorder(index, monkeypatch)
    reads: list[str] = []
    real_iter = index.iter_rows

    def iter_rows(fields, collection=None, filter="", **kw):
        reads.append(filter)
        for page in real_iter(fields, collection, filter, **kw):
            calls.calls.append(("read", len(page)))
            yield page

    monkeypatch.setattr(index, "iter_rows", iter_rows)
    state = ro.run_rollout(
        index,
        paths,
        _config(fractions=(0.5, 1.0), flush_rows=64),
        synthetic_encoders({"options": OPTS}),
        PROBE,
    ).document()
    assert state["status"] == "completed"
    assert calls.rows("fetch") == 0 and calls.rows("upsert") == N
    assert all(f for f in reads)  # every read is a filter: the sample's, then one per slice
    # the sample twice (the plan's keys, then the vectors the target's centres are fitted on; the whole
    # gallery, being small) and the slices once
    assert calls.rows("read") == 3 * N
    assert 64 <= calls.most_unflushed() < 64 + 2 * 32
    _assert_gallery(index, UPGRADE.new_gallery, "v2")


def test_rollback_of_an_unfinished_rollout_is_a_switch(setup, monkeypatch) -> None:
    """After a failure mid-stage the rollback writes no row: the record and alias go back to the source."""
    paths, index = setup
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(), _failing_encoders(4), PROBE)
    writes = _Recorder(index, monkeypatch)
    state = ro.rollback(paths, index).document()
    assert state["status"] == "rolled_back" and state["rollback"]["from_status"] == "running"
    assert writes.rows("upsert") == 0 and writes.rows("fetch") == 0
    assert read_serving(paths.serving).layers is None
    _assert_gallery(index, UPGRADE.old_gallery, "v1")


def test_a_crash_between_the_index_write_and_the_lineage_write_is_repaired_by_the_resume(
    setup, monkeypatch
) -> None:
    """The writers record each slice's lineage after its vectors: killed between the two, the slice is not
    in its cursor, so the resumed rollout writes both again and the lineage agrees with every served row."""
    from components.adapters.lineage import LineageStore, index_rows

    paths, index = setup
    store = LineageStore(paths.lineage)
    store.apply()
    real, calls = LineageStore.sync_with_index, {"n": 0}

    def dies_once(self, rows, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash("killed after the index write, before the lineage write")
        return real(self, rows, **kw)

    monkeypatch.setattr(LineageStore, "sync_with_index", dies_once)
    encoders = synthetic_encoders({"options": OPTS})
    with pytest.raises(_Crash):
        ro.run_rollout(index, paths, _config(), encoders, PROBE)
    target = json.loads(paths.state.read_text())["gallery"]["collection"]
    assert not store.check_against_index(index_rows(index, collection=target))["agree"]
    state = ro.run_rollout(index, paths, _config(), encoders, PROBE).document()
    assert state["status"] == "completed"
    check = store.check_against_index(index_rows(index))
    assert check["agree"] and check["index"] == {"v2": N}, check
