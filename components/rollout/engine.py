"""The rollout engine: plans a rollout, runs stage 0, the backfill stages or a blue-green fill, resumes.

One class, the rollout's state machine, kept in one module so that every transition of the state file
reads in one place; what a plan reads and decides before any write is :mod:`components.rollout.plan`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from compat.io import utc_now
from components.adapters.index import ROW_FIELDS, GalleryIndex, quote
from components.adapters.services import live_services
from components.rollout.ahead import Batch, BatchesAhead
from components.rollout.order import RankedOrder
from components.rollout.pacing import Pace, latency_sources
from components.rollout.plan import (
    Source,
    check_probe_covers,
    check_vectors,
    probe_floors,
    rank_gallery,
    serving_source,
    stage_plan,
)
from components.rollout.probes import broken_floors, probe_metrics
from components.rollout.rollback import replay_rows
from components.rollout.state import (
    batch_grid,
    exclusive,
    load_state,
    restore_path,
    save_rows,
    save_state,
    saved_batches,
)
from components.rollout.types import (
    ProbeSet,
    RangesPending,
    RolloutConfig,
    RolloutEncoders,
    RolloutError,
    RolloutPaths,
    item_ref,
)
from components.rollout.writes import GalleryWriter, previous_rows, reembedded_rows
from components.serving.record import read_serving, write_serving
from components.state.rollout_document import SCHEMA_VERSION

log = logging.getLogger(__name__)


class Rollout:
    """A rollout of one configuration; :meth:`run` plans it, or resumes it from its state file."""

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
        self._ahead: BatchesAhead[list[dict[str, Any]]] | None = None
        self._ahead_reads: tuple[str, bool] | None = None  # (collection, keep) its batches read

    @property
    def rollout_id(self) -> str:
        c = self.config
        key = {
            "new_version": c.new_version,
            "query_model": c.query_model.get("version"),
            "space": self.space,
            "policy": c.order,  # the stored name (rollout ids and state files keep it)
            "seed": c.seed,
            "fractions": list(c.fractions),
            "batch_size": c.batch_size,
            "transform": self.encoders.transform_tag,
            "n_clusters": c.n_clusters,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]

    # ---- entry point
    def run(self) -> dict[str, Any]:
        """Plan or resume, then run to ``completed`` or ``halted``; returns the final state. With
        ``config.range_tasks`` it returns earlier, state ``running``, when a stage's rank ranges wait for
        their pipeline tasks (``cursor.ranges``; :func:`components.rollout.workers.pending_ranges`)."""
        with exclusive(self.paths.state):
            state = load_state(self.paths.state)
            if state is None or state["rollout_id"] != self.rollout_id:
                if state is not None:
                    self._replace(state)
                self.pace = Pace(self.config.slo_p99_factor, self.config.max_items_per_s)
                self._measure_idle()
                state = self._plan()
            else:
                self.pace = Pace.resumed(
                    state.get("pace"), self.config.slo_p99_factor, self.config.max_items_per_s
                )
            try:
                while True:
                    if state["status"] in ("completed", "rolled_back"):
                        return state
                    if state["status"] == "halted":
                        if not state["restored"]:
                            self._restore_stage(state)
                        return state
                    if state["mode"] == "blue_green":
                        self._blue_green(state)
                    elif state["stage"] == 0:
                        self._stage0(state)
                    else:
                        self._stage(state, state["stage"])
            except RangesPending as pending:
                log.info("rollout %s: %s", state["rollout_id"], pending)
                return state
            finally:
                self._close_ahead()

    def _measure_idle(self) -> None:
        """The idle query p99 the SLO is a multiple of, measured before the rollout touches anything: on the
        users' queries of the running services, or on searches of the serving collection with a probe text
        under the serving query model (the backfill's own source is chosen at its first batch)."""
        serving = self.index.serving_collection()
        if self.config.slo_p99_factor is None or serving is None or not self.probe.texts:
            return
        query = check_vectors(
            self.encoders.old_query(self.probe.texts[:1]), 1, self.index.collection_dim(serving), "old_query"
        )
        self.pace.watch(latency_sources(self.index, serving, query, live_services(self.paths.services)))
        self.pace.latency = None

    def _save(self, state: dict[str, Any]) -> None:
        save_state(self.paths.state, state)

    def _replace(self, old: dict[str, Any]) -> None:
        busy = old["status"] in ("pending", "running") or (old["status"] == "halted" and not old["restored"])
        if busy:
            raise RolloutError(
                f"rollout {old['rollout_id']} ({old['new_version']}) is {old['status']} at "
                f"{self.paths.state}: run it to the end with its own configuration, or roll it back"
            )

        archived = self.paths.archived_state(old["rollout_id"])
        save_state(archived, old, root=self.paths.root)  # archived, then replaced

    # ---- planning
    def _plan(self) -> dict[str, Any]:
        """Read the serving collection, decide the mode, order, floors and stages, write the new state.

        The collection is streamed once into the ranked order on disk (:func:`rank_gallery`): the plan holds
        a batch of rows and a bounded sort run, never the gallery. An in-place rollout saves each batch's
        previous rows just before it overwrites them (:meth:`_previous_rows`)."""
        c, idx = self.config, self.index
        t0 = time.perf_counter()
        source = serving_source(idx, read_serving(self.paths.serving), self.paths.serving)
        space = self.space or source.space
        mode = "staged" if (self.adapt or space == source.space) else "blue_green"
        in_place = mode == "staged" and not self.adapt  # the batches overwrite the rows this plan reads
        check_probe_covers(self.probe, idx, source.collection)
        rid = self.rollout_id
        ordered = rank_gallery(
            idx,
            source.collection,
            c,
            self.paths.work(rid),
            transform=self.encoders.gallery_transform if self.adapt else None,
        )
        order = {"policy": c.order, "seed": c.seed, "digest": ordered.digest}
        old_queries = check_vectors(
            self.encoders.old_query(self.probe.texts), len(self.probe.texts), source.dim, "old_query"
        )
        baseline, floors = probe_floors(idx, source, old_queries, self.probe, c)
        stages = stage_plan(mode, len(ordered), c.fractions)
        state = {
            "schema_version": SCHEMA_VERSION,
            "rollout_id": rid,
            "status": "running",
            "mode": mode,
            "created_at": utc_now(),
            "updated_at": utc_now(),
            "new_version": c.new_version,
            "model_version": c.new_version,
            "stage": 1 if mode == "blue_green" else 0,
            "fractions": list(c.fractions),
            "n_items": len(ordered),
            "fraction_backfilled": 0.0,
            "batch_size": c.batch_size,
            "workers": c.workers,
            "order": {**order, "path": str(ordered.directory), "n_clusters": c.n_clusters},
            "cursor": {"position": 0, "batches": 0, "adapt_position": 0},
            "query_model": source.record["query_model"],
            "previous_query_model": source.record["query_model"],
            "new_query_model": c.query_model,
            "gallery": {
                "uri": idx.uri,
                "alias": idx.alias,
                "source_collection": source.collection,
                "source_space": source.space,
                "collection": source.collection if in_place else idx.next_collection_name(space),
                "space": space,
                "dim": self._target_dim(source, ordered[0]),
                "transform": self.encoders.transform_tag,
                "versions_before": idx.count_by_version(source.collection),
            },
            "ks": list(c.ks),
            "baseline": baseline,
            "floors": floors,
            "probe_tolerance": c.probe_tolerance,
            "stages": stages,
            "curve": [],
            "restored": True,
            "halt_reason": None,
            "rollback": None,
            "plan_seconds": round(time.perf_counter() - t0, 3),
            "pace": self.pace.to_dict(),  # the idle p99 measured before this plan read anything
        }
        self._save(state)
        log.info(
            "rollout %s planned in %.1f s: %s, %d items, order %s, floors %s",
            rid,
            state["plan_seconds"],
            mode,
            len(ordered),
            c.order,
            floors,
        )
        return state

    def _target_dim(self, source: Source, first_id: str) -> int:
        """The vector size the rollout writes: the source's, or what the gallery transform makes of it."""
        if not self.adapt:
            return source.dim
        (first,) = self.index.fetch([first_id], source.collection)
        return int(
            np.asarray(
                self.encoders.gallery_transform(np.asarray(first["vector"], dtype=np.float32)[None])
            ).shape[1]
        )

    # ---- shared pieces
    def _order(self, state: dict[str, Any]) -> RankedOrder:
        """The rollout's ranked order on disk (each chunk checked against the manifest as it is read)."""
        from components.rollout.order import OrderError

        try:
            return RankedOrder(state["order"]["path"], expected_digest=state["order"]["digest"])
        except OrderError as exc:
            raise RolloutError(f"{exc} (rollout state {self.paths.state})") from exc

    def _serving_queries(self, dim: int) -> np.ndarray:
        if self._queries is None:
            self._queries = check_vectors(
                self.encoders.serving_queries(self.probe.texts),
                len(self.probe.texts),
                dim,
                "new query encoder",
            )
        return self._queries

    def _probe(self, state: dict[str, Any], collection: str) -> dict[str, float]:
        return probe_metrics(
            self.index, collection, self._serving_queries(state["gallery"]["dim"]), self.probe, state["ks"]
        )

    def _curve_point(self, state: dict[str, Any], fraction: float, metrics: Mapping[str, float]) -> None:
        point = {
            "fraction": round(float(fraction), 6),
            "t2i_R@1": metrics["R@1"],
            **{m: v for m, v in metrics.items() if m != "R@1"},
        }
        state["curve"] = [p for p in state["curve"] if p["fraction"] != point["fraction"]] + [point]
        state["curve"].sort(key=lambda p: p["fraction"])

    def _new_rows(self, state: dict[str, Any], previous: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        g = state["gallery"]
        return reembedded_rows(
            self.encoders,
            previous,
            version=state["new_version"],
            space=g["space"],
            dim=g["dim"],
            rollout_id=state["rollout_id"],
        )

    def _previous_rows(
        self, state: dict[str, Any], ids: Sequence[str], start: int, end: int, collection: str, keep: bool
    ) -> list[dict[str, Any]]:
        """Rows the batch replaces; with ``keep`` they are first saved (once) for restore and rollback."""
        restore = restore_path(self.paths.restore_dir(state["rollout_id"]), start, end) if keep else None
        return previous_rows(self.index, ids, collection, restore)

    def _run_batches(
        self,
        state: dict[str, Any],
        ids: Sequence[str],
        batches: Sequence[Batch],
        source: str,
        target: str,
        keep: bool,
        later: Sequence[Batch] = (),
    ) -> None:
        """Re-embed and upsert ``batches`` (start, end) of ``ids`` in order, then prepare ``later`` (the next
        stages' batches) ahead while this stage is flushed and probed.

        This thread reads the rows a batch replaces (saving them for restore before anything overwrites
        them) and hands the batch to an encoder thread, keeping up to ``config.prefetch`` batches queued
        there (:mod:`components.rollout.ahead`), then upserts finished batches and records progress: the
        encoder never waits on the index.
        """
        t0 = time.perf_counter()
        self._watch_latency(state, ids[batches[0][0]] if batches else None, source)
        writer = self._writer(target)
        self.pace.begin()
        ahead = self._ahead_for(state, ids, source, keep)
        ahead.plan([*batches, *later])
        from compat.progress import task

        what = f"backfill stage {state.get('stage', 0)}"
        with task(what, total=sum(end - start for start, end in batches), unit="items") as progress:
            for expected in batches:
                (start, end), rows = ahead.next()
                if (start, end) != tuple(expected):  # the plan above starts with ``batches``
                    raise RolloutError(f"batch {start}-{end} prepared where {expected} was due")
                writer.write(rows)  # paced after every upsert call
                state["cursor"]["batches"] += 1
                state["cursor"]["position"] = end
                state["fraction_backfilled"] = end / state["n_items"]
                state["pace"] = self.pace.to_dict()
                self._save(state)
                progress.advance(end - start, backfilled=f"{100 * state['fraction_backfilled']:.0f}%")
        if writer.written:
            rate = writer.written / max(time.perf_counter() - t0, 1e-9)
            log.info(
                "rollout %s: %d items re-embedded (%.0f items/s)", state["rollout_id"], writer.written, rate
            )

    def _fan_out(
        self,
        state: dict[str, Any],
        rec: dict[str, Any],
        order: RankedOrder,
        start: int,
        end: int,
        source: str,
        target: str,
        keep: bool,
    ) -> None:
        """Ranks ``[start, end)`` re-embedded by ``config.workers`` processes, one rank range each
        (:mod:`components.rollout.workers`); returns once every range is written. The ranges go into the
        state before any worker starts (a rollback then replays every batch they may have written)."""
        from components.adapters.index import is_remote
        from components.rollout import workers

        if end <= start:
            return
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
        ranges = workers.split_ranges(start, end, self.config.batch_size, self.config.workers)
        state["cursor"]["ranges"] = [list(r) for r in ranges]
        self._save(state)
        g = state["gallery"]
        self._watch_latency(state, order[start] if start < end else None, source)
        spec = workers.write_spec(
            self.paths.work(state["rollout_id"]),
            {
                "uri": self.index.uri,
                "alias": self.index.alias,
                "source": source,
                "target": target,
                "serving": self.index.serving_collection() or source,
                "keep": keep,
                "restore_dir": str(self.paths.restore_dir(state["rollout_id"])),
                "order": {"path": state["order"]["path"], "digest": state["order"]["digest"]},
                "batch_size": self.config.batch_size,
                "flush_rows": self.config.flush_rows,
                "new_version": state["new_version"],
                "space": g["space"],
                "dim": g["dim"],
                "rollout_id": state["rollout_id"],
                "encoders": self.encoders.recipe,
                "pace": self.pace.to_dict(),
                "workers": len(ranges),
                "services_dir": str(self.paths.services),
            },
        )
        pending = [r for r in ranges if not workers.range_done(spec, *r)]
        if pending and self.config.range_tasks:
            raise RangesPending(pending)
        t0 = time.perf_counter()
        workers.run_ranges(spec, pending)
        done = [workers.read_cursor(workers.range_cursor(spec.parent, *r), r[0]) for r in ranges]
        rec["workers"] = [
            {
                "ranks": list(r),
                **{k: d.get(k) for k in ("written", "seconds", "items_per_s", "cpu_seconds", "peak_rss_mib")},
                "pace": d.get("pace"),
            }
            for r, d in zip(ranges, done, strict=True)
        ]
        state["cursor"].update(
            position=end, batches=state["cursor"]["batches"] + len(self._batches(start, end)), ranges=None
        )
        state["fraction_backfilled"] = end / state["n_items"]
        self._save(state)
        log.info(
            "rollout %s: ranks %d-%d re-embedded by %d workers (%.0f items/s)",
            state["rollout_id"],
            start,
            end,
            len(ranges),
            (end - start) / max(time.perf_counter() - t0, 1e-9),
        )

    def _ahead_for(
        self, state: dict[str, Any], ids: Sequence[str], source: str, keep: bool
    ) -> BatchesAhead[list[dict[str, Any]]]:
        """The pipeline of prepared batches, kept from stage to stage while batches read the same place."""
        if self._ahead is None or self._ahead_reads != (source, keep):
            self._close_ahead()
            self._ahead = BatchesAhead(
                lambda b: self._previous_rows(state, ids[b[0] : b[1]], b[0], b[1], source, keep),
                lambda previous: self._new_rows(state, previous),
                self.config.prefetch,
            )
            self._ahead_reads = (source, keep)
        return self._ahead

    def _close_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = self._ahead_reads = None

    def _writer(self, collection: str) -> GalleryWriter:
        return GalleryWriter.for_pace(self.index, collection, self.pace, self.config.flush_rows)

    def _watch_latency(self, state: dict[str, Any], first_id: str | None, source: str) -> None:
        """Give the pace its query-latency source (the running services' users' queries, else searches it
        times itself, with the vector of ``first_id``, the stage's first item) and the idle p99, measured
        once per rollout before any write. Nothing without an SLO throttle, or in a blue-green fill (users'
        queries read another space than the rows it writes)."""
        if first_id is None or self.config.slo_p99_factor is None or self.pace.latency is not None:
            return  # (the source chosen at the first stage keeps its window of samples)
        serving = self.index.serving_collection() or source
        (row,) = self.index.fetch([first_id], source)
        if len(row["vector"]) != self.index.collection_dim(serving):
            return
        sources = latency_sources(
            self.index, serving, np.asarray(row["vector"]), live_services(self.paths.services)
        )
        if self.pace.watch(sources) is not None:
            state["pace"] = self.pace.to_dict()
            log.info(
                "rollout %s: idle query p99 %.1f ms (%s)",
                state["rollout_id"],
                self.pace.idle_p99_ms,
                self.pace.idle_from,
            )

    def _batches(self, start: int, end: int) -> list[Batch]:
        """The batches of ranks ``[start, end)`` (one pair per batch: a stage's worth, N / batch_size)."""
        return list(batch_grid(start, end, self.config.batch_size))

    # ---- stage 0: the query switch (through a transformed copy when the contract needs one)
    def _stage0(self, state: dict[str, Any]) -> None:
        g, rec = state["gallery"], state["stages"][0]
        rec.setdefault("started_at", utc_now())
        rec["status"] = "running"
        if self.adapt:
            self._adapt_copy(state)
        metrics = self._probe(state, g["collection"])
        rec["probe"] = metrics
        self._curve_point(state, 0.0, metrics)
        broken = broken_floors(metrics, state["floors"])
        if broken:
            if g["collection"] != g["source_collection"] and self.index.has_collection(g["collection"]):
                self.index.drop(g["collection"])
            self._halt(state, rec, broken)
            state["restored"] = True
            self._save(state)
            return
        self._serve_new(state)
        rec.update(status="accepted", finished_at=utc_now())
        state["stage"] = 1
        self._save(state)

    def _adapt_copy(self, state: dict[str, Any]) -> None:
        g = state["gallery"]
        if not self.index.has_collection(g["collection"]):
            self.index.create_collection(g["space"], g["dim"], name=g["collection"])
        ids = self._order(state)
        transform = self.encoders.gallery_transform
        for start, end in self._batches(state["cursor"]["adapt_position"], len(ids)):
            rows = self.index.fetch(ids[start:end], g["source_collection"])
            vectors = check_vectors(
                transform(np.asarray([r["vector"] for r in rows], dtype=np.float32)),
                len(rows),
                g["dim"],
                "gallery_transform",
            )
            self.index.upsert(
                [
                    {**r, "vector": vectors[j].tolist(), "space_id": g["space"], "transform": g["transform"]}
                    for j, r in enumerate(rows)
                ],
                g["collection"],
            )
            state["cursor"]["adapt_position"] = end
            self._save(state)
        self.index.flush(g["collection"])

    def _serve_new(self, state: dict[str, Any]) -> None:
        """Queries go to the new model on the rollout's collection; the record keeps the source (rollback)."""
        g = state["gallery"]
        self._switch(
            state,
            g["collection"],
            state["new_query_model"],
            previous={
                "collection": g["source_collection"],
                "space": g["source_space"],
                "query_model": state["previous_query_model"],
            },
        )

    def _switch(
        self,
        state: dict[str, Any],
        collection: str,
        query_model: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
    ) -> None:
        """Serving record first (it names the collection its query model reads), then the alias."""
        g = state["gallery"]
        space = g["space"] if collection == g["collection"] else g["source_space"]
        write_serving(
            self.paths.serving,
            uri=g["uri"],
            alias=g["alias"],
            collection=collection,
            space=space,
            dim=self.index.collection_dim(collection),
            query_model=query_model,
            previous=previous,
            rollout_id=state["rollout_id"],
        )
        self.index.switch_alias(collection)
        state["query_model"] = dict(query_model)

    # ---- stages 1..k
    def _stage(self, state: dict[str, Any], j: int) -> None:
        rec = state["stages"][j]
        hi = rec["target_position"]
        rec.setdefault("started_at", utc_now())
        if rec["status"] != "running":
            rec["status"] = "running"
            self._save(state)
        g = state["gallery"]
        ids = self._order(state)
        t0 = time.perf_counter()
        start = state["cursor"]["position"]
        later = [
            batch
            for lo, rec_k in zip(state["stages"][j:], state["stages"][j + 1 :], strict=False)
            for batch in self._batches(lo["target_position"], rec_k["target_position"])
        ]
        if self.config.workers > 1:
            self._fan_out(state, rec, ids, start, hi, g["collection"], g["collection"], keep=True)
        else:
            self._run_batches(
                state, ids, self._batches(start, hi), g["collection"], g["collection"], keep=True, later=later
            )
        last = j == len(state["stages"]) - 1
        if last:
            self._sweep(state)
        self.index.flush(g["collection"])
        if hi > start:
            rec["items_per_s"] = round((hi - start) / max(time.perf_counter() - t0, 1e-9), 1)
        metrics = self._probe(state, g["collection"])
        rec["probe"], rec["seconds"] = metrics, round(time.perf_counter() - t0, 3)
        self._curve_point(state, hi / state["n_items"], metrics)
        broken = broken_floors(metrics, state["floors"])
        if broken:
            self._halt(state, rec, broken)
            self._save(state)
            self._restore_stage(state)
            return
        rec.update(status="accepted", finished_at=utc_now())
        if last:
            state["status"] = "completed"
            state["gallery"]["versions_after"] = self.index.count_by_version(g["collection"])
        else:
            state["stage"] = j + 1
        self._save(state)
        log.info(
            "rollout %s: stage %d (%.0f%%) accepted: %s",
            state["rollout_id"],
            j,
            100 * rec["fraction"],
            metrics,
        )

    def _sweep(self, state: dict[str, Any]) -> None:
        """Re-embed items added since the plan (outside the order) so that no old vector is left: a batch of
        them at a time, until none is left (each write takes its rows out of the filter)."""
        g = state["gallery"]
        self.index.flush(g["collection"])
        flt = f"model_version != {quote(state['new_version'])}"
        writer, swept, previous = self._writer(g["collection"]), 0, None
        while rows := self.index.rows_where(flt, ROW_FIELDS, g["collection"], limit=self.config.batch_size):
            batch = [{f: r[f] for f in ROW_FIELDS} for r in rows]
            keys = [r["item_id"] for r in batch]
            if keys == previous:
                raise RolloutError(
                    f"the sweep's write of {len(keys)} items to {g['collection']} is not visible to its next "
                    "read; check the index's consistency and run the rollout again (it resumes)"
                )
            digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
            path = self.paths.restore_dir(state["rollout_id"]) / f"sweep-{digest}.npz"
            if not path.is_file():
                save_rows(path, batch)
            writer.write(self._new_rows(state, batch))
            swept, previous = swept + len(batch), keys
        if swept:
            log.info("rollout %s: swept %d items added during the rollout", state["rollout_id"], swept)
            writer.flush()

    def _halt(self, state: dict[str, Any], rec: dict[str, Any], broken: list[str]) -> None:
        rec.update(status="halted", finished_at=utc_now())
        state["status"] = "halted"
        state["restored"] = False
        state["halt_reason"] = f"stage {rec['stage']} probe below its floor: " + "; ".join(broken)
        log.error("rollout %s halted: %s", state["rollout_id"], state["halt_reason"])

    def _restore_stage(self, state: dict[str, Any]) -> None:
        """Give the halted stage's items their previous vectors back (idempotent)."""
        j = next(r["stage"] for r in state["stages"] if r["status"] == "halted")
        if j > 0 and state["mode"] == "staged":
            lo, hi = state["stages"][j - 1]["target_position"], state["stages"][j]["target_position"]
            last = j == len(state["stages"]) - 1
            files = saved_batches(
                self.paths.restore_dir(state["rollout_id"]),
                batch_grid(lo, hi, state["batch_size"]),
                sweep=last,
            )
            replay_rows(
                self.index,
                files,
                state["gallery"]["collection"],
                self.pace,
                self.config.flush_rows,
                live_services(self.paths.services),
            )
            state["cursor"]["position"] = lo
            state["fraction_backfilled"] = lo / state["n_items"]
        state["restored"] = True
        self._save(state)

    # ---- blue-green
    def _blue_green(self, state: dict[str, Any]) -> None:
        g, rec = state["gallery"], state["stages"][0]
        rec.setdefault("started_at", utc_now())
        rec["status"] = "running"
        ids = self._order(state)
        start = state["cursor"]["position"]
        if not self.index.has_collection(g["collection"]):
            first = self.index.fetch(ids[:1], g["source_collection"])
            dim = check_vectors(
                self.encoders.new_gallery([item_ref(r) for r in first]), 1, None, "gallery encoder"
            ).shape[1]
            self.index.create_collection(g["space"], dim, name=g["collection"])
        g["dim"] = self.index.collection_dim(g["collection"])
        t0 = time.perf_counter()
        if self.config.workers > 1:
            self._fan_out(
                state, rec, ids, start, len(ids), g["source_collection"], g["collection"], keep=False
            )
        else:
            self._run_batches(
                state,
                ids,
                self._batches(start, len(ids)),
                g["source_collection"],
                g["collection"],
                keep=False,
            )
        self.index.flush(g["collection"], wait_indexed=True)  # served whole once probed
        if len(ids) > start:
            rec["items_per_s"] = round((len(ids) - start) / max(time.perf_counter() - t0, 1e-9), 1)
        metrics = self._probe(state, g["collection"])
        rec["probe"], rec["seconds"] = metrics, round(time.perf_counter() - t0, 3)
        self._curve_point(state, 0.0, state["baseline"])
        self._curve_point(state, 1.0, metrics)
        broken = broken_floors(metrics, state["floors"])
        if broken:
            self._halt(state, rec, broken)
            self.index.drop(g["collection"])
            state["restored"] = True
            state["fraction_backfilled"] = 0.0
            self._save(state)
            return
        self._serve_new(state)
        rec.update(status="accepted", finished_at=utc_now())
        state["status"] = "completed"
        g["versions_after"] = self.index.count_by_version(g["collection"])
        self._save(state)


# ------------------------------------------------------------------------------------------- functions
def run_rollout(
    index: GalleryIndex,
    paths: RolloutPaths,
    config: RolloutConfig,
    encoders: RolloutEncoders,
    probe: ProbeSet,
) -> dict[str, Any]:
    """Plan or resume the rollout of ``config``, run it to ``completed`` or ``halted``; returns the state."""
    return Rollout(index, paths, config, encoders, probe).run()
