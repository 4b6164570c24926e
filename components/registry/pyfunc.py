"""The ``loader_module`` that MLmodel files registered by earlier releases name: MLflow imports it by this
name to load such a version (``mlflow models serve``), so it stays, handing on the loader of
:mod:`components.adapters.registry.pyfunc`."""

from components.adapters.registry.pyfunc import _load_pyfunc

__all__ = ["_load_pyfunc"]
