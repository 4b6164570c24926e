"""MLflow tracking and model registry for compatflow.

One MLflow run per pipeline run (found again by its ``compatflow.run_id`` tag, so a retried task resumes
it); its model is registered as a version that ``mlflow.pyfunc.load_model("models:/<name>@production")``
serves. Aliases: ``candidate`` (the latest registered), ``production`` (moved only by
:meth:`Registry.promote`) and ``previous``; the tag ``compatflow.production_history`` is a stack that promote
pushes and rollback pops, so repeated rollbacks walk back.
"""

from compat.models.integrity import CheckpointIntegrityError
from components.adapters.registry.tracking import RegistryError, Tracking, metric_key
from components.adapters.registry.versions import ALIASES, PromotionError, Registry, RollbackHookError
