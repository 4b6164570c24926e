"""Rollout of a gate-passed model onto the Milvus gallery: staged partial backfill, durable and reversible.

The design (source and target collections, layers, stages, floors, the pace, why a rollback is a switch) is
README.md's rollout section; the modules split it by role: types, state, plan, engine, workers.
"""

from components.rollout.engine import Rollout, run_rollout
from components.rollout.operations import index_gallery
from components.rollout.probes import probe_metrics, recall_from_hits
from components.rollout.rollback import rollback, rollout_of
from components.rollout.state import load_state, save_state, status
from components.rollout.types import (
    DEFAULT_KS,
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
