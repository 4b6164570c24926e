"""Service adapters, one module per outside system: the Milvus gallery index
(:mod:`~components.adapters.index`), Feast lineage and its feature repo (:mod:`~components.adapters.lineage`,
:mod:`~components.adapters.feature_repo`), the MLflow registry (:mod:`~components.adapters.registry`), the
Milvus standalone and MLflow tracking servers this machine starts (:mod:`~components.adapters.milvus_server`,
:mod:`~components.adapters.mlflow_server`) and the running-service record
(:mod:`~components.adapters.services`).
They import only :mod:`components.state` and :mod:`compat` below them."""
