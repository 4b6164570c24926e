"""Rollout of a gate-passed model onto the Milvus gallery: staged partial backfill, durable and reversible.

A rollout never writes the collection it starts from (the *source*): its new vectors go into a collection of
its own (the *target*), and the serving record names what answers a query. Stage 0 switches the query side
to the new model once the probe set holds its floors on the target over the source (a release read through a
gallery transform first fills the target with the transformed source); stages 1..k re-embed their items
(:mod:`~components.rollout.keys`: filters on what every row carries) into the target, by one process or K
workers (:mod:`~components.rollout.workers`), and each is accepted only if every probe R@K holds its floor,
else the rollout halts back to the source. A space change fills the target whole (blue-green) first.

Nothing reads the whole gallery in one process; the state JSON is written atomically after every stage and
each worker's cursor after every slice, so a rollout killed at any moment resumes with nothing lost or
doubled. :func:`rollback` is a switch of the serving record and alias back to the source. Writes are
flushed every ``flush_rows`` rows on milvus-lite and, with ``slo_p99_factor``, paced
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
