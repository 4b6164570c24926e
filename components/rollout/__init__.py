"""Rollout of a gate-passed model onto the Milvus gallery: staged partial backfill, durable and reversible.

Staged (the release keeps the serving space):

* stage 0 -- the query side switches to the new model at once. The probe set (held-out text queries
  with known relevant items) is scored with the new serving queries against the gallery as it is
  (or, when the serving contract reads old vectors through a ``gallery_transform`` -- a forward
  adapter, zero-padding -- against a copy of the gallery with transformed vectors, built first in a
  new collection); only then are the serving record and the alias moved.
* stages 1..k -- items are re-embedded with the new model in the policy's order
  (:mod:`compat.backfill`) and upserted in batches until the stage's fraction is reached; the probe is
  scored on the mixed gallery and the stage is accepted only if every R@K is at or above its floor
  (the old/old figure measured before the rollout, or a higher configured floor). Otherwise the
  rollout halts and the stage's items get their previous vectors back.

Space change (no gallery transform and a target space other than the serving one): blue-green. A new
collection is filled with new vectors, probed, and the serving record and alias move to it; the old
collection stays for rollback.

Durability: before a batch is upserted its previous rows are saved to a restore file (never
overwritten: a retried batch keeps the rows it first replaced; an in-place rollout's plan reads every
row once and saves them all, so no batch reads the index again); the state JSON is written atomically
after every batch. Upserts are keyed by item_id, so a crash between an upsert and the state write
repeats one batch harmlessly. Killed at any moment and run again with the same configuration, the
rollout resumes. :func:`rollback` restores the previous collection or the saved rows of the batches that
ran (at the rollout's pace), and the previous query model.

Index work: writes are flushed every ``flush_rows`` rows (a search over many unflushed rows is a slow
brute-force scan in Milvus), and, with ``slo_p99_factor``, paced to hold users' query latency
(:mod:`~components.rollout.pacing`).

Modules: :mod:`~components.rollout.types` (configuration, encoders, probe set, paths, errors),
:mod:`~components.rollout.state` (the state file, its lock, restore files), :mod:`~components.rollout.pacing`,
:mod:`~components.rollout.probes`, :mod:`~components.rollout.plan` (what a plan reads and decides),
:mod:`~components.rollout.engine`, :mod:`~components.rollout.rollback`,
:mod:`~components.rollout.production_rollback` (the gallery's part of a production rollback) and
:mod:`~components.rollout.encoders` (encoders of real models); the serving record they write is
:mod:`components.serving.record`'s.
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
