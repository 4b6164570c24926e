"""MLflow tracking and model registry for compatflow.

One MLflow run per pipeline run (found again by its ``compatflow.run_id`` tag, so a retried task
resumes it), holding parameters, per-phase metrics, the reports as artifacts and its model: an MLflow
``python_function`` model (:mod:`~components.adapters.registry.pyfunc`: text or image in, embedding out, with
a signature, an input example, the method and serving contract in its metadata) whose data are the safetensors
weights with their sha256 manifest. Candidates are registered as model versions whose source is the run's
``model`` artifact directory, so ``mlflow.pyfunc.load_model("models:/<name>@production")`` serves them.

Aliases:

* ``candidate``  -- the latest registered candidate, whatever the gate said (its tags say it).
* ``production`` -- moves only through :meth:`Registry.promote`, which needs a gate pass and a
  completed rollout; the version it replaces becomes ``previous``.
* ``previous``   -- what :meth:`Registry.rollback` restores.

Rollback history: the registered model's tag ``compatflow.production_history`` keeps the versions
that were production, oldest first (a stack). Promote pushes; rollback pops the current version,
makes the top of the stack production again and points ``previous`` at the entry below it (the
alias is removed when there is none), so repeated rollbacks walk further back.

Modules: :mod:`~components.adapters.registry.tracking` (runs, metrics, artifacts, the model),
:mod:`~components.adapters.registry.pyfunc` (the MLflow flavour) and
:mod:`~components.adapters.registry.versions` (model
versions, aliases, rollback); checkpoint integrity lives beside
the checkpoint code (:mod:`compat.models.integrity`).
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
