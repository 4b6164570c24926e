"""MLflow tracking and model registry for compatflow.

One MLflow run per pipeline run (found again by its ``compatflow.run_id`` tag, so a retried task resumes
it), holding parameters, per-phase metrics, the reports and its model (an MLflow ``python_function`` model
around the safetensors weights and their sha256 manifest, :mod:`~.pyfunc`), registered as a model version so
that ``mlflow.pyfunc.load_model("models:/<name>@production")`` serves it.

Aliases: ``candidate`` (the latest registered, whatever the gate said), ``production`` (moved only by
:meth:`Registry.promote`: a gate pass and a completed rollout; the one it replaces becomes ``previous``) and
``previous`` (what :meth:`Registry.rollback` restores). The tag ``compatflow.production_history`` keeps the
versions that were production as a stack: promote pushes, rollback pops, so repeated rollbacks walk back.

Modules: :mod:`~.tracking` (runs, metrics, artifacts, the model), :mod:`~.pyfunc` (the MLflow flavour) and
:mod:`~.versions` (model versions, aliases, rollback); checkpoint integrity: :mod:`compat.models.integrity`.
"""

from compat.models.integrity import CheckpointIntegrityError
from components.adapters.registry.tracking import RegistryError, Tracking, metric_key
from components.adapters.registry.versions import (
    ALIASES,
    PromotionError,
    Registry,
    RollbackHookError,
)

__all__ = [
    "ALIASES",
    "CheckpointIntegrityError",
    "PromotionError",
    "Registry",
    "RegistryError",
    "RollbackHookError",
    "Tracking",
    "metric_key",
]
