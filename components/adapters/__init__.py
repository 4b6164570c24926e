"""Service adapters, one module per outside system: the Milvus gallery index, Feast lineage and its feature
repo, the MLflow registry, the Milvus standalone and MLflow tracking servers this machine starts, and the
running-service record. They import only :mod:`components.state` and :mod:`compat` below them."""
