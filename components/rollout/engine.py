"""The rollout engine: the rollout's state machine (plan, stage 0, backfill stages or a blue-green fill,
resume), so that every transition of the state file reads in one place."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from compat.io import utc_now
from components.adapters.index import ROW_FIELDS, GalleryIndex, is_remote
from components.adapters.services import live_services
from components.rollout import workers
from components.rollout.keys import Selection, fit_centres, load_centres, plan_selection, save_centres
from components.rollout.pacing import Pace, latency_sources
from components.rollout.plan import (
    Source,
    check_probe_covers,
    check_vectors,
    probe_floors,
    read_sample,
    serving_source,
    stage_plan,
)
from components.rollout.probes import broken_floors, probe_metrics
from components.rollout.rollback import serve_source
from components.rollout.state import exclusive, load_state, save_state
from components.rollout.types import (
    ProbeSet,
    RangesPending,
    RolloutConfig,
    RolloutEncoders,
    RolloutError,
    RolloutPaths,
    item_ref,
)
from components.rollout.writes import GalleryWriter, new_rows, rows_of_other_versions
from components.serving.record import read_serving, write_serving
from components.state.rollout_document import SCHEMA_VERSION, CurvePoint, RolloutState, StageRecord

log = logging.getLogger(__name__)

Layers = list[tuple[str, str]]
# what a stage's record keeps of each range's cursor
WORKER_FIELDS = ("written", "seconds", "items_per_s", "cpu_seconds", "peak_rss_mib", "pace")


class Rollout:
    """A rollout of one configuration (see :mod:`components.rollout`); :meth:`run` plans it, or resumes it
    from its state file. From stage 0 on the target serves as the newest of two layers: the target whole,
    over the source less the items of the stages accepted so far."""

    def __init__(
        self,
        index: GalleryIndex,
        paths: RolloutPaths,
        config: RolloutConfig,
        encoders: RolloutEncoders,
        probe: ProbeSet,
    ) -> None:
        self.index, self.paths, self.config, self.encoders, self.probe = index, paths, config, encoders, probe
        self.space = config.space or encoders.space
        self.adapt = encoders.gallery_transform is not None
        if self.adapt and not encoders.transform_tag:
            raise ValueError("a gallery_transform needs a transform_tag naming it (recorded in row lineage)")
        self._queries: np.ndarray | None = None
        self.pace = Pace(config.slo_p99_factor, config.max_items_per_s)
        self._pool: workers.WorkerPool | None = None

    @property
    def rollout_id(self) -> str:
        c = self.config
        key = {
            "new_version": c.new_version,
            "query_model": c.query_model.get("version"),
            "space": self.space,
            "policy": c.order,
            "seed": c.seed,
            "fractions": list(c.fractions),
            "batch_size": c.batch_size,
            "transform": self.encoders.transform_tag,
            "n_clusters": c.n_clusters,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]

    # ---- entry point
    def run(self) -> RolloutState:
        """Plan or resume, then run to ``completed`` or ``halted``; returns the final state. With
        ``config.range_tasks`` it returns earlier, state ``running``, when a stage's slice ranges wait for
        their pipeline tasks (``cursor.ranges``; :func:`components.rollout.workers.pending_ranges`)."""
        with exclusive(self.paths.state):
            state = load_state(self.paths.state)
            if state is None or state.rollout_id != self.rollout_id:
                if state is not None:
                    self._replace(state)
                self.pace = Pace(self.config.slo_p99_factor, self.config.max_items_per_s)
                self._measure_idle()
                state = self._plan()
            else:
                if state.order.cuts is None:
                    raise RolloutError(
                        f"rollout {state.rollout_id} at {self.paths.state} was planned by an earlier "
                        "release (it wrote the gallery in place): finish or roll it back with that release"
                    )
                recorded = state.pace.document() if state.pace else None
                self.pace = Pace.resumed(recorded, self.config.slo_p99_factor, self.config.max_items_per_s)
            try:
                while state.status == "running":
                    if state.stage == 0:
                        self._stage0(state)
                    else:
                        self._stage(state, state.stage)
            except RangesPending as pending:
                log.info("rollout %s: %s", state.rollout_id, pending)
            finally:
                if self._pool is not None:
                    self._pool.close()
                    self._pool = None
            return state

    def _measure_idle(self) -> None:
        """The idle query p99 the SLO is a multiple of, measured before the rollout touches anything
        (:func:`components.rollout.pacing.latency_sources`)."""
        serving = self.index.serving_collection()
        if self.config.slo_p99_factor is None or serving is None or not self.probe.texts:
            return
        query, services = self._latency_query(serving), live_services(self.paths.services)
        self.pace.watch(latency_sources(self.index, serving, query, services))
        self.pace.latency = None

    def _latency_query(self, collection: str) -> np.ndarray:
        """A query of the serving space (the old query model's first probe text): what timed searches ask."""
        dim = self.index.collection_dim(collection)
        return check_vectors(self.encoders.old_query(self.probe.texts[:1]), 1, dim, "old_query")[0]

    def _save(self, state: RolloutState) -> None:
        save_state(self.paths.state, state)

    def _replace(self, old: RolloutState) -> None:
        """Archive the finished rollout ``old`` before a new one is planned; the target of one that was rolled
        back or halted is dropped (nothing serves it)."""
        if old.status in ("pending", "running"):
            raise RolloutError(
                f"rollout {old.rollout_id} ({old.new_version}) is {old.status} at "
                f"{self.paths.state}: run it to the end with its own configuration, or roll it back"
            )
        g = old.gallery
        if old.status in ("rolled_back", "halted") and g.collection != g.source_collection:
            self._drop_unserved(g.collection)
        save_state(self.paths.archived_state(old.rollout_id), old, root=self.paths.root)

    def _drop_unserved(self, collection: str | None) -> None:
        record = read_serving(self.paths.serving)
        served = record.collections() if record else []
        if collection and collection not in served and self.index.has_collection(collection):
            if collection != self.index.serving_collection():
                self.index.drop(collection)
                log.info("dropped collection %s (served by no version)", collection)

    # ---- planning
    def _plan(self) -> RolloutState:
        """Decide the mode, order, floors and stages from the serving collection and a bounded sample of it
        (:func:`components.rollout.plan.read_sample`): nothing reads the whole gallery."""
        c, idx = self.config, self.index
        t0 = time.perf_counter()
        source = serving_source(idx, read_serving(self.paths.serving), self.paths.serving)
        space = self.space or source.space
        keyed = idx.has_order_keys(source.collection)
        mode = self._mode(source, space, keyed)
        check_probe_covers(self.probe, idx, source.collection)
        n = idx.count(source.collection)
        if n == 0:
            raise RolloutError(f"collection {source.collection!r} is empty: nothing to roll out")
        sample = read_sample(idx, source.collection, n, vectors=self.adapt)
        selection = (
            plan_selection(c.order, c.fractions, c.seed, sample) if keyed else Selection(c.order, c.fractions)
        )
        rid = self.rollout_id
        target = idx.next_collection_name(space)
        old_queries = check_vectors(
            self.encoders.old_query(self.probe.texts), len(self.probe.texts), source.dim, "old_query"
        )
        baseline, floors = probe_floors(idx, source, old_queries, self.probe, c)
        state = RolloutState(
            schema_version=SCHEMA_VERSION,
            rollout_id=rid,
            status="running",
            mode=mode,
            created_at=utc_now(),
            new_version=c.new_version,
            stage=1 if mode == "blue_green" else 0,
            fractions=c.fractions,
            n_items=n,
            fraction_backfilled=0.0,
            batch_size=c.batch_size,
            workers=c.workers,
            order={
                "policy": c.order,
                "seed": c.seed,
                **selection.to_record(),
                "n_clusters": c.n_clusters,
                "centres": str(self.paths.centres(target)),
                "sample": len(sample),
            },
            cursor={"position": 0, "batches": 0, "ranges": None},
            query_model=source.record.query_model.document(),
            previous_query_model=source.record.query_model.document(),
            new_query_model=c.query_model,
            gallery=self._gallery_record(source, target, space, keyed, sample),
            ks=c.ks,
            baseline=baseline,
            floors=floors,
            probe_tolerance=c.probe_tolerance,
            stages=stage_plan(mode, n, c.fractions),
            curve=[],
            restored=True,
            halt_reason=None,
            rollback=None,
            plan_seconds=round(time.perf_counter() - t0, 3),
            pace=self.pace.to_dict(),  # the idle p99 measured before this plan read anything
        )
        self._save(state)
        log.info(
            f"rollout {rid} planned in {state.plan_seconds:.1f} s: {mode}, {n} items, order {c.order} "
            f"(sample of {len(sample)}), floors {floors}"
        )
        return state

    def _mode(self, source: Source, space: str, keyed: bool) -> str:
        """``staged``; or ``blue_green`` (the target filled whole before it serves) for a space change or a
        source without per-row keys."""
        if self.adapt or (space == source.space and keyed):
            return "staged"
        if space == source.space:
            log.warning(
                "collection %s predates per-row order keys: this rollout fills a new collection whole "
                "(blue-green, once); later rollouts are staged",
                source.collection,
            )
        return "blue_green"

    def _gallery_record(
        self, source: Source, target: str, space: str, keyed: bool, sample: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The state's ``gallery``: the source, the target and its vectors' size (a transform's output)."""
        dim, previous = source.dim, source.record.previous  # previous: production's rollback target
        if self.adapt:
            dim = int(np.asarray(self.encoders.gallery_transform(np.asarray([sample[0]["vector"]]))).shape[1])
        return {
            "uri": self.index.uri,
            "alias": self.index.alias,
            "source_collection": source.collection,
            "source_space": source.space,
            "collection": target,
            "space": space,
            "dim": dim,
            "keyed": keyed,
            "transform": self.encoders.transform_tag,
            "versions_before": self.index.count_by_version(source.collection),
            "source_previous": previous and previous.model_dump(exclude_unset=True),
        }

    # ---- shared pieces
    def _layers(self, state: RolloutState, j: int) -> Layers:
        """What serves once stage ``j`` is accepted: the target whole, over the source less stages 1..j (the
        target alone once it holds every item: a transformed copy, a fill, the last stage)."""
        g = state.gallery
        if self.adapt or state.mode == "blue_green" or state.stage_record(j) is state.stages[-1]:
            return [(g.collection, "")]
        done = Selection.of(state.order.document(), state.fractions).upto(j)
        return [(g.collection, ""), (g.source_collection, f"not ({done})" if j else "")]

    def _probe(self, state: RolloutState, layers: Layers) -> dict[str, float]:
        if self._queries is None:  # the serving queries of the probe texts, encoded once
            made, n = self.encoders.serving_queries(self.probe.texts), len(self.probe.texts)
            self._queries = check_vectors(made, n, state.gallery.dim, "new query encoder")
        return probe_metrics(self.index, layers[0][0], self._queries, self.probe, state.ks, layers=layers)

    def _curve_point(self, state: RolloutState, fraction: float, metrics: Mapping[str, float]) -> None:
        point = CurvePoint.model_validate({"fraction": round(float(fraction), 6), "t2i_R@1": metrics["R@1"]})
        kept = [p for p in state.curve if p.fraction != point.fraction]  # the stages keep every k
        state.curve = sorted([*kept, point], key=lambda p: p.fraction)

    def _ensure_target(self, state: RolloutState) -> None:
        """The rollout's own collection, created at its first stage (a fill in another space is as wide as the
        gallery encoder's vector of one item), and the centres its rows are keyed against, fitted on the
        plan's sample of the source as the serving contract reads it (a fill in another space has none)."""
        g = state.gallery
        if self.index.has_collection(g.collection):
            return
        if state.mode == "staged":
            sample = read_sample(self.index, g.source_collection, state.n_items, vectors=True)
            vectors = np.asarray([r["vector"] for r in sample], dtype=np.float32)
            if self.adapt:
                vectors = np.asarray(self.encoders.gallery_transform(vectors), dtype=np.float32)
            c = self.config
            save_centres(Path(state.order.centres), fit_centres(vectors, c.n_clusters, c.seed))
        else:
            first = self.index.rows_where('item_id != ""', ROW_FIELDS, g.source_collection, limit=1)
            made = self.encoders.new_gallery([item_ref(r) for r in first])
            g.dim = check_vectors(made, 1, None, "gallery encoder").shape[1]
        self.index.create_collection(g.space, g.dim, name=g.collection)
        self._save(state)

    def _run_stage(self, state: RolloutState, j: int, *, whole: bool, action: str) -> None:
        """Write stage ``j``'s slices (``whole``: every item of the source) into the target, in
        ``config.workers`` slice ranges (:mod:`components.rollout.workers`); returns once every range is
        written, or raises :class:`RangesPending` when pipeline tasks run them."""
        c, g = self.config, state.gallery
        fractions = [0.0, *state.fractions]
        share = 1.0 if whole else fractions[j] - fractions[j - 1]
        n = workers.n_slices(share * state.n_items, c.batch_size)
        ranges = workers.split_ranges(n, c.workers)
        if c.workers > 1 and not c.range_tasks:
            self._check_fan_out()
        state.cursor.ranges = ranges
        self._save(state)
        work = self.paths.work(state.rollout_id)
        spec = workers.write_spec(work, self._stage_spec(state, j, n, whole, action, len(ranges)))
        pending = [r for r in ranges if not workers.range_done(work, j, *r)]
        if pending and c.range_tasks:
            raise RangesPending(pending)
        t0 = time.perf_counter()
        if c.workers > 1:
            if self._pool is None:
                self._pool = workers.WorkerPool(c.workers)
            self._pool.run(spec, pending)
            self.index.written_elsewhere(g.collection)  # the probe reads what the workers wrote
        else:
            for start, end in pending:
                workers.run_range(spec, start, end, encoders=self.encoders, index=self.index, pace=self.pace)
            state.pace = self.pace.to_dict()
        done = [workers.read_cursor(workers.range_cursor(work, j, *r), r[0]) for r in ranges]
        written = sum(int(d["written"]) for d in done)
        state.stage_record(j).workers = [
            {"slices": r, **{k: d.get(k) for k in WORKER_FIELDS}} for r, d in zip(ranges, done, strict=True)
        ]
        position, batches = state.cursor.position + written, state.cursor.batches + n
        state.cursor = {"position": position, "batches": batches, "ranges": None}
        state.fraction_backfilled = fractions[j] if action == "reembed" else 0.0
        self._save(state)
        log.info(
            f"rollout {state.rollout_id}: stage {j}, {written} items in {n} slices by {len(ranges)} "
            f"worker(s) ({written / max(time.perf_counter() - t0, 1e-9):.0f} items/s)"
        )

    def _stage_spec(
        self, state: RolloutState, j: int, n: int, whole: bool, action: str, n_ranges: int
    ) -> dict[str, Any]:
        """What every worker of stage ``j`` reads (:func:`components.rollout.workers.write_spec`)."""
        c, g = self.config, state.gallery
        staged = state.mode == "staged"
        return {
            "uri": self.index.uri,
            "alias": self.index.alias,
            "source": g.source_collection,
            "target": g.collection,
            "order": state.order.document(),
            "fractions": state.fractions,
            "stage": j,
            "n_slices": n,
            "whole": whole,
            "keyed": g.keyed,
            "action": action,
            "upsert": self.adapt and action == "reembed",  # over the transformed copy
            "row_stage": j + 1,
            **self._row_spec(state),
            "centres": state.order.centres,
            "encoders": self.encoders.recipe,
            "batch_size": c.batch_size,
            "flush_rows": c.flush_rows,
            "pace": self.pace.to_dict(),
            "workers": n_ranges,
            "services_dir": str(self.paths.services),
            "serving": g.source_collection if staged else None,
            "latency_query": self._latency_query(g.source_collection).tolist() if staged else None,
            "lineage": self.paths.lineage_spec(),
        }

    def _check_fan_out(self) -> None:
        if not is_remote(self.index.uri):
            raise RolloutError(
                f"rollout.workers={self.config.workers} needs the gallery on a server, not the embedded "
                f"milvus-lite directory {self.index.uri} (one process only): set index.uri to a Milvus "
                "server (or `milvus-lite server`), or rollout.workers to 1"
            )
        if self.encoders.recipe is None:
            raise RolloutError(
                "backfill workers need the encoders' recipe (factory and arguments) to build them"
            )

    # ---- stage 0: the query switch (after the transformed copy when the contract needs one)
    def _stage0(self, state: RolloutState) -> None:
        rec = state.stages[0]
        rec.started_at = rec.started_at or utc_now()
        rec.status = "running"
        self._ensure_target(state)
        if self.adapt:
            self._run_stage(state, 0, whole=True, action="transform")
            self.index.flush(state.gallery.collection, wait_indexed=True)
        layers = self._layers(state, 0)
        rec.probe = metrics = self._probe(state, layers)
        self._curve_point(state, 0.0, metrics)
        broken = broken_floors(metrics, state.floors)
        if broken:
            self._halt(state, rec, broken)
            return
        self._serve(state, layers)
        rec.status, rec.finished_at = "accepted", utc_now()
        state.stage = 1
        self._save(state)

    # ---- stages 1..k, or the blue-green fill
    def _stage(self, state: RolloutState, j: int) -> None:
        rec, g = state.stage_record(j), state.gallery
        rec.started_at = rec.started_at or utc_now()
        if rec.status != "running":
            rec.status = "running"
            self._save(state)
        fill = state.mode == "blue_green"
        if fill:
            self._ensure_target(state)
        t0 = time.perf_counter()
        self._run_stage(state, j, whole=fill, action="reembed")
        last = rec is state.stages[-1]
        if last:
            self._sweep(state)
        self.index.flush(g.collection, wait_indexed=last)  # served whole once accepted
        written = sum(w.written or 0 for w in rec.workers or ())
        rec.items_per_s = round(written / max(time.perf_counter() - t0, 1e-9), 1)
        layers = self._layers(state, j)
        metrics = self._probe(state, layers)
        rec.probe, rec.seconds = metrics, round(time.perf_counter() - t0, 3)
        if fill:
            self._curve_point(state, 0.0, state.baseline)
        self._curve_point(state, rec.fraction, metrics)
        broken = broken_floors(metrics, state.floors)
        if broken:
            self._halt(state, rec, broken)
            return
        rec.status, rec.finished_at = "accepted", utc_now()
        if last:
            self._complete(state)
        else:
            self._serve(state, layers)
            state.stage = j + 1
            self._save(state)
        log.info(
            "rollout %s: stage %d (%.0f%%) accepted: %s", state.rollout_id, j, 100 * rec.fraction, metrics
        )

    def _sweep(self, state: RolloutState) -> None:
        """Re-embed the target's rows of another version (items indexed by the serving model while the
        rollout ran), a batch at a time until none is left (each write takes its rows out of the filter)."""
        g = state.gallery
        self.index.flush(g.collection)
        spec = {**self._row_spec(state), "action": "reembed", "row_stage": 0}
        centres = load_centres(state.order.centres)
        writer, swept = GalleryWriter(self.index, g.collection), 0
        lineage = workers.lineage_store(self.paths.lineage_spec())
        for rows in rows_of_other_versions(
            self.index, g.collection, state.new_version, self.config.batch_size
        ):
            written = new_rows(self.encoders, rows, spec, centres)
            writer.write(written)
            if lineage is not None:
                lineage.sync_with_index(written)
            swept += len(rows)
        if swept:
            log.info("rollout %s: swept %d items added during the rollout", state.rollout_id, swept)
            writer.flush()

    def _row_spec(self, state: RolloutState) -> dict[str, Any]:
        """What :func:`components.rollout.writes.new_rows` stamps on the rows it writes."""
        g = state.gallery
        return {
            "new_version": state.new_version,
            "space": g.space,
            "dim": g.dim,
            "rollout_id": state.rollout_id,
            "transform": g.transform,
        }

    # ---- what serves
    def _serve(self, state: RolloutState, layers: Layers) -> None:
        """The new query model on ``layers`` (the target first); the record keeps the source (rollback)."""
        g = state.gallery
        write_serving(
            self.paths.serving,
            uri=g.uri,
            alias=g.alias,
            collection=g.collection,
            space=g.space,
            dim=self.index.collection_dim(g.collection),
            query_model=state.new_query_model.document(),
            previous={
                "collection": g.source_collection,
                "space": g.source_space,
                "query_model": state.previous_query_model.document(),
            },
            rollout_id=state.rollout_id,
            layers=layers if len(layers) > 1 else None,
        )
        state.query_model = state.new_query_model.model_copy()

    def _complete(self, state: RolloutState) -> None:
        """The target serves alone, behind the alias; the source stays for a rollback, the collection the
        version before it served is dropped."""
        g = state.gallery
        self._serve(state, [(g.collection, "")])
        self.index.switch_alias(g.collection)
        stale = (g.source_previous or {}).get("collection")
        if stale not in (g.collection, g.source_collection):
            self._drop_unserved(stale)
        state.status, state.fraction_backfilled = "completed", 1.0
        g.versions_after = self.index.count_by_version(g.collection)
        self._save(state)

    def _halt(self, state: RolloutState, rec: StageRecord, broken: list[str]) -> None:
        """A stage below its floor: queries go back to the source with the previous query model (a switch)
        and the target is dropped."""
        rec.status, rec.finished_at = "halted", utc_now()
        state.status = "halted"
        state.halt_reason = f"stage {rec.stage} probe below its floor: " + "; ".join(broken)
        log.error("rollout %s halted: %s", state.rollout_id, state.halt_reason)
        serve_source(self.paths, self.index, state, keep_previous=True)
        state.fraction_backfilled = 0.0
        self._drop_unserved(state.gallery.collection)
        state.restored = True
        self._save(state)


def run_rollout(
    index: GalleryIndex,
    paths: RolloutPaths,
    config: RolloutConfig,
    encoders: RolloutEncoders,
    probe: ProbeSet,
) -> RolloutState:
    """Plan or resume the rollout of ``config``, run it to ``completed`` or ``halted``; returns its state."""
    return Rollout(index, paths, config, encoders, probe).run()
