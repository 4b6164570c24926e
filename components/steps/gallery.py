"""Gallery steps: the first model's index, the phase's new items, and the rollout of a gate-passed model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from compat.io import write_json_atomic
from components.deployment import Deployment
from components.runs import RunPlan
from components.state.rollout_document import RolloutState
from components.state.run_dir import RunDir
from components.state.workspace import Workspace
from components.steps.base import registry_of, step
from components.steps.examples import record_examples
from components.steps.outcome import note_blocked
from components.steps.release import model_dir_of

logger = logging.getLogger(__name__)


@step("serve-first-model")
def serve_first_model_step(
    deployment: Deployment, run_dir: Path, version: str, gallery_shards: list[str]
) -> dict[str, Any]:
    """First run: index the gallery with the first model, record lineage, make it ``production``.

    The first model is a plain checkpoint: its space is its checkpoint version (as
    :func:`compat.production.space_id_of` names it), read from the sidecar without loading the weights twice.
    """
    from compat.models import read_sidecar
    from components.rollout.operations import index_new_items
    from components.runs import validated_shards

    gallery_shards = validated_shards(deployment, gallery_shards, "gallery")  # quarantined: not indexed
    model = model_dir_of(deployment, version)
    workspace = Workspace.of(deployment)
    lineage = LineageRecorder(workspace)
    record = index_new_items(
        workspace,
        model,
        version,
        str(read_sidecar(Path(model))["version"]),
        gallery_shards,
        seed=deployment.training.seed,
        on_items=lineage,
    )
    registry_of(deployment).promote(version, rollout=None)  # the first model: its gallery indexed by it
    summary = {**record, "lineage_recorded": lineage.recorded, "version": version, "promoted": True}
    write_json_atomic(RunDir(run_dir).rollout_summary, summary)
    record_examples(workspace, run_dir, gallery_shards)
    return summary


@step("ingest")
def ingest_step(deployment: Deployment, run_dir: Path, gallery_shards: list[str]) -> dict[str, Any]:
    """Index the phase's new gallery items with the serving model, whatever the gate will decide.

    Items already in the index are skipped (idempotent), so the items of every phase are searchable from
    the run that brings them; an upgrade that ships later re-embeds them with the rest of the gallery.
    Lineage records them. Writes ``ingest/ingest.json``.
    """
    from components.rollout import read_serving
    from components.rollout.operations import index_new_items
    from components.runs import validated_shards

    gallery_shards = validated_shards(deployment, gallery_shards, "gallery")  # quarantined: not indexed
    workspace = Workspace.of(deployment)
    serving = read_serving(workspace.serving_path)
    if serving is None:
        raise RuntimeError(f"no serving record in {workspace.root}: the first run indexes the gallery")
    served, lineage = serving.query_model, LineageRecorder(workspace)
    seed = deployment.training.seed
    added = index_new_items(
        workspace, served.uri, served.version, "", gallery_shards, seed=seed, on_items=lineage
    )
    summary = {
        "model_version": served.version,
        "n_items": added["n_items"],
        "n_new": added["n_new"],
        "lineage_recorded": lineage.recorded,
    }
    write_json_atomic(RunDir(run_dir).ingest_summary, summary)
    return summary


@step("rollout")
def rollout_step(deployment: Deployment, run_dir: Path, version: str) -> dict[str, Any]:
    """After a gate pass: roll ``version`` out and make it ``production``.

    The phase's new items are already indexed with the serving model (:func:`ingest_step`); the rollout
    switches queries and backfills the gallery in stages, probing each (resumable). Its writers record the
    lineage of the items they write; after a halt the lineage is brought back in line with the index, the
    run ends ``rejected`` and ``production`` stays where it was.
    """
    from components.adapters.lineage import sync_from_index
    from components.rollout import RolloutPaths, rollback
    from components.rollout.operations import open_index

    workspace = Workspace.of(deployment)
    undone, state = _roll_out(deployment, workspace, version)
    if state.status == "halted":
        # Halt means roll back: the stages accepted before the halted one are undone too and queries go back
        # to the production model, so the gallery holds production's vectors only and production, the
        # serving record and the index agree on what is served (the next upgrade is compatible with it).
        with open_index(workspace) as index:
            state = rollback(RolloutPaths.for_workspace(workspace), index)
    promoted, synced = state.status == "completed", 0
    if not promoted:  # a completed rollout recorded its items' lineage as it wrote them (its workers)
        g, workers = state.gallery, deployment.rollout.workers
        definition = workspace.lineage_definition
        synced = sync_from_index(
            workspace.lineage_dir, g.uri, g.alias, definition=definition, workers=workers
        )
    summary = {
        "version": version,
        "undone_first": undone,
        "rollout": state.document(),
        "lineage_updated": synced,
        "promoted": promoted,
    }
    run = RunDir(run_dir)
    if promoted:
        registry_of(deployment).promote(version, rollout=state)
    else:
        reason = state.halt_reason or f"see {run.rollout_summary.relative_to(run.path)}"
        note_blocked(run_dir, "rollout", f"rollout halted and rolled back: {reason}")
    write_json_atomic(run.rollout_summary, summary)
    write_json_atomic(run.rollout_state, summary["rollout"])  # where the on-call report reads it
    plan = RunPlan.read(run.plan_file)
    record_examples(workspace, run_dir, plan.gallery_shards if plan else [])  # what is served now
    return summary


IDLE_RANGE = "idle"  # the one range handed out when no stage waits (an empty ParallelFor breaks kfp.local)


@step("rollout-ranges")
def rollout_ranges_step(deployment: Deployment, run_dir: Path, version: str) -> list[str]:
    """On a cluster, with ``rollout.workers`` > 1: run the rollout of ``version`` until a backfill stage's
    ranges wait for their workers (the pipeline's parallel ``rollout_range_op`` tasks) and return them
    as ``"start-end"``; ``[IDLE_RANGE]`` once no stage waits (the rollout completed or halted:
    :func:`rollout_step` finishes the step), so the next fan-out runs one task that does nothing rather than
    none (kfp.local fails to collect an empty ``ParallelFor``). Called again after the ranges are written,
    it probes that stage and goes on."""
    from components.rollout import RolloutPaths
    from components.rollout.workers import pending_ranges

    workspace = Workspace.of(deployment)
    _, state = _roll_out(deployment, workspace, version, range_tasks=True)
    work = RolloutPaths.for_workspace(workspace).work(state.rollout_id)
    return [f"{start}-{end}" for start, end in pending_ranges(state, work)] or [IDLE_RANGE]


@step("rollout-range")
def rollout_range_step(deployment: Deployment, run_dir: Path | None, rank_range: str) -> dict[str, Any]:
    """One backfill worker: re-embed and write the ranks ``"start-end"`` of the rollout in progress
    (:func:`components.rollout.workers.run_range`; resumable, idempotent); nothing for :data:`IDLE_RANGE`."""
    from components.rollout import RolloutError, RolloutPaths, load_state
    from components.rollout.workers import SPEC_FILE, run_range

    if rank_range == IDLE_RANGE:
        return {"idle": True}
    paths = RolloutPaths.for_workspace(Workspace.of(deployment))
    state = load_state(paths.state)
    if state is None or state.status != "running":
        raise RolloutError(f"no rollout is running in {paths.state}: nothing for rank range {rank_range}")
    start, _, end = rank_range.partition("-")
    return run_range(paths.work(state.rollout_id) / SPEC_FILE, int(start), int(end))


def _roll_out(
    deployment: Deployment, workspace: Workspace, version: str, range_tasks: bool = False
) -> tuple[dict[str, Any] | None, RolloutState]:
    """Undo an unfinished rollout of another version, then plan or resume the rollout of ``version``;
    returns (what was undone, the rollout state)."""
    from components.rollout.operations import roll_out

    undone = _undo_unfinished_rollout(workspace, version)
    state = roll_out(
        workspace,
        version,
        deployment.rollout,
        new_model=model_dir_of(deployment, version),
        seed=deployment.training.seed,
        range_tasks=range_tasks,
    )
    return undone, state


def _undo_unfinished_rollout(workspace: Workspace, version: str) -> dict[str, Any] | None:
    """Roll back a rollout of another version left unfinished (its run was killed or failed and will not
    resume it, or it halted under `compatflow rollout run`: never promoted); a rollout of ``version`` itself
    is resumed by the caller. Returns what was undone (for the report), or None."""
    from components.rollout import RolloutPaths, load_state, rollback
    from components.rollout.operations import open_index
    from components.state.rollout_document import UNDER_WAY

    paths = RolloutPaths.for_workspace(workspace)
    state = load_state(paths.state)
    # Halted counts too: one left by `compatflow rollout run` keeps its accepted stages (a mixed gallery
    # queried by its candidate), which the candidate here was not trained to read.
    if state is None or state.status not in UNDER_WAY or state.new_version == str(version):
        return None
    logger.warning(
        "rolling back unfinished rollout %s of version %s first", state.rollout_id, state.new_version
    )
    with open_index(workspace) as index:
        rollback(paths, index)
    return {"rollout_id": state.rollout_id, "model_version": state.new_version, "status": state.status}


class LineageRecorder:
    """Records freshly indexed items in Feast (who embedded them, in which space, from which image), a
    shard's rows at a time (:func:`components.rollout.operations.index_new_items` calls it per shard);
    ``recorded`` counts the rows written."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.store: Any = None
        self.recorded = 0

    def __call__(self, rows: list[dict[str, Any]]) -> None:
        from components.adapters.lineage import LineageStore

        if not rows:
            return
        if self.store is None:
            self.store = LineageStore.of(self.workspace)
            self.store.apply()
        self.recorded += self.store.write_items(rows)
