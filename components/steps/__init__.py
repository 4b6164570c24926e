"""Step functions: one per pipeline step, a plain function of the resolved config.

Each reads its inputs (paths), calls the service adapter or engine that does the work, writes its summary
under ``<run_dir>/<step>/`` (what the on-call report and ``compatflow status`` read) and returns what the
next step needs. The KFP ops in :mod:`components.kfp_ops` are thin wrappers around these; tests call them
directly. "Stage" is kept for the stages of a backfill (:mod:`components.rollout`). What every step shares
(the ``step`` decorator, the config, the registry) is in :mod:`~components.steps.base`.
"""

from components.steps.base import registry_of
from components.steps.data import drift_step, plan_step, validate_step
from components.steps.gallery import (
    ingest_step,
    rollout_range_step,
    rollout_ranges_step,
    rollout_step,
    serve_first_model_step,
)
from components.steps.outcome import finish_step, note_blocked
from components.steps.release import evaluate_step, gate_step, register_step, resolve_production
from components.steps.rollback import rollback_production
from components.steps.training import compat_step, continual_step, training_budget
