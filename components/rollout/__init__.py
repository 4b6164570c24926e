"""Rollout of a gate-passed model onto the Milvus gallery: staged partial backfill, durable and reversible.

A rollout never writes the collection it starts from (the *source*). Its new vectors go into a collection of
its own (the *target*), and the serving record names what answers a query
(:class:`~components.rollout.engine.Rollout`):

* stage 0 -- the query side switches to the new model at once: the probe set (held-out text queries with
  known relevant items) is scored with the new queries against the target (empty) over the source; only
  then does the serving record move. A release read through a ``gallery_transform`` (a forward adapter,
  zero-padding) first fills the target with the transformed source.
* stages 1..k -- the items of each stage are re-embedded into the target. A stage is a filter on what every
  row carries from when it was written (:mod:`components.rollout.keys`: a hash of its id, ``embedded_at``,
  its lambda-orth and uncertainty keys), split into slices that one process or K workers write
  (:mod:`components.rollout.workers`), recording their items' lineage as they go. After a stage the probe
  is scored on the mixed gallery (the target, over the source less the stages done) and the stage is
  accepted only if every R@K holds its floor; otherwise the rollout halts: the serving record goes back to
  the source with the previous query model.
* a space change (or a source written by an earlier release, without per-row keys) fills the target whole
  (blue-green) before it serves.

Nothing reads the whole gallery in one process: a plan reads a bounded sample; a stage reads its slices.
Durability: the state JSON is written atomically after every stage and each worker's cursor after every
slice; a slice a crash may have half-written is upserted again, so a rollout killed at any moment and run
again with the same configuration resumes with nothing lost or doubled. :func:`rollback` is a switch of the
serving record and alias back to the source: seconds, whatever the gallery's size.

Index work: writes are flushed every ``flush_rows`` rows on milvus-lite (a search over many unflushed rows is
a slow brute-force scan), and, with ``slo_p99_factor``, paced to hold users' query latency
(:mod:`~components.rollout.pacing`).
"""

from components.rollout.engine import Rollout, run_rollout
from components.rollout.operations import index_gallery
from components.rollout.probes import probe_metrics, recall_from_hits
from components.rollout.rollback import rollback, rollout_of
from components.rollout.state import load_state, save_state, status
from components.rollout.types import (
    DEFAULT_KS,
    STATES,
    GalleryEncoder,
    ItemRef,
    ProbeSet,
    QueryEncoder,
    RolloutConfig,
    RolloutEncoders,
    RolloutError,
    RolloutPaths,
    VectorTransform,
    item_ref,
)
from components.serving.record import ServingError, read_serving, write_serving

__all__ = [
    "DEFAULT_KS",
    "STATES",
    "GalleryEncoder",
    "ItemRef",
    "ProbeSet",
    "QueryEncoder",
    "Rollout",
    "RolloutConfig",
    "RolloutEncoders",
    "RolloutError",
    "RolloutPaths",
    "ServingError",
    "VectorTransform",
    "index_gallery",
    "item_ref",
    "load_state",
    "probe_metrics",
    "read_serving",
    "recall_from_hits",
    "rollback",
    "rollout_of",
    "run_rollout",
    "save_state",
    "status",
    "write_serving",
]
